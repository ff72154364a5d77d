"""Cluster files: which hosts run agents, where they listen, their keys and settings.

Example::

    [cluster]
    policy = "ark"                 # or "ark-balance"
    dport = 4791
    port_range = "49152-65535"     # source ports handed out (RoCEv2: 49152-65535)
    lease_min_s = 1.0              # lease = lease_min_s + lease_slack x bytes x 8 / rate
    lease_slack = 2.0
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

Every bad value raises :class:`ClusterError` with a one-line message naming the field.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ark.core.pathmap import PathMap, PathMapError, fabric_pathmap, parse_port_range
from ark.core.protocol import POLICIES
from ark.core.topology import Fabric
from ark.sim.config import ConfigError
from ark.sim.config import from_dict as experiment_from_dict

_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_ENDPOINT = re.compile(r"^(tcp://[^\s]+:\d+|ipc://\S+|inproc://\S+)$")


class ClusterError(ValueError):
    """An invalid cluster file."""


@dataclass(frozen=True)
class HostEntry:
    name: str
    index: int  # the fabric host index, which is the protocol's host id
    control: str
    api: str
    public_key: str
    secret_key_file: str | None
    metrics_port: int | None


@dataclass(frozen=True)
class Cluster:
    fabric: Fabric
    hosts: tuple[HostEntry, ...]
    policy: str = "ark"
    dport: int = 4791
    port_range: tuple[int, int] = (49152, 65535)
    lease_min_s: float = 1.0
    lease_slack: float = 2.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 2.0
    sync_timeout_s: float = 1.0
    retention_s: float = 5.0
    pathmap_dir: str | None = None
    routers_file: str | None = None  # JSON: router address -> path index, for probing
    probe_proto: str = "udp"
    probe_sample: int = 128
    probe_check_s: float = 0.0  # > 0: re-probe a few ports this often; refresh on a change

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

    def pathmaps(self) -> PathMapLoader:
        return PathMapLoader(self)


class PathMapLoader:
    """Path maps from ``pathmap_dir`` files when present, else from the fabric's hashes."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._maps: dict[tuple[int, int, int], PathMap] = {}

    def file_for(self, src: int, dst: int, dport: int) -> Path | None:
        d = self.cluster.pathmap_dir
        if d is None:
            return None
        f = self.cluster.fabric
        return Path(d) / f"{f.hosts[src].name}__{f.hosts[dst].name}__{dport}.json"

    def clear(self) -> None:
        """Forget loaded maps: the next lookup reads the files again."""
        self._maps.clear()

    def __call__(self, src: int, dst: int, dport: int) -> PathMap:
        key = (src, dst, dport)
        m = self._maps.get(key)
        if m is None:
            path = self.file_for(src, dst, dport)
            if path is not None and path.is_file():
                m = PathMap.load(path)
                if m.paths != self.cluster.fabric.n_paths(src, dst):
                    raise PathMapError(f"path map {path}: {m.paths} paths, the fabric has {self.cluster.fabric.n_paths(src, dst)}")
            else:
                m = fabric_pathmap(self.cluster.fabric, src, dst, dport, self.cluster.port_range)
            self._maps[key] = m
        return m


def _get(d: dict[str, Any], key: str, kind: type, where: str, default: Any = None, required: bool = False) -> Any:
    if key not in d:
        if required:
            raise ClusterError(f"{where}.{key}: required")
        return default
    v = d[key]
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise ClusterError(f"{where}.{key}: must be {kind.__name__}; got {v!r}")
    return v


_CLUSTER_KEYS = (
    "policy", "dport", "port_range", "lease_min_s", "lease_slack", "heartbeat_s", "peer_timeout_s",
    "sync_timeout_s", "retention_s", "pathmap_dir", "routers_file", "probe_proto", "probe_sample",
    "probe_check_s",
)
_HOST_KEYS = ("name", "control", "api", "public_key", "secret_key_file", "metrics_port")


def from_dict(d: dict[str, Any], base: Path | None = None) -> Cluster:
    for k in d:
        if k not in ("cluster", "fabric", "hosts"):
            raise ClusterError(f"{k}: unknown section; accepted: cluster, fabric, hosts")
    try:
        fabric = experiment_from_dict({"fabric": d.get("fabric", {})}).fabric.build()
    except ConfigError as e:
        raise ClusterError(str(e)) from None
    c = d.get("cluster", {})
    if not isinstance(c, dict):
        raise ClusterError("cluster: must be a table")
    for k in c:
        if k not in _CLUSTER_KEYS:
            raise ClusterError(f"cluster.{k}: unknown key; accepted: {', '.join(_CLUSTER_KEYS)}")
    policy = _get(c, "policy", str, "cluster", "ark")
    if policy not in POLICIES:
        raise ClusterError(f"cluster.policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
    dport = _get(c, "dport", int, "cluster", 4791)
    if not 0 <= dport <= 0xFFFF:
        raise ClusterError(f"cluster.dport: must be 0..65535; got {dport}")
    try:
        port_range = parse_port_range(_get(c, "port_range", str, "cluster", "49152-65535"))
    except PathMapError as e:
        raise ClusterError(f"cluster.{e}") from None
    nums = {}
    for k, default in (("lease_min_s", 1.0), ("lease_slack", 2.0), ("heartbeat_s", 0.5),
                       ("peer_timeout_s", 2.0), ("sync_timeout_s", 1.0), ("retention_s", 5.0)):
        v = _get(c, k, float, "cluster", default)
        if not v > 0 or (k == "lease_slack" and v < 1):
            raise ClusterError(f"cluster.{k}: must be > 0{' and >= 1' if k == 'lease_slack' else ''}; got {v}")
        nums[k] = v
    pdir = _get(c, "pathmap_dir", str, "cluster")
    if pdir is not None and base is not None and not Path(pdir).is_absolute():
        pdir = str(base / pdir)
    routers = _get(c, "routers_file", str, "cluster")
    if routers is not None and base is not None and not Path(routers).is_absolute():
        routers = str(base / routers)
    if routers is not None and pdir is None:
        raise ClusterError("cluster.routers_file: needs pathmap_dir, where probed maps are written")
    proto = _get(c, "probe_proto", str, "cluster", "udp")
    if proto not in ("udp", "tcp"):
        raise ClusterError(f"cluster.probe_proto: must be one of udp, tcp; got {proto!r}")
    sample = _get(c, "probe_sample", int, "cluster", 128)
    if sample < 0:
        raise ClusterError(f"cluster.probe_sample: must be >= 0 (0: the whole port range); got {sample}")
    check_s = _get(c, "probe_check_s", float, "cluster", 0.0)
    if check_s < 0 or (check_s > 0 and routers is None):
        raise ClusterError(f"cluster.probe_check_s: must be >= 0 and needs routers_file; got {check_s}")
    hosts_raw = d.get("hosts")
    if not isinstance(hosts_raw, list) or not hosts_raw:
        raise ClusterError("hosts: needs one or more [[hosts]] tables")
    names = {h.name: h.index for h in fabric.hosts}
    hosts: list[HostEntry] = []
    seen: set[str] = set()
    for i, h in enumerate(hosts_raw):
        where = f"hosts[{i}]"
        if not isinstance(h, dict):
            raise ClusterError(f"{where}: must be a table")
        for k in h:
            if k not in _HOST_KEYS:
                raise ClusterError(f"{where}.{k}: unknown key; accepted: {', '.join(_HOST_KEYS)}")
        name = _get(h, "name", str, where, required=True)
        if name not in names:
            raise ClusterError(f"{where}.name: {name!r} is not a fabric host (gpu0..gpu{len(names) - 1})")
        if name in seen:
            raise ClusterError(f"{where}.name: {name!r} listed twice")
        seen.add(name)
        eps = {}
        for k in ("control", "api"):
            v = _get(h, k, str, where, required=True)
            if not _ENDPOINT.match(v):
                raise ClusterError(f"{where}.{k}: must be tcp://HOST:PORT or ipc://PATH; got {v!r}")
            eps[k] = v
        key = _get(h, "public_key", str, where, required=True)
        if not _Z85.match(key):
            raise ClusterError(f"{where}.public_key: must be a 40-character Z85 CURVE key (ark keygen)")
        secret = _get(h, "secret_key_file", str, where)
        if secret is not None and base is not None and not Path(secret).is_absolute():
            secret = str(base / secret)
        mport = _get(h, "metrics_port", int, where)
        if mport is not None and not 1 <= mport <= 65535:
            raise ClusterError(f"{where}.metrics_port: must be 1..65535; got {mport}")
        hosts.append(HostEntry(name, names[name], eps["control"], eps["api"], key, secret, mport))
    keys = [h.public_key for h in hosts]
    if len(set(keys)) != len(keys):
        raise ClusterError("hosts.public_key: every host needs its own key")
    return Cluster(
        fabric, tuple(hosts), policy, dport, port_range, nums["lease_min_s"], nums["lease_slack"],
        nums["heartbeat_s"], nums["peer_timeout_s"], nums["sync_timeout_s"], nums["retention_s"], pdir,
        routers, proto, sample, check_s,
    )


def load(path: str | Path) -> Cluster:
    p = Path(path)
    try:
        d = tomllib.loads(p.read_text())
    except OSError as e:
        raise ClusterError(f"cluster: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"cluster: {path} is not valid TOML: {e}") from None
    return from_dict(d, p.parent)


def read_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file written by ``ark keygen``."""
    import zmq.auth

    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ClusterError(f"secret_key_file: cannot read {path}: {e}") from None
    if sec is None:
        raise ClusterError(f"secret_key_file: {path} holds no secret key")
    return pub, sec
