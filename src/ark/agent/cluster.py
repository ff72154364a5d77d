"""Cluster files: which hosts run agents, where they listen, their keys and settings.

Example::

    [cluster]
    policy = "ark"                 # or "ark-balance"
    dport = 4791
    port_range = "49152-65535"     # source ports handed out (RoCEv2: 49152-65535)
    lease_min_s = 1.0              # lease = lease_min_s + lease_slack x bytes x 8 / rate
    lease_slack = 2.0
    split_part_bytes = 67108864    # multi-path leases (parts = 0): one part per this many bytes
    heartbeat_s = 0.5
    peer_timeout_s = 2.0
    sync_timeout_s = 1.0
    retention_s = 5.0
    # pathmap_dir = "maps"         # optional: <src>__<dst>__<dport>.json files (ark pathmap --save)
    # routers_file = "routers.json"  # optional: router address -> path index; lets the agent
    #                              # probe (ark probe, API op "refresh") into pathmap_dir
    # probe_proto = "udp"          # probe with your flows' protocol (RoCEv2: udp)
    # probe_sample = 128           # probed source ports per peer (0: the whole port_range)
    # probe_check_s = 1.0          # re-probe a few ports this often; on a re-hash, re-probe and re-path

    [fabric]                       # the same keys as an experiment config's [fabric]
    preset = "paper"

    [[hosts]]
    name = "gpu0"                  # a host of the fabric
    control = "tcp://10.9.0.1:7100"  # where this agent listens for its peers (management network)
    api = "ipc:///run/ark/gpu0.sock" # local API for serving engines on this host
    public_key = "<40 z85 characters>"
    secret_key_file = "keys/gpu0.key_secret"  # optional; --secret-key overrides
    # metrics_port = 9100          # optional Prometheus endpoint on 127.0.0.1

    [[arbiters]]                   # optional: ark arbiter processes (primary first, then standby)
    name = "arb0"
    control = "tcp://10.9.0.100:7200"
    public_key = "<40 z85 characters>"
    secret_key_file = "keys/arb0.key_secret"

Every bad value raises :class:`ClusterError` with a one-line message naming the field.
Programs that write cluster files (``ark cluster``, the testbed) build a
:class:`ClusterFile` and :meth:`~ClusterFile.save` it, so what they write is checked the
same way.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w

from ark.core.fabric_config import FabricConfig
from ark.core.lease import DEFAULT_MAX_LEASE_S, LeasePolicy
from ark.core.pathmap import PathMapCache, PathMapError, parse_port_range
from ark.core.protocol import POLICIES
from ark.core.schema import ConfigError, NonNegative, Port, accepted, convert, one_of
from ark.core.scope import Scope, scope_of
from ark.core.topology import Fabric

_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ENDPOINT = re.compile(r"^(tcp://[^\s]+:\d+|ipc://\S+|inproc://\S+)$")


class ClusterError(ConfigError):
    """An invalid cluster file."""


class ClusterSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[cluster]`` table: timers, leases, limits, probing.

    Keys:
        policy: How an agent places a lease: ``ark`` (lowest free path), ``ark-balance`` (then
            the least reserved backlog), ``ark-split`` (one part per free path).
        dport: The destination port whose path maps agents compute (the ECMP hash includes it).
        port_range: The source ports an agent may hand out, ``LO-HI``.
        lease_min_s: The shortest lease, s.
        lease_slack: A lease lasts its flow's size at the path's rate times this (at least
            ``lease_min_s``).
        max_lease_s: The longest lease, s.
        heartbeat_s: How often an agent tells its peers it is alive, s.
        peer_timeout_s: A peer not heard this long is down and its reservations end, s (at
            least 2 x ``heartbeat_s``).
        sync_timeout_s: How long a restarting agent waits for its peers' snapshots, s.
        retention_s: How long an ended flow's id is remembered (late messages about it are
            dropped), s.
        max_clock_offset_s: The largest clock offset between hosts that race resolution
            tolerates, s (at most ``lease_min_s`` / 4).
        state_dir: Where each agent keeps its incarnation counter.
        max_flows_per_host: Reservations a peer may hold in this agent's table.
        max_local_flows: Leases this host's engines may hold at once.
        max_dports: Destination ports with path maps per peer.
        split_part_bytes: A multi-path lease asked with parts = 0 gets one part per this many
            bytes, at most one per path.
        peer_rate: Messages per second a peer may send before the excess is dropped.
        batch_s: Under load, peer messages are taken in batches at most this often, s.
        max_connections: Inbound connections an agent accepts (0: 4 per host + 64).
        scope: ``full``: every agent hears every reservation; ``declared``: an agent talks only
            to the senders whose flows can share a link with its own (``sends_to``).
        pathmap_dir: Where probed or saved path maps are kept (none: computed from the fabric's hash).
        routers_file: JSON: router (spine) address -> path index, for probing.
        probe_proto: The protocol probes use (the ECMP hash includes it): use your flows'.
        probe_sample: Source ports probed per peer per round (0: all).
        probe_check_s: > 0: re-probe a few ports this often and refresh the maps on a change, s.
        takeover_s: Arbiters: a follower that hears no leader this long leads, s.
        arbiter_rate_per_host: Tokens per second a host gets at an arbiter: an ask takes one
            per part, a renewal or release one per flow, a ping one.
        arbiter_burst_per_host: Tokens a host may spend at an arbiter back to back.
        arbiter_max_epoch_jump: An arbiter epoch more than this above the highest one heard
            is refused (by arbiters and agents) and counted.
        arbiter_clock_drift: Arbiters: the bound on how fast or slow their clocks run
            (0.001: 1,000 ppm); the leader lease is shortened by it.
        control: ``broadcast``: every agent keeps a replica of the table; ``arbiter``: agents
            ask the ``[[arbiters]]`` for every lease.
        arbiter_timeout_s: Arbiter mode: a request unanswered this long goes to the next
            arbiter, s.
    """

    policy: Annotated[str, accepted(POLICIES)] = "ark"
    dport: Port = 4791
    port_range: str = "49152-65535"
    lease_min_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    lease_slack: Annotated[float, msgspec.Meta(ge=1, le=1e6)] = 2.0
    max_lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = DEFAULT_MAX_LEASE_S
    heartbeat_s: Annotated[float, msgspec.Meta(ge=0.01, le=60)] = 0.5
    peer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 2.0
    sync_timeout_s: Annotated[float, msgspec.Meta(ge=0.01, le=60)] = 1.0
    retention_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 5.0
    max_clock_offset_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.1
    state_dir: str = "/var/lib/ark"  # where each agent keeps its incarnation counter
    max_flows_per_host: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)] = 4096
    max_local_flows: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)] = 4096
    max_dports: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    # A multi-path lease asked with parts = 0 gets one part per this many bytes, at most
    # one per path (a part pays a connection and a reservation; 64 MiB take 5 ms at 100 Gbit/s).
    split_part_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 50)] = 64 << 20
    peer_rate: Annotated[float, msgspec.Meta(ge=10, le=1e7)] = 2000.0  # messages/s a peer may send
    # While peer messages arrive faster than one per batch_s, they are taken in batches at
    # most this often: one that arrives soon after a batch waits (at most this long) for
    # those behind it. A wakeup costs an agent several times what handling a message costs,
    # so under load this is what keeps it cheap; a quiet agent handles each message at once.
    batch_s: Annotated[float, msgspec.Meta(ge=0, le=0.05)] = 0.001
    max_connections: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0  # inbound; 0: 4 per host + 64
    # "full": every agent hears every reservation. "declared": each host lists the hosts it
    # sends KV flows to (sends_to); an agent then talks only to the senders whose flows can
    # share a link with its own (ark.core.scope), and reserves nothing outside that scope.
    scope: Literal["full", "declared"] = "full"
    pathmap_dir: str | None = None
    routers_file: str | None = None  # JSON: router address -> path index, for probing
    probe_proto: Literal["udp", "tcp"] = "udp"
    probe_sample: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 128
    probe_check_s: NonNegative = 0.0  # > 0: re-probe a few ports this often; refresh on a change
    # Arbiters ([[arbiters]], ark arbiter): a follower that hears no leader this long leads
    # (arbiters beat every takeover_s / 5).
    takeover_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    arbiter_rate_per_host: Annotated[float, msgspec.Meta(ge=1, le=1e7)] = 2000.0  # tokens/s a host gets (a part, a flow, a ping: one)
    arbiter_burst_per_host: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 256
    arbiter_max_epoch_jump: Annotated[int, msgspec.Meta(ge=1, le=(1 << 30) - 1)] = 1 << 16
    arbiter_clock_drift: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.001  # the leader lease's rate bound
    # "broadcast": every agent keeps a replica of the table (scope above says of which part).
    # "arbiter": agents keep none; they ask the [[arbiters]] (ark arbiter) for every lease.
    control: Literal["broadcast", "arbiter"] = "broadcast"
    # Arbiter mode: a request unanswered this long goes to the next arbiter; none answering,
    # the lease is plain ECMP (and says so) until one leads again.
    arbiter_timeout_s: Annotated[float, msgspec.Meta(ge=0.001, le=10)] = 0.1

    def __post_init__(self) -> None:
        one_of("policy", self.policy, POLICIES)
        try:
            parse_port_range(self.port_range)
        except PathMapError as e:
            raise ValueError(str(e)) from None
        if self.peer_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"peer_timeout_s: must be >= 2 x heartbeat_s ({2 * self.heartbeat_s:g}); "
                             f"got {self.peer_timeout_s}")
        if self.max_lease_s <= self.lease_min_s:
            raise ValueError(f"max_lease_s: must be > lease_min_s ({self.lease_min_s}); got {self.max_lease_s}")
        if self.max_clock_offset_s > self.lease_min_s / 4:
            raise ValueError(f"max_clock_offset_s: must be <= lease_min_s / 4 ({self.lease_min_s / 4:g}), so a "
                             f"lease outlives any tolerated offset; got {self.max_clock_offset_s}")
        if self.routers_file is not None and self.pathmap_dir is None:
            raise ValueError("routers_file: needs pathmap_dir, where probed maps are written")
        if self.probe_check_s > 0 and self.routers_file is None:
            raise ValueError(f"probe_check_s: must be >= 0 and needs routers_file; got {self.probe_check_s}")

    @property
    def source_ports(self) -> tuple[int, int]:
        return parse_port_range(self.port_range)

    def lease(self) -> LeasePolicy:
        return LeasePolicy(self.lease_min_s, self.lease_slack, self.max_lease_s)

    def connections(self, hosts: int) -> int:
        """Inbound connections an agent accepts at once (peers reconnect; strangers wait)."""
        return self.max_connections or 4 * hosts + 64


class HostTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[hosts]]`` table: a host and its agent.

    Keys:
        name: The host's name (``ark agent --host NAME``).
        control: Where its agent listens for peers (management network), tcp://HOST:PORT or ipc://PATH.
        api: Its agent's local API for this host's engines, tcp://HOST:PORT or ipc://PATH.
        public_key: Its CURVE public key (``ark keygen`` prints it).
        sign_key: The Ed25519 key its messages are signed with (``ark keygen`` prints it);
            without it, what this host publishes is never taken from another host's snapshot.
        secret_key_file: Its CURVE secret key file (default: ``--secret-key``).
        metrics_port: A Prometheus port on 127.0.0.1 (none: no metrics server).
        sends_to: Hosts it sends KV flows to (``scope = "declared"``).
    """

    name: str
    control: str  # where this agent listens for its peers (management network)
    api: str  # local API for this host's serving engines
    public_key: str
    # Ed25519 key its messages are signed with (ark keygen prints it); without it, what
    # this host publishes is never taken from another host's snapshot.
    sign_key: str | None = None
    secret_key_file: str | None = None
    metrics_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    sends_to: Annotated[list[str], msgspec.Meta(max_length=1 << 16)] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("control", "api"):
            v = getattr(self, key)
            if not _ENDPOINT.match(v):
                raise ValueError(f"{key}: must be tcp://HOST:PORT or ipc://PATH; got {v!r}")
        if not _Z85.match(self.public_key):
            raise ValueError("public_key: must be a 40-character Z85 CURVE key (ark keygen)")
        if self.sign_key is not None and not _HEX64.match(self.sign_key):
            raise ValueError("sign_key: must be 64 hex digits (ark keygen)")


class ArbiterTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[arbiters]]`` table (``ark arbiter``): the first listed leads at a cold start.

    Keys:
        name: The arbiter's name (``ark arbiter --name NAME``).
        control: Where it listens for hosts and the other arbiters, tcp://HOST:PORT or ipc://PATH.
        public_key: Its CURVE public key (``ark keygen``).
        secret_key_file: Its CURVE secret key file (default: ``--secret-key``).
    """

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    control: str  # where it listens for hosts and the other arbiters
    public_key: str
    secret_key_file: str | None = None

    def __post_init__(self) -> None:
        if not _ENDPOINT.match(self.control):
            raise ValueError(f"control: must be tcp://HOST:PORT or ipc://PATH; got {self.control!r}")
        if not _Z85.match(self.public_key):
            raise ValueError("public_key: must be a 40-character Z85 CURVE key (ark keygen)")


class ClusterFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole cluster file, as written.

    Keys:
        hosts: One table per host.
        arbiters: Arbiters, for ``control = "arbiter"``.
        cluster: Timers, leases, limits, probing.
        fabric: The fabric the hosts sit on.
    """

    hosts: Annotated[list[HostTable], msgspec.Meta(min_length=1)]
    arbiters: Annotated[list[ArbiterTable], msgspec.Meta(max_length=16)] = msgspec.field(default_factory=list)
    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)
    fabric: FabricConfig = msgspec.field(default_factory=FabricConfig)

    def save(self, path: str | Path) -> Path:
        """Write as TOML (tomli-w); what ``load`` reads back is this file."""
        p = Path(path)
        tables = _drop_none(msgspec.to_builtins(self))  # TOML has no null: absent means default
        keys = ("cluster", "fabric", "hosts", *(("arbiters",) if self.arbiters else ()))
        p.write_text(tomli_w.dumps({k: tables[k] for k in keys}))
        return p


def _drop_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


@dataclass(frozen=True)
class HostEntry:
    name: str
    index: int  # the fabric host index, which is the protocol's host id
    control: str
    api: str
    public_key: str
    secret_key_file: str | None
    metrics_port: int | None
    sign_key: str | None = None
    sends_to: tuple[int, ...] = ()  # fabric indices of the hosts it sends KV flows to


@dataclass(frozen=True)
class ArbiterEntry:
    name: str
    rank: int  # its place in [[arbiters]]
    control: str
    public_key: str
    secret_key_file: str | None


class Cluster(ClusterSettings, frozen=True, kw_only=True):
    """A loaded cluster file: the ``[cluster]`` settings, the built fabric, the hosts and
    the arbiters."""

    fabric: Fabric
    hosts: tuple[HostEntry, ...]
    arbiters: tuple[ArbiterEntry, ...] = ()

    def arbiter(self, name: str) -> ArbiterEntry:
        for a in self.arbiters:
            if a.name == name:
                return a
        listed = ", ".join(a.name for a in self.arbiters) or "none"
        raise ClusterError(f"arbiter: {name!r} is not in the cluster file's [[arbiters]]; listed: {listed}")

    def host(self, name: str) -> HostEntry:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ClusterError(f"host: {name!r} is not in the cluster file; hosts: {', '.join(h.name for h in self.hosts)}")

    def by_index(self, index: int) -> HostEntry:
        for h in self.hosts:
            if h.index == index:
                return h
        raise ClusterError(f"host: no cluster host has fabric index {index}")

    def traffic_scope(self) -> Scope | None:
        """The components of the declared traffic (``scope = "declared"``), else None."""
        if self.scope == "full":
            return None
        return scope_of(self.fabric, [(h.index, d) for h in self.hosts for d in h.sends_to])

    def pathmaps(self) -> PathMapCache:
        """Maps from ``pathmap_dir`` files where present, else from the fabric's hash model."""
        return PathMapCache(self.fabric, self.source_ports, self.pathmap_dir)

    def pathmap_file(self, src: str, dst: str) -> Path:
        """Where the map ``src`` -> ``dst`` (host names) lives in ``pathmap_dir``."""
        from ark.core.pathmap import pathmap_filename

        if self.pathmap_dir is None:
            raise ClusterError("cluster.pathmap_dir: required to store probed maps")
        return Path(self.pathmap_dir) / pathmap_filename(src, dst, self.dport)


def _resolve(path: str | None, base: Path | None) -> str | None:
    if path is None or base is None or Path(path).is_absolute():
        return path
    return str(base / path)


def _same_socket(v: str | None) -> str | None:
    """One spelling per ipc socket file (``a//b``, ``./b``, a symlinked directory: the same file)."""
    if v is None or not v.startswith("ipc://"):
        return v
    return "ipc://" + os.path.realpath(v[len("ipc://"):])


def from_dict(d: dict[str, Any], base: Path | None = None) -> Cluster:
    """Decode a parsed cluster file; relative paths resolve against ``base``."""
    f = convert(d, ClusterFile, error=ClusterError)
    fabric = f.fabric.build()
    names = {h.name: h.index for h in fabric.hosts}
    hosts: list[HostEntry] = []
    for i, h in enumerate(f.hosts):
        if h.name not in names:
            raise ClusterError(f"hosts[{i}].name: {h.name!r} is not a fabric host (gpu0..gpu{len(names) - 1})")
        if any(x.name == h.name for x in hosts):
            raise ClusterError(f"hosts[{i}].name: {h.name!r} listed twice")
        bad = [t for t in h.sends_to if t not in names or t == h.name]
        if bad:
            raise ClusterError(f"hosts[{i}].sends_to: {bad[0]!r} is not another fabric host")
        hosts.append(HostEntry(h.name, names[h.name], h.control, h.api, h.public_key,
                               _resolve(h.secret_key_file, base), h.metrics_port, h.sign_key,
                               tuple(names[t] for t in h.sends_to)))
    for what in ("public_key", "control", "api", "sign_key"):
        seen: dict[str, int] = {}
        for i, h in enumerate(f.hosts):
            v = _same_socket(getattr(h, what))
            if v is None:
                continue
            if v in seen:
                raise ClusterError(f"hosts[{i}].{what}: the same as hosts[{seen[v]}]'s; every host needs its own")
            seen[v] = i
    arbiters = _arbiters(f, base)
    if f.cluster.control == "arbiter" and not arbiters:
        raise ClusterError('control: "arbiter" needs the arbiters listed: add [[arbiters]] (name, control, public_key, '
                           'secret_key_file), primary first')
    settings = msgspec.structs.asdict(f.cluster)
    settings.update(pathmap_dir=_resolve(f.cluster.pathmap_dir, base), routers_file=_resolve(f.cluster.routers_file, base),
                    state_dir=_resolve(f.cluster.state_dir, base))
    return Cluster(**settings, fabric=fabric, hosts=tuple(hosts), arbiters=arbiters)


def _arbiters(f: ClusterFile, base: Path | None) -> tuple[ArbiterEntry, ...]:
    """The [[arbiters]]: names, endpoints and keys unique, also against the hosts' keys."""
    out: list[ArbiterEntry] = []
    host_keys = {h.public_key for h in f.hosts}
    for i, a in enumerate(f.arbiters):
        for what in ("name", "control", "public_key"):
            if any(_same_socket(getattr(x, what)) == _same_socket(getattr(a, what)) for x in f.arbiters[:i]):
                raise ClusterError(f"arbiters[{i}].{what}: the same as an earlier arbiter's; every arbiter needs its own")
        if a.public_key in host_keys:
            raise ClusterError(f"arbiters[{i}].public_key: a host's key; an arbiter needs its own (ark keygen)")
        out.append(ArbiterEntry(a.name, i, a.control, a.public_key, _resolve(a.secret_key_file, base)))
    return tuple(out)


def load(path: str | Path) -> Cluster:
    p = Path(path)
    try:
        d = tomllib.loads(p.read_text())
    except OSError as e:
        raise ClusterError(f"cluster: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ClusterError(f"cluster: {path} is not UTF-8 text (byte {e.start}); expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"cluster: {path} is not valid TOML: {e}") from None
    return from_dict(d, p.parent)


def read_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file written by ``ark keygen``."""
    import zmq.auth

    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ClusterError(f"secret_key_file: cannot read {path} ({e}); expected a .key_secret file "
                           f"from ark keygen") from None
    if sec is None:
        raise ClusterError(f"secret_key_file: {path} holds no secret key; expected a .key_secret file from ark keygen")
    return pub, sec
