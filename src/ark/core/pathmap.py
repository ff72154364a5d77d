"""Boot-time path maps M(p_k) and source-port buckets.

A :class:`PathMap` says, for one (source, destination, destination port), which source
ports the fabric's switches send over each equal-cost path. :class:`PortBuckets` hands
ports out of a map without giving a port that is still in use towards the same peer.

A :class:`LazyPathMap` is the same map of a fabric, hashed a chunk of ports at a time and
only as far as the questions asked need (a simulation of thousands of hosts touches a map
per host pair and mostly asks it for one port): the first ports of a path, the paths some
port reaches (found within a few hundred ports unless some path is unreachable), the path
of one port (the switches' own hash). Every answer equals the full map's; both satisfy
:class:`PortMap`, what :class:`PortBuckets` and the cores read.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ark.core.hashing import Seeds, hash_model, select, select_many
from ark.core.topology import EcmpHop, Fabric

ROCE_PORT_RANGE = (0xC000, 0xFFFF)  # ports a RoCEv2 GRH flow label can produce
FULL_PORT_RANGE = (0, 0xFFFF)
MAX_PATHS = 32767  # a map's per-port path index is an int16
# ``hash`` and ``selection`` of a map learnt by probing (ark.agent.probe): it covers only the
# probed ports of its range, and ports it does not know map to path -1.
PROBED = "probe"


class PathMapError(ValueError):
    """Invalid path-map request or file."""


def parse_port_range(text: str) -> tuple[int, int]:
    """Parse ``LO-HI`` (inclusive) into a checked tuple."""
    try:
        lo_s, hi_s = text.split("-")
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise PathMapError(f"port-range: expected LO-HI with 0 <= LO <= HI <= 65535, got {text!r}") from None
    check_port_range((lo, hi))
    return lo, hi


def check_port_range(rng: tuple[int, int]) -> None:
    lo, hi = rng
    if not (0 <= lo <= hi <= 0xFFFF):
        raise PathMapError(f"port-range: expected 0 <= LO <= HI <= 65535, got {lo}-{hi}")


def _ip_int(ip: str | int, what: str) -> int:
    if isinstance(ip, int):
        return ip
    try:
        return int(ipaddress.IPv4Address(ip))
    except ValueError:
        raise PathMapError(f"{what}: not an IPv4 address: {ip!r}") from None


@dataclass(frozen=True)
class PathMap:
    """Source ports per path for one (src_ip, dst_ip, dport)."""

    hash: str
    seed: int
    selection: str
    src_ip: str
    dst_ip: str
    dport: int
    port_range: tuple[int, int]
    buckets: tuple[npt.NDArray[np.int64], ...]
    proto: int = 17
    _lookup: npt.NDArray[np.int16] = field(
        repr=False, compare=False, default_factory=lambda: np.zeros(0, dtype=np.int16)
    )

    def __post_init__(self) -> None:
        lo, hi = self.port_range
        if len(self._lookup) == hi - lo + 1:  # given by the builder, which knows it already
            return
        lut = np.full(hi - lo + 1, -1, dtype=np.int16)
        for k, ports in enumerate(self.buckets):
            lut[ports - lo] = k
        object.__setattr__(self, "_lookup", lut)

    @property
    def paths(self) -> int:
        return len(self.buckets)

    def path_of(self, port: int) -> int:
        """The path a source port takes (from the map, not by hashing)."""
        lo, hi = self.port_range
        if not lo <= port <= hi:
            raise PathMapError(f"port {port} outside the map's range {lo}-{hi}")
        return int(self._lookup[port - lo])

    @property
    def usable_mask(self) -> int:
        """Bit k set: some source port reaches path k."""
        return sum(1 << k for k, b in enumerate(self.buckets) if len(b))

    def ports_of(self, path: int, need: int | None = None) -> list[int]:
        """The ports of ``path`` in order (a full map always gives them all)."""
        return list(self.buckets[path].tolist())

    def static_ports(self) -> list[int]:
        """One source port per path (the bucket's first; -1 if no port reaches it)."""
        return [int(b[0]) if len(b) else -1 for b in self.buckets]

    def counts(self) -> list[int]:
        return [len(b) for b in self.buckets]

    @property
    def sampled(self) -> bool:
        return self.hash == PROBED

    def known_ports(self) -> npt.NDArray[np.int64]:
        """Every port the map places on a path, sorted."""
        if not self.buckets:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(self.buckets))

    def to_dict(self) -> dict[str, object]:
        return {
            "hash": self.hash,
            "seed": self.seed,
            "selection": self.selection,
            "src": self.src_ip,
            "dst": self.dst_ip,
            "dport": self.dport,
            "proto": self.proto,
            "port_range": list(self.port_range),
            "paths": self.paths,
            "ports": {str(k): b.tolist() for k, b in enumerate(self.buckets)},
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> PathMap:
        try:
            paths = int(d["paths"])  # type: ignore[call-overload]
            ports = d["ports"]
            assert isinstance(ports, dict)
            buckets = tuple(np.asarray(sorted(ports[str(k)]), dtype=np.int64) for k in range(paths))
            rng = d.get("port_range")
            if rng is None:
                allp = np.concatenate(buckets) if buckets else np.zeros(0, dtype=np.int64)
                rng = [int(allp.min()), int(allp.max())]
            pm = cls(
                hash=str(d["hash"]),
                seed=int(d["seed"]),  # type: ignore[call-overload]
                selection=str(d.get("selection", "modulo")),
                src_ip=str(d["src"]),
                dst_ip=str(d["dst"]),
                dport=int(d["dport"]),  # type: ignore[call-overload]
                port_range=(int(rng[0]), int(rng[1])),  # type: ignore[index]
                buckets=buckets,
                proto=int(d.get("proto", 17)),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise PathMapError(f"path map: malformed ({type(e).__name__}: {e})") from None
        pm.validate()
        return pm

    def validate(self) -> None:
        """Every port of the range in exactly one bucket (a probed map: at most one)."""
        lo, hi = self.port_range
        allp = self.known_ports()
        if self.sampled:
            if len(allp) and (allp[0] < lo or allp[-1] > hi or np.any(np.diff(allp) == 0)):
                raise PathMapError("path map: probed buckets overlap or leave the port range")
            return
        if len(allp) != hi - lo + 1 or not np.array_equal(allp, np.arange(lo, hi + 1)):
            raise PathMapError("path map: buckets do not partition the port range")

    def save(self, path: str | Path) -> None:
        # Atomic: an agent may load the file while a refresh rewrites it.
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> PathMap:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PathMapError(f"path map {path}: {e}") from None
        if not isinstance(d, dict):
            raise PathMapError(f"path map {path}: expected a JSON object")
        return cls.from_dict(d)


def compute_buckets(
    hash_name: str,
    seed: int,
    src_ip: str | int,
    dst_ip: str | int,
    dport: int,
    paths: int,
    port_range: tuple[int, int] = ROCE_PORT_RANGE,
    selection: str = "modulo",
    proto: int = 17,
) -> PathMap:
    """Hash every source port of ``port_range`` and bucket it by next-hop member."""
    model = hash_model(hash_name)
    check_port_range(port_range)
    lo, hi = port_range
    if not 1 <= paths <= MAX_PATHS:
        raise PathMapError(f"paths: must be 1..{MAX_PATHS} (a map's path index is 16 bits); got {paths}")
    if not 0 <= dport <= 0xFFFF:
        raise PathMapError(f"dport: must be 0..65535, got {dport}")
    if not 0 <= seed < 2**32:
        raise PathMapError(f"seed: must be 0..4294967295, got {seed}")
    s, d = _ip_int(src_ip, "src"), _ip_int(dst_ip, "dst")
    ports = np.arange(lo, hi + 1, dtype=np.int64)
    member = select_many(model.hash_ports(seed, s, d, dport, ports, proto), paths, selection, model.bits)
    return pathmap_from_paths(hash_name, seed, selection, s, d, dport, ports, member, paths, proto)


def pathmap_from_paths(
    hash_name: str, seed: int, selection: str, s: int, d: int, dport: int,
    ports: npt.NDArray[np.int64], path: npt.NDArray[np.int64], paths: int, proto: int,
) -> PathMap:
    """The map of a contiguous port range from each port's path."""
    lut = path.astype(np.int16)
    ordered = ports[np.argsort(lut, kind="stable")]  # stable: every bucket stays sorted
    bounds = np.concatenate(([0], np.cumsum(np.bincount(lut, minlength=paths)))).tolist()
    buckets = tuple(ordered[bounds[k]:bounds[k + 1]] for k in range(paths))
    rng = (int(ports[0]), int(ports[-1]))
    return PathMap(hash_name, seed, selection, str(ipaddress.IPv4Address(s)), str(ipaddress.IPv4Address(d)),
                   dport, rng, buckets, proto, lut)


def fabric_pathmap(
    fabric: Fabric,
    src: int,
    dst: int,
    dport: int = 4791,
    port_range: tuple[int, int] = ROCE_PORT_RANGE,
    proto: int = 17,
) -> PathMap:
    """The path map for host ``src`` -> host ``dst`` over ``fabric``, inverting the hash
    at every ECMP decision point.

    In a 2-tier Clos only the source leaf has a choice (spine ``k`` = path ``k``). In a
    3-tier Clos the leaf picks an aggregation switch and that switch a core: every port is
    hashed by the leaf, then by the aggregation switch the leaf sent it to, each with its
    own model, seed and selection, and the path is the members read as a mixed-radix
    number (:meth:`~ark.core.topology.Fabric.ecmp_hops`).
    """
    hops = fabric.ecmp_hops(src, dst)
    first = fabric.source_switch(src)
    if len(hops) <= 1:
        return compute_buckets(first.hash, first.seed, fabric.hosts[src].ip, fabric.hosts[dst].ip, dport,
                               fabric.n_paths(src, dst), port_range, first.selection, proto)
    check_port_range(port_range)
    if not 0 <= dport <= 0xFFFF:
        raise PathMapError(f"dport: must be 0..65535, got {dport}")
    s_ip, d_ip = fabric.hosts[src].ip_int, fabric.hosts[dst].ip_int
    lo, hi = port_range
    ports = np.arange(lo, hi + 1, dtype=np.int64)
    path = np.zeros(len(ports), dtype=np.int64)
    for hop in hops:
        path = path * hop.members + _hop_members(hop, path, s_ip, d_ip, dport, ports, proto)
    return pathmap_from_paths(first.hash, first.seed, first.selection, s_ip, d_ip, dport, ports, path,
                       fabric.n_paths(src, dst), proto)


def _hop_members(
    hop: EcmpHop, prefix: npt.NDArray[np.int64], s_ip: int, d_ip: int, dport: int,
    ports: npt.NDArray[np.int64], proto: int,
) -> npt.NDArray[np.int64]:
    """The member each port's switch at this hop picks; the switch is ``hop.switches[prefix]``.

    Switches sharing a hash model and selection are hashed in one vectorised pass, each
    port under its own switch's seed.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, sw in enumerate(hop.switches):
        groups.setdefault((sw.hash, sw.selection), []).append(i)
    seeds = np.asarray([sw.seed for sw in hop.switches], dtype=np.int64)
    if len(groups) == 1:  # the usual case: one model and selection per tier
        ((name, selection),) = groups
        model = hash_model(name)
        seed: Seeds = int(seeds[0]) if len(hop.switches) == 1 else (seeds, prefix)
        return select_many(model.hash_ports(seed, s_ip, d_ip, dport, ports, proto), hop.members, selection,
                           model.bits)
    member = np.empty(len(ports), dtype=np.int64)
    for (name, selection), members in groups.items():
        sel = np.isin(prefix, members)
        model = hash_model(name)
        member[sel] = select_many(model.hash_ports((seeds, prefix[sel]), s_ip, d_ip, dport, ports[sel], proto),
                                  hop.members, selection, model.bits)
    return member


class PortMap(Protocol):
    """What :class:`PortBuckets` and a core read of a map (:class:`PathMap`, :class:`LazyPathMap`)."""

    @property
    def paths(self) -> int: ...

    @property
    def port_range(self) -> tuple[int, int]: ...

    @property
    def sampled(self) -> bool: ...

    @property
    def buckets(self) -> tuple[npt.NDArray[np.int64], ...]: ...

    @property
    def usable_mask(self) -> int: ...

    def path_of(self, port: int) -> int: ...

    def ports_of(self, path: int, need: int | None = None) -> list[int]: ...

    def known_ports(self) -> npt.NDArray[np.int64]: ...


class LazyPathMap:
    """:func:`fabric_pathmap`'s map, hashed ``CHUNK`` ports at a time, in port order, as
    far as each question needs (see the module docstring)."""

    CHUNK = 512
    sampled = False

    def __init__(self, fabric: Fabric, src: int, dst: int, dport: int = 4791,
                 port_range: tuple[int, int] = ROCE_PORT_RANGE, proto: int = 17) -> None:
        check_port_range(port_range)
        if not 0 <= dport <= 0xFFFF:
            raise PathMapError(f"dport: must be 0..65535, got {dport}")
        self._fabric, self._src, self._dst, self._dport, self._proto = fabric, src, dst, dport, proto
        self._hops = fabric.ecmp_hops(src, dst)
        self._n = fabric.n_paths(src, dst)
        self._range = port_range
        self._next = port_range[0]  # the first port not hashed yet
        self._lut = np.empty(port_range[1] - port_range[0] + 1, dtype=np.int16)  # valid below _next
        self._lists: list[list[int] | None] = [None] * self._n  # per path, up to _next (made when asked)
        self._seen = 0  # bit k: a port of path k is known

    @property
    def paths(self) -> int:
        return self._n

    @property
    def port_range(self) -> tuple[int, int]:
        return self._range

    @property
    def complete(self) -> bool:
        return self._next > self._range[1]

    def _scan(self) -> None:
        """Hash the next chunk of ports, exactly as :func:`fabric_pathmap` hashes them all."""
        fab, hops, lo = self._fabric, self._hops, self._next
        hi = min(self._range[1], lo + self.CHUNK - 1)
        ports = np.arange(lo, hi + 1, dtype=np.int64)
        s_ip, d_ip = fab.hosts[self._src].ip_int, fab.hosts[self._dst].ip_int
        if len(hops) <= 1:
            first = fab.source_switch(self._src)
            model = hash_model(first.hash)
            path = select_many(model.hash_ports(first.seed, s_ip, d_ip, self._dport, ports, self._proto), self._n,
                               first.selection, model.bits)
        else:
            path = np.zeros(len(ports), dtype=np.int64)
            for hop in hops:
                path = path * hop.members + _hop_members(hop, path, s_ip, d_ip, self._dport, ports, self._proto)
        base = self._range[0]
        self._lut[lo - base:hi - base + 1] = path
        for k in np.flatnonzero(np.bincount(path, minlength=self._n)).tolist():
            self._seen |= 1 << k
        self._lists = [None] * self._n
        self._next = hi + 1

    @property
    def usable_mask(self) -> int:
        every = (1 << self._n) - 1
        while self._seen != every and not self.complete:
            self._scan()
        return self._seen

    def ports_of(self, path: int, need: int | None = None) -> list[int]:
        """The ports of ``path`` in order: at least ``need`` of them, or all there are
        (``need`` None: all). The list grows in place as later questions hash on."""
        lst = self._lists[path]
        while lst is None or ((need is None or len(lst) < need) and not self.complete):
            if lst is not None:
                self._scan()
            base = self._range[0]
            lst = self._lists[path] = (np.flatnonzero(self._lut[:self._next - base] == path) + base).tolist()
        return lst

    def path_of(self, port: int) -> int:
        lo, hi = self._range
        if not lo <= port <= hi:
            raise PathMapError(f"port {port} outside the map's range {lo}-{hi}")
        if port >= self._next:  # not hashed yet: the switches' own hash, port by port
            return switch_path(self._fabric, self._src, self._dst, port, self._dport, self._proto)
        return int(self._lut[port - lo])

    @property
    def buckets(self) -> tuple[npt.NDArray[np.int64], ...]:
        return tuple(np.asarray(self.ports_of(k), dtype=np.int64) for k in range(self._n))

    def static_ports(self) -> list[int]:
        """One source port per path (its first; -1 if no port reaches it)."""
        return [lst[0] if (lst := self.ports_of(k, 1)) else -1 for k in range(self._n)]

    def known_ports(self) -> npt.NDArray[np.int64]:
        return np.sort(np.concatenate(self.buckets)) if self._n else np.zeros(0, dtype=np.int64)


def pathmap_filename(src: str, dst: str, dport: int) -> str:
    """The file a map for host ``src`` -> host ``dst`` (names) is saved under."""
    return f"{src}__{dst}__{dport}.json"


class PathMapCache:
    """Path maps per (src, dst, dport), computed or loaded once and kept.

    With ``directory``, a map saved there (``ark pathmap --save`` or learnt by probing)
    wins over the fabric's hash model; :meth:`clear` makes the next lookup read the
    files again (after a refresh rewrote them). With ``capacity``, only that many maps
    stay, the least recently used going first (a simulation of a thousand hosts touches
    far more pairs than it can keep; a map is a function of the fabric, so computing it
    again gives the same map). With ``lazy``, a map the fabric's hash model gives is a
    :class:`LazyPathMap` (a simulator's choice: the same answers for a fraction of the hashing).
    """

    def __init__(
        self, fabric: Fabric, port_range: tuple[int, int] = ROCE_PORT_RANGE, directory: str | Path | None = None,
        capacity: int | None = None, lazy: bool = False,
    ) -> None:
        if capacity is not None and capacity < 1:
            raise PathMapError(f"capacity: must be >= 1 or None; got {capacity}")
        self.fabric, self.port_range = fabric, port_range
        self.directory = None if directory is None else Path(directory)
        self.capacity = capacity
        self.lazy = lazy
        self._maps: dict[tuple[int, int, int], PathMap | LazyPathMap] = {}

    def file_for(self, src: int, dst: int, dport: int) -> Path | None:
        if self.directory is None:
            return None
        hosts = self.fabric.hosts
        return self.directory / pathmap_filename(hosts[src].name, hosts[dst].name, dport)

    def clear(self) -> None:
        self._maps.clear()

    def forget_dport(self, dport: int) -> None:
        """Drop every map towards ``dport`` (a core that no longer uses it)."""
        for key in [k for k in self._maps if k[2] == dport]:
            del self._maps[key]

    def __call__(self, src: int, dst: int, dport: int) -> PathMap | LazyPathMap:
        key = (src, dst, dport)
        maps = self._maps
        m = maps.get(key)
        if m is None:
            m = maps[key] = self._load(src, dst, dport)
            if self.capacity is not None and len(maps) > self.capacity:
                del maps[next(iter(maps))]  # the least recently used
        elif self.capacity is not None:
            maps[key] = maps.pop(key)
        return m

    def peek(self, src: int, dst: int, dport: int) -> PathMap | LazyPathMap:
        """The map, without keeping a new one (a one-off question must not grow the cache)."""
        m = self._maps.get((src, dst, dport))
        return m if m is not None else self._load(src, dst, dport)

    def _load(self, src: int, dst: int, dport: int) -> PathMap | LazyPathMap:
        path = self.file_for(src, dst, dport)
        if path is None or not path.is_file():
            if self.lazy:
                return LazyPathMap(self.fabric, src, dst, dport, self.port_range)
            return fabric_pathmap(self.fabric, src, dst, dport, self.port_range)
        m = PathMap.load(path)
        want = self.fabric.n_paths(src, dst)
        if m.paths != want:
            raise PathMapError(f"path map {path}: {m.paths} paths, the fabric has {want}")
        return m


def switch_path(fabric: Fabric, src: int, dst: int, sport: int, dport: int, proto: int = 17) -> int:
    """The path the simulated switches pick for one packet, each hashing its exact key
    bytes at its own ECMP decision, hop by hop."""
    path = 0
    s_ip, d_ip = fabric.hosts[src].ip_int, fabric.hosts[dst].ip_int
    for hop in fabric.ecmp_hops(src, dst):
        sw = hop.switches[path] if len(hop.switches) > 1 else hop.switches[0]
        model = hash_model(sw.hash)
        h = model.hash_one(sw.seed, s_ip, d_ip, sport, dport, proto)
        path = path * hop.members + select(h, hop.members, sw.selection, model.bits)
    return path


class PortBuckets:
    """Hands out source ports per path, never one still in use towards this peer.

    Each path's bucket is walked round-robin from a cursor, so consecutive flows get
    different ports even after release (a NIC or switch may still hold state for the
    previous one).
    """

    def __init__(self, pathmap: PortMap) -> None:
        self.map = pathmap
        # A path's ports as a list (list indexing beats numpy's), made when first needed;
        # from a lazy map, as many as the walk has needed so far.
        self._lists: list[list[int] | None] = [None] * pathmap.paths
        self._cursor = [0] * pathmap.paths
        self.in_use: set[int] = set()
        # Bit k set: some source port reaches path k.
        self.usable_mask = pathmap.usable_mask

    def _list(self, path: int) -> list[int]:
        """Every port of ``path``."""
        lst = self._lists[path] = self.map.ports_of(path)
        return lst

    @property
    def cursors(self) -> tuple[int, ...]:
        """Where each path's round-robin walk stands (all a bucket with no port in use holds)."""
        return tuple(self._cursor)

    @cursors.setter
    def cursors(self, value: tuple[int, ...]) -> None:
        if len(value) != self.map.paths:
            raise PathMapError(f"cursors: need {self.map.paths}, got {len(value)}")
        self._cursor = list(value)

    def take(self, path: int) -> int:
        bucket = self._lists[path]
        c = self._cursor[path]
        if bucket is None or len(bucket) <= c + 1:  # the port at the cursor, and whether it is the last
            bucket = self._lists[path] = self.map.ports_of(path, c + 2)
        if bucket and bucket[c % len(bucket)] not in self.in_use:  # the usual case: the next port is free
            port: int = bucket[c % len(bucket)]
            self._cursor[path] = (c + 1) % len(bucket)
            self.in_use.add(port)
            return port
        taken = self.try_take(path)  # scan on from the cursor
        if taken is None:
            n = len(self.map.buckets[path])
            if n == 0:
                raise PathMapError(f"path {path}: no source port in range maps to it")
            raise PathMapError(f"path {path}: all {n} source ports are in use")
        return taken

    def try_take(self, path: int) -> int | None:
        """A free port of ``path`` (marked in use), or None when there is none."""
        bucket = self._list(path)
        n = len(bucket)
        c = self._cursor[path]
        for i in range(n):
            port: int = bucket[(c + i) % n]
            if port not in self.in_use:
                self._cursor[path] = (c + i + 1) % n
                self.in_use.add(port)
                return port
        return None

    def claim(self, port: int) -> None:
        self.in_use.add(port)

    def give(self, port: int) -> None:
        self.in_use.discard(port)
