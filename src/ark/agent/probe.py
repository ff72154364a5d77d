"""Learn which spine each source port takes by TTL-limited probes.

Paris-traceroute style: the whole 5-tuple stays fixed and only the TTL is small, so a
probe follows exactly the path a real flow with that 5-tuple would take and dies at the
spine (TTL 2 from a host behind its leaf). The spine's ICMP time-exceeded comes back on
the probing socket's error queue (``IP_RECVERR``), offender address included. No raw
sockets: it runs unprivileged.

Probe with the protocol the traffic uses: an L4 ECMP hash includes the protocol number,
so a UDP probe says nothing about a TCP flow with the same ports. A TCP probe is a
connect() whose SYN carries the small TTL; Linux queues ICMP errors for a socket in
SYN_SENT on its error queue as it does for UDP.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ark.core.pathmap import PROBED, PathMap

IP_RECVERR = 11  # Python 3.11 has no socket.IP_RECVERR
SO_EE_ORIGIN_ICMP = 2
ICMP_TIME_EXCEEDED = 11
PROTOS = {"tcp": 6, "udp": 17}
_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err


class ProbeError(ValueError):
    """Bad probe parameters."""


@dataclass
class ProbeResult:
    """Offender address per probed source port; ports with no answer are absent."""

    dst_ip: str
    dport: int
    proto: str
    offenders: dict[int, str] = field(default_factory=dict)
    sent: int = 0
    unusable: list[int] = field(default_factory=list)  # could not bind (port in use)
    seconds: float = 0.0
    ttl: int = 2


@dataclass(frozen=True)
class HopRouters:
    """Routers of every upward ECMP hop of a deeper fabric (a 3-tier Clos).

    A probe with TTL ``ttls[i]`` dies at a router of hop ``i``, whose address names the
    path chosen so far: ``tables[i][address]`` is the path prefix (hop 0: the leaf's choice;
    the last hop: the whole path). The path reads the members chosen at each hop as a
    mixed-radix number (``members`` per hop), so every earlier answer must equal the
    last answer's prefix; a port whose answers disagree maps to no path.
    """

    ttls: tuple[int, ...]
    tables: tuple[dict[str, int], ...]
    members: tuple[int, ...]

    def path(self, answers: Sequence[str | None]) -> int | None:
        if any(a is None for a in answers):
            return None
        prefixes = [t.get(a) for t, a in zip(self.tables, answers, strict=True) if a is not None]
        if any(p is None for p in prefixes):
            return None
        final = int(prefixes[-1])  # type: ignore[arg-type]
        below = 1
        for i in range(len(prefixes) - 1, -1, -1):
            if final // below != prefixes[i]:
                return None
            below *= self.members[i]
        return final

    def to_dict(self) -> dict[str, Any]:
        return {"hops": [{"ttl": t, "routers": r} for t, r in zip(self.ttls, self.tables, strict=True)],
                "members": list(self.members)}

    def for_paths(self, paths: int) -> HopRouters:
        """The hops that choose between ``paths`` paths: a peer in the same pod is reached
        after the first hop's choice alone (a deeper probe would die past the fabric)."""
        n = 1
        for h, m in enumerate(self.members):
            n *= m
            if n == paths:
                return HopRouters(self.ttls[:h + 1], self.tables[:h + 1], self.members[:h + 1])
        raise ProbeError(f"paths: {paths} is not a product of the first hops' members {list(self.members)}")


Routers = Mapping[str, int] | HopRouters  # one hop (router address -> path, TTL 2), or several


def _open(proto: str, src_ip: str, port: int, ttl: int) -> socket.socket | None:
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_IP, IP_RECVERR, 1)
        s.setsockopt(socket.SOL_IP, socket.IP_TTL, ttl)
        s.setblocking(False)
        s.bind((src_ip, port))
    except OSError as e:
        s.close()
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            return None
        raise
    return s


def _offender(s: socket.socket) -> str | None:
    """The router that sent a time-exceeded for this socket's probe, if one did."""
    try:
        _, anc, _, _ = s.recvmsg(64, 512, socket.MSG_ERRQUEUE)
    except (BlockingIOError, InterruptedError):
        return None
    for level, kind, data in anc:
        if level == socket.SOL_IP and kind == IP_RECVERR and len(data) >= _EE.size + 8:
            _, origin, etype, _code, _, _, _ = _EE.unpack_from(data)
            if origin == SO_EE_ORIGIN_ICMP and etype == ICMP_TIME_EXCEEDED:
                return socket.inet_ntoa(data[_EE.size + 4 : _EE.size + 8])  # sockaddr_in.sin_addr
    return None


def probe_ports(
    dst_ip: str,
    dport: int,
    ports: Sequence[int],
    *,
    proto: str = "tcp",
    ttl: int = 2,
    src_ip: str = "",
    timeout_s: float = 0.3,
    retries: int = 2,
    batch: int = 256,
    sport: int = 0,
) -> ProbeResult:
    """Send one TTL-limited probe per source port (``batch`` in flight) and read the offenders.

    With ``sport``, every probe leaves from that one source port and ``ports`` are the
    destination ports (``dport`` is unused): the path of the bytes a listener on ``sport``
    sends back on connections made to it from each of those ports (the reverse direction
    of a connection the peer opens). ``offenders`` is then keyed by destination port."""
    if proto not in PROTOS:
        raise ProbeError(f"proto: must be one of {', '.join(PROTOS)}; got {proto!r}")
    if not 1 <= ttl <= 255:
        raise ProbeError(f"ttl: must be 1..255; got {ttl}")
    if not 0 <= dport <= 0xFFFF or not 0 <= sport <= 0xFFFF:
        raise ProbeError(f"dport, sport: must be 0..65535; got {dport}, {sport}")
    res = ProbeResult(dst_ip, dport, proto, ttl=ttl)
    t0 = time.perf_counter()
    todo = [int(p) for p in ports]
    for _attempt in range(retries + 1):
        missing: list[int] = []
        for i in range(0, len(todo), batch):
            missing += _probe_batch(res, todo[i : i + batch], src_ip, ttl, timeout_s, sport)
        todo = missing
        if not todo:
            break
    res.seconds = time.perf_counter() - t0
    return res


def _probe_batch(res: ProbeResult, ports: list[int], src_ip: str, ttl: int, timeout_s: float,
                 sport: int = 0) -> list[int]:
    socks: dict[int, tuple[socket.socket, int]] = {}
    poller = select.poll()
    try:
        for port in ports:
            s = _open(res.proto, src_ip, sport or port, ttl)
            if s is None:
                res.unusable.append(port)
                continue
            to = (res.dst_ip, port if sport else res.dport)
            try:
                if res.proto == "udp":
                    s.sendto(b"ark-probe", to)
                elif s.connect_ex(to) in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                    # A live connection owns this exact 4-tuple (probing a busy fabric): skip it.
                    s.close()
                    res.unusable.append(port)
                    continue
            except OSError:
                s.close()
                continue
            res.sent += 1
            socks[s.fileno()] = (s, port)
            poller.register(s.fileno(), select.POLLERR)
        deadline = time.monotonic() + timeout_s
        pending = set(socks)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ev in poller.poll(left * 1000):
                if fd not in pending:
                    continue
                s, port = socks[fd]
                off = _offender(s)
                if off is not None:
                    res.offenders[port] = off
                    pending.discard(fd)
                    poller.unregister(fd)
        return [socks[fd][1] for fd in pending]
    finally:
        for s, _ in socks.values():
            s.close()


def sample_ports(port_range: tuple[int, int], n: int, seed: int, exclude: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports of the range (all of them when ``n`` is 0 or larger), seeded."""
    lo, hi = port_range
    allp = np.setdiff1d(np.arange(lo, hi + 1), np.asarray(exclude, dtype=np.int64))
    if n <= 0 or n >= len(allp):
        return [int(p) for p in allp]
    rng = np.random.default_rng(seed)
    return sorted(int(p) for p in rng.choice(allp, size=n, replace=False))


def pathmap_from_probes(
    results: Sequence[ProbeResult],
    routers: Routers,
    *,
    src_ip: str,
    paths: int,
    port_range: tuple[int, int],
) -> tuple[PathMap, int]:
    """A (sampled) path map from probe answers, and the number of unknown offenders.

    ``routers`` names the spine (path index) behind each router address, or (a
    :class:`HopRouters`) the path prefix behind each router of every hop: a port's path
    then comes from its answers at every hop's TTL.
    """
    if not results:
        raise ProbeError("results: need at least one probe result")
    buckets: list[list[int]] = [[] for _ in range(paths)]
    unknown = 0
    for port, k in _paths_of(results, routers).items():
        if k is None or not 0 <= k < paths:
            unknown += 1
            continue
        buckets[k].append(port)
    first = results[0]
    pm = PathMap(
        PROBED, 0, PROBED, src_ip, first.dst_ip, first.dport, port_range,
        tuple(np.asarray(sorted(set(b)), dtype=np.int64) for b in buckets), PROTOS[first.proto],
    )
    pm.validate()
    return pm, unknown


def _paths_of(results: Sequence[ProbeResult], routers: Routers) -> dict[int, int | None]:
    """Path per answered port (None: an unknown router, or hops that disagree)."""
    if not isinstance(routers, HopRouters):
        return {port: routers.get(off) for r in results for port, off in r.offenders.items()}
    answers: dict[int, dict[int, str]] = {}
    for r in results:
        for port, off in r.offenders.items():
            answers.setdefault(port, {})[r.ttl] = off
    return {port: routers.path([got.get(t) for t in routers.ttls]) for port, got in answers.items()}


def learn(
    dst_ip: str,
    dport: int,
    routers: Routers,
    *,
    src_ip: str,
    paths: int,
    port_range: tuple[int, int],
    sample: int = 128,
    min_per_path: int = 4,
    max_rounds: int = 4,
    proto: str = "tcp",
    seed: int = 0,
    exclude: Sequence[int] = (),
) -> tuple[PathMap, dict[str, float | int]]:
    """Probe until every path has ``min_per_path`` ports (or ``max_rounds`` samples), build the map."""
    if isinstance(routers, HopRouters):
        routers = routers.for_paths(paths)
    results: list[ProbeResult] = []
    tried: set[int] = set(exclude)
    pm: PathMap | None = None
    unknown = 0
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        ports = sample_ports(port_range, sample, seed + rounds, sorted(tried))
        if not ports:
            break
        tried.update(ports)
        for ttl in routers.ttls if isinstance(routers, HopRouters) else (2,):
            results.append(probe_ports(dst_ip, dport, ports, proto=proto, src_ip=src_ip, ttl=ttl))
        pm, unknown = pathmap_from_probes(results, routers, src_ip=src_ip, paths=paths, port_range=port_range)
        # More rounds only for a path that answered but rarely. A path no probe of a full
        # round reached is gone (a failed link): with K paths and n probes the chance of
        # missing a live one is ((K-1)/K)**n, 1e-16 for K = 4, n = 128.
        if sample <= 0 or all(c == 0 or c >= min_per_path for c in pm.counts()):
            break
    if pm is None:
        raise ProbeError(f"port_range: no source port of {port_range[0]}-{port_range[1]} left to probe")
    stats: dict[str, float | int] = {
        "probes_sent": sum(r.sent for r in results),
        "answered": sum(len(r.offenders) for r in results),
        "unknown_offender": unknown,
        "unusable_ports": sum(len(r.unusable) for r in results),
        "rounds": rounds,
        "seconds": round(sum(r.seconds for r in results), 6),
    }
    return pm, stats


def probe_peers(
    cluster: Any,
    host: str,
    peers: Sequence[str] | None,
    routers: Routers,
    *,
    sample: int = 128,
    min_per_path: int = 4,
    proto: str = "tcp",
) -> dict[str, tuple[PathMap, dict[str, float | int]]]:
    """Learn this host's path map towards each peer (default: every host on another leaf)."""
    fab, s = cluster.fabric, cluster
    me = cluster.host(host).index
    if peers is None:
        targets = [h.index for h in fab.hosts if fab.n_paths(me, h.index) > 1]
    else:
        targets = [cluster.host(p).index for p in peers]
    out = {}
    for j in targets:
        if j == me:
            raise ProbeError(f"peers: {host} cannot probe itself")
        pm, stats = learn(
            fab.hosts[j].ip, s.dport, routers, src_ip=fab.hosts[me].ip, paths=fab.n_paths(me, j),
            port_range=s.source_ports, sample=sample, min_per_path=min_per_path, proto=proto,
            seed=me * 100_003 + j,
        )
        out[fab.hosts[j].name] = (pm, stats)
    return out


def load_routers(path: str) -> Routers:
    """A routers file: a JSON object, router (spine) address -> path index; or, for a fabric
    with several upward ECMP hops, ``{"hops": [{"ttl": 2, "routers": {address: prefix}}, ...],
    "members": [per hop]}`` (see :class:`HopRouters`)."""
    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        if "hops" not in raw:
            return {str(k): int(v) for k, v in raw.items()}
        hops = raw["hops"]
        members = tuple(int(m) for m in raw["members"])
        if not hops or len(members) != len(hops) or any(m < 1 for m in members):
            raise ValueError("hops and members must be non-empty lists of one length")
        return HopRouters(tuple(int(h["ttl"]) for h in hops),
                          tuple({str(k): int(v) for k, v in h["routers"].items()} for h in hops), members)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ProbeError(f"routers_file: {path} must be a JSON object of address -> path index, or "
                         f"{{\"hops\": [...], \"members\": [...]}} ({e})") from None


def _routers_for(cluster: Any, routers: Routers | None) -> Routers:
    if cluster.routers_file is None or cluster.pathmap_dir is None:
        raise ProbeError("cluster.routers_file: needed (with pathmap_dir) to probe")
    return routers if routers is not None else load_routers(cluster.routers_file)


def refresh(cluster: Any, host: str, peers: Sequence[str] | None = None,
            routers: Routers | None = None) -> dict[str, dict[str, Any]]:
    """Probe as the cluster file says and write the maps to its pathmap_dir.

    Default peers: those this host already has probed maps for, else every host behind
    another leaf. Returns per peer the probe figures and ports per path.
    """
    routers = _routers_for(cluster, routers)

    if peers is None:
        known = [h.name for h in cluster.hosts if h.name != host and cluster.pathmap_file(host, h.name).exists()]
        peers = known or None
    learnt = probe_peers(cluster, host, peers, routers, sample=cluster.probe_sample, proto=cluster.probe_proto)
    out: dict[str, dict[str, Any]] = {}
    for peer, (pm, stats) in learnt.items():
        f = cluster.pathmap_file(host, peer)
        f.parent.mkdir(parents=True, exist_ok=True)
        pm.save(f)
        out[peer] = {**stats, "ports_per_path": pm.counts()}
    return out


def check(cluster: Any, host: str, per_path: int = 4, seed: int = 0,
          routers: Routers | None = None) -> tuple[list[str], int]:
    """Re-probe a few known ports of every probed map; peers whose map no longer holds.

    Cheap enough to run every second: ``per_path`` ports per path and peer. A re-hash
    (a link failed or came back) moves a share of the ports to other spines, so some of
    the sampled ones answer from another spine than the map says. Returns (peers whose
    map changed, probes sent).
    """
    import random

    routers = _routers_for(cluster, routers)
    fab, s = cluster.fabric, cluster
    me = cluster.host(host).index
    rng = random.Random(seed)
    changed, sent = [], 0
    for h in cluster.hosts:
        f = cluster.pathmap_file(host, h.name)
        if h.name == host or not f.exists():
            continue
        pm = PathMap.load(f)
        ports = [p for b in pm.buckets for p in rng.sample(b.tolist(), min(per_path, len(b)))]
        hops = routers.for_paths(pm.paths) if isinstance(routers, HopRouters) else routers
        results = [probe_ports(fab.hosts[h.index].ip, s.dport, ports, proto=s.probe_proto, src_ip=fab.hosts[me].ip,
                               retries=0, ttl=ttl)
                   for ttl in (hops.ttls if isinstance(hops, HopRouters) else (2,))]
        sent += sum(r.sent for r in results)
        if any(k != pm.path_of(port) for port, k in _paths_of(results, hops).items()):
            changed.append(h.name)
    return changed, sent
