"""A real spine-leaf fabric in Linux network namespaces, with the kernel doing ECMP.

:func:`up` realises a :class:`~ark.core.topology.Fabric` with pyroute2 (netlink): one namespace
per host, leaf and spine, veth links, and on every leaf a multipath route to each remote
leaf over all spines. The leaves hash the L4 5-tuple with SipHash under a random key, so
ARK cannot know the mapping and learns it by probing (:mod:`ark.agent.probe`). Every fabric link
is rate-limited by tc (tbf) at ``scale`` times its nominal rate, so that two CPU cores can
saturate it; flow sizes scale by the same factor and times stay as they are.

Agents talk over a separate management network: a bridge in its own namespace with one
veth per host. Every resource is named after ``prefix``, recorded in a state file before it
is created, and removed by :func:`down`, which also works after a crash and is idempotent.

Hash policy. Linux ``fib_multipath_hash_policy = 1`` reuses a forwarded packet's existing
L4 hash when it has one. Across veth the sender socket's random ``sk_txhash`` survives
into the leaf, so TCP paths would be a random function of the *socket*, changing on every
RTO, not of the 5-tuple (a switch never sees that hash). Policy 3 with hash fields
src/dst IP, protocol and src/dst port hashes the same 5-tuple from the headers, as a
switch does; it is the default (``hash_policy = "headers"``). ``"l4"`` keeps policy 1, to
measure the difference.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ark.core.clos import ClosFabric, clos3
from ark.core.topology import Fabric, spine_leaf
from ark.testbed import netns as netns

HASH_POLICIES = {"headers": 3, "l4": 1}
_HASH_FIELDS = 0x0001 | 0x0002 | 0x0004 | 0x0010 | 0x0020  # src ip, dst ip, proto, sport, dport
DEFAULT_STATE_DIR = "/run/ark-testbed"
MGMT_NET = ipaddress.IPv4Network("100.64.0.0/16")
CONTROL_PORT = 7100
_RANDOM = random.SystemRandom()  # hash keys the experimenter does not know


class TestbedError(RuntimeError):
    """The testbed cannot be built, found or used."""


@dataclass(frozen=True)
class TestbedSpec:
    """What to build: the nominal fabric and how to scale it onto this machine."""

    leaves: int = 2
    spines: int = 4
    gpus_per_leaf: int = 8
    link_gbps: float = 100.0
    nic_gbps: float = 100.0
    scale: float = 1e-3  # 100 Gbit/s -> 100 Mbit/s; flow bytes x scale too
    prefix: str = "ark"
    hash_policy: str = "headers"
    queue_ms: float = 20.0  # tbf queue per link, in time at the scaled rate
    dport: int = 5201
    port_range: tuple[int, int] = (20000, 29999)  # source ports ARK probes and hands out
    # 3-tier Clos (pods > 0): ``leaves`` counts every leaf, ``spines`` the core switches,
    # ``link_gbps`` is the leaf-aggregation rate and ``core_link_gbps`` the aggregation-core rate.
    pods: int = 0
    aggs_per_pod: int = 0
    cores_per_plane: int = 0
    core_link_gbps: float = 0.0

    @property
    def three_tier(self) -> bool:
        return self.pods > 0

    def check(self) -> None:
        if self.hash_policy not in HASH_POLICIES:
            raise TestbedError(f"hash_policy: must be one of {', '.join(HASH_POLICIES)}; got {self.hash_policy!r}")
        if not 0 < self.scale <= 1:
            raise TestbedError(f"scale: must be in (0, 1]; got {self.scale}")
        if self.leaves > 128 or self.spines > 250:
            raise TestbedError("fabric: the testbed addresses at most 128 leaves and 250 spines")
        if self.leaves * self.gpus_per_leaf > 4000:
            raise TestbedError("fabric: at most 4000 hosts on the management network")
        if not (len(self.prefix) <= 6 and self.prefix.isalnum()):
            raise TestbedError(f"prefix: 1-6 letters or digits; got {self.prefix!r}")
        if not 0 < self.queue_ms <= 1000:
            raise TestbedError(f"queue_ms: must be in (0, 1000]; got {self.queue_ms}")
        lo, hi = self.port_range
        if not 1024 <= lo <= hi <= 32767:
            raise TestbedError(f"port_range: must lie in 1024-32767 (below the ephemeral range); got {lo}-{hi}")
        if self.three_tier and (self.pods > 16 or self.aggs_per_pod > 16 or self.cores_per_plane > 16
                                or self.leaves % self.pods or self.aggs_per_pod * self.cores_per_plane != self.spines):
            raise TestbedError("fabric: a 3-tier testbed takes at most 16 pods, 16 aggregation switches per pod "
                               "and 16 cores per plane")

    def _build_fabric(self, rate: float) -> Fabric:
        if not self.three_tier:
            return spine_leaf(leaves=self.leaves, spines=self.spines, gpus_per_leaf=self.gpus_per_leaf,
                              link_gbps=self.link_gbps * rate, nic_gbps=self.nic_gbps * rate, transport="tcp-1500")
        per_pod = self.leaves // self.pods
        over = (self.gpus_per_leaf * self.nic_gbps / (self.aggs_per_pod * self.link_gbps),
                per_pod * self.link_gbps / (self.cores_per_plane * self.core_link_gbps))
        return clos3(pods=self.pods, leaves_per_pod=per_pod, aggs_per_pod=self.aggs_per_pod,
                     cores_per_plane=self.cores_per_plane, gpus_per_leaf=self.gpus_per_leaf,
                     nic_gbps=self.nic_gbps * rate, oversubscription=over, transport="tcp-1500")

    def fabric(self) -> Fabric:
        """The nominal fabric (the workload and the paper's units)."""
        return self._build_fabric(1.0)

    def scaled_fabric(self) -> Fabric:
        """The fabric as built: what agents compute leases and backlogs with."""
        return self._build_fabric(self.scale)

    @classmethod
    def from_fabric_config(cls, cfg: Any, **kw: Any) -> TestbedSpec:
        f = cfg.build()
        extra: dict[str, Any] = {}
        if isinstance(f, ClosFabric):
            extra = dict(pods=f.pods, aggs_per_pod=f.aggs_per_pod, cores_per_plane=f.cores_per_plane,
                         core_link_gbps=f.core_link_bps / 1e9)
        return cls(leaves=f.n_leaves, spines=f.n_spines, gpus_per_leaf=f.n_hosts // f.n_leaves,
                   link_gbps=f.link_bps / 1e9, nic_gbps=f.hosts[0].nic_bps / 1e9, **extra, **kw)


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Names and addresses of every testbed resource (a pure function of the spec)."""

    spec: TestbedSpec

    def host_ns(self, i: int) -> str:
        return f"{self.spec.prefix}-gpu{i}"

    def leaf_ns(self, a: int) -> str:
        return f"{self.spec.prefix}-leaf{a}"

    def spine_ns(self, k: int) -> str:
        return f"{self.spec.prefix}-spine{k}"

    def agg_ns(self, g: int) -> str:
        return f"{self.spec.prefix}-agg{g}"

    def core_ns(self, c: int) -> str:
        return f"{self.spec.prefix}-core{c}"

    def counted(self) -> list[str]:
        """Switches whose egress the counters watch: the spines; 3-tier: aggregation, then cores."""
        s = self.spec
        if not s.three_tier:
            return [self.spine_ns(k) for k in range(s.spines)]
        return [self.agg_ns(g) for g in range(s.pods * s.aggs_per_pod)] + [self.core_ns(c) for c in range(s.spines)]

    @property
    def mgmt_ns(self) -> str:
        return f"{self.spec.prefix}-mgmt"

    def namespaces(self) -> list[str]:
        s = self.spec
        return ([self.mgmt_ns] + (self.counted() if s.three_tier else [self.spine_ns(k) for k in range(s.spines)])
                + [self.leaf_ns(a) for a in range(s.leaves)]
                + [self.host_ns(i) for i in range(s.leaves * s.gpus_per_leaf)])

    @functools.cached_property
    def _host_ips(self) -> tuple[str, ...]:
        # Building the fabric costs ~1 ms; host_ip sits in per-port loops.
        return tuple(h.ip for h in self.spec.fabric().hosts)

    def host_ip(self, i: int) -> str:
        return self._host_ips[i]

    def leaf_of(self, i: int) -> int:
        return i // self.spec.gpus_per_leaf

    def host_subnet(self, a: int) -> str:
        first = ipaddress.IPv4Address(self.host_ip(a * self.spec.gpus_per_leaf))
        return str(ipaddress.IPv4Network(f"{first}/24", strict=False))

    def gateway(self, a: int) -> str:
        return str(ipaddress.IPv4Network(self.host_subnet(a)).network_address + 254)

    def uplink_ips(self, a: int, k: int) -> tuple[str, str]:
        """(leaf side, spine side) of the /31 between leaf ``a`` and spine ``k``."""
        return f"172.16.{k}.{2 * a}", f"172.16.{k}.{2 * a + 1}"

    def core_ips(self, pod: int, c: int) -> tuple[str, str]:
        """(aggregation side, core side) of the /31 between aggregation switch ``c // R`` of
        ``pod`` and core ``c``."""
        return f"172.17.{c}.{2 * pod}", f"172.17.{c}.{2 * pod + 1}"

    def routers(self) -> dict[str, int]:
        """Router address -> spine index: how a probe's offender names a path (2-tier)."""
        return {self.uplink_ips(a, k)[1]: k for a in range(self.spec.leaves) for k in range(self.spec.spines)}

    def hop_routers(self) -> dict[str, Any]:
        """The routers file of a 3-tier testbed: a TTL-2 probe dies at the aggregation switch
        the leaf chose (its address facing the leaf names ``j``), a TTL-3 probe at the core
        the aggregation switch chose (its address facing that switch names the path ``j * R + r``)."""
        s = self.spec
        aggs = {self.uplink_ips(a, j)[1]: j for a in range(s.leaves) for j in range(s.aggs_per_pod)}
        cores = {self.core_ips(p, c)[1]: c for p in range(s.pods) for c in range(s.spines)}
        return {"hops": [{"ttl": 2, "routers": aggs}, {"ttl": 3, "routers": cores}],
                "members": [s.aggs_per_pod, s.cores_per_plane]}

    def routers_file(self) -> dict[str, Any]:
        return self.hop_routers() if self.spec.three_tier else dict(self.routers())

    def mgmt_ip(self, i: int) -> str:
        return str(MGMT_NET.network_address + 1 + i)

    def control(self, i: int) -> str:
        return f"tcp://{self.mgmt_ip(i)}:{CONTROL_PORT}"


# ---------------------------------------------------------------------------- state
def state_dir(prefix: str = "ark", base: str | None = None) -> Path:
    return Path(base or os.environ.get("ARK_TESTBED_DIR", DEFAULT_STATE_DIR)) / prefix


@dataclass
class State:
    """What exists: written before each resource is created, so a crash leaves a full list."""

    spec: TestbedSpec
    dir: Path
    namespaces: list[str] = field(default_factory=list)
    complete: bool = False
    built_s: float = 0.0
    down_links: list[tuple[int, int]] = field(default_factory=list)

    @property
    def file(self) -> Path:
        return self.dir / "state.json"

    @functools.cached_property
    def layout(self) -> Layout:
        return Layout(self.spec)

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        d = {"spec": asdict(self.spec), "namespaces": self.namespaces, "complete": self.complete,
             "built_s": self.built_s, "down_links": self.down_links}
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(self.file)

    @classmethod
    def load(cls, d: Path) -> State:
        try:
            raw = json.loads((d / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TestbedError(f"no testbed at {d} ({e}); run `ark testbed up`") from None
        try:
            spec = raw["spec"]
            spec["port_range"] = tuple(spec["port_range"])
            return cls(TestbedSpec(**spec), d, list(raw["namespaces"]), bool(raw["complete"]),
                       float(raw.get("built_s", 0.0)), [(int(x[0]), int(x[1])) for x in raw.get("down_links", [])])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TestbedError(f"state file {d / 'state.json'} is damaged ({type(e).__name__}: {e}); "
                               f"`ark testbed down` removes the testbed by its names") from None


# ---------------------------------------------------------------------------- build
def rtnl(name: str) -> Any:
    """A pyroute2 IPRoute whose netlink socket lives in namespace ``name``.

    Opened from a thread switched into the namespace: cheaper than pyroute2's NetNS,
    which starts a helper for each handle.
    """
    from pyroute2 import IPRoute

    with netns.inside(name):
        return IPRoute()


def _tbf(ipr: Any, ifname: str, bps: float, queue_ms: float) -> None:
    idx = ipr.link_lookup(ifname=ifname)[0]
    burst = max(6000, int(bps / 8 * 1e-3))  # ~1 ms at line rate, at least 4 MTU-size packets
    limit = int(bps / 8 * queue_ms / 1000) + burst
    ipr.tc("add", "tbf", index=idx, handle="1:", rate=f"{int(bps)}bit", burst=burst, limit=limit)


def _up(ipr: Any, ifname: str) -> int:
    idx: int = ipr.link_lookup(ifname=ifname)[0]
    ipr.link("set", index=idx, state="up")
    return idx


def up(spec: TestbedSpec, base: str | None = None, hash_seed: int | None = None) -> State:
    """Build the fabric. Fails if a testbed with this prefix exists (``down`` it first)."""
    why = netns.available()
    if why:
        raise TestbedError(f"testbed: {why}")
    from pyroute2 import netns as pnetns

    spec.check()
    lay = Layout(spec)
    d = state_dir(spec.prefix, base)
    if (d / "state.json").exists() or any(netns.exists(n) for n in lay.namespaces()):
        raise TestbedError(f"testbed {spec.prefix!r} exists; run `ark testbed down --prefix {spec.prefix}` first")
    t0 = time.perf_counter()
    st = State(spec, d)
    st.save()
    handles: dict[str, Any] = {}
    try:
        for n in lay.namespaces():
            st.namespaces.append(n)
            st.save()
            pnetns.create(n)
            handles[n] = rtnl(n)
            _up(handles[n], "lo")
            with contextlib.suppress(OSError):  # no IPv6: keeps router chatter off the captures
                netns.sysctl(n, "net.ipv6.conf.all.disable_ipv6", 1)
                netns.sysctl(n, "net.ipv6.conf.default.disable_ipv6", 1)
        _build(spec, lay, handles, hash_seed)
        st.complete = True
        st.built_s = round(time.perf_counter() - t0, 3)
        st.save()
    except BaseException:
        for h in handles.values():
            h.close()
        down(spec.prefix, base)
        raise
    for h in handles.values():
        h.close()
    return st


def _veth(handles: dict[str, Any], ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
    handles[ns_a].link("add", ifname=if_a, kind="veth", peer={"ifname": if_b, "net_ns_fd": ns_b})
    _up(handles[ns_a], if_a)
    _up(handles[ns_b], if_b)


def _build(spec: TestbedSpec, lay: Layout, h: dict[str, Any], hash_seed: int | None) -> None:
    _build_hosts(spec, lay, h)
    if spec.three_tier:
        _build_clos(spec, lay, h, hash_seed)
    else:
        _build_spine_leaf(spec, lay, h, hash_seed)


def _build_hosts(spec: TestbedSpec, lay: Layout, h: dict[str, Any]) -> None:
    """Host <-> leaf links (rate-limited), host routes, and the management bridge."""
    nic_bps = spec.nic_gbps * 1e9 * spec.scale
    mg = h[lay.mgmt_ns]
    mg.link("add", ifname="br0", kind="bridge")
    _up(mg, "br0")
    br = mg.link_lookup(ifname="br0")[0]
    for host in spec.fabric().hosts:
        i, a = host.index, host.leaf
        hn, ln = lay.host_ns(i), lay.leaf_ns(a)
        # data: host eth0 <-> leaf h<i>
        _veth(h, hn, "eth0", ln, f"h{i}")
        hip, gw = host.ip, lay.gateway(a)
        hx, lx = h[hn], h[ln]
        e0 = hx.link_lookup(ifname="eth0")[0]
        hx.addr("add", index=e0, address=hip, prefixlen=32)
        hx.route("add", dst=f"{gw}/32", oif=e0, scope=253)  # scope link
        hx.route("add", dst="0.0.0.0/0", gateway=gw, oif=e0)
        li = lx.link_lookup(ifname=f"h{i}")[0]
        lx.addr("add", index=li, address=gw, prefixlen=32)
        lx.route("add", dst=f"{hip}/32", oif=li, scope=253)
        _tbf(hx, "eth0", nic_bps, spec.queue_ms)
        _tbf(lx, f"h{i}", nic_bps, spec.queue_ms)
        # management: host mgmt0 <-> bridge port m<i>
        _veth(h, hn, "mgmt0", lay.mgmt_ns, f"m{i}")
        mgi = mg.link_lookup(ifname=f"m{i}")[0]
        mg.link("set", index=mgi, master=br)
        hx.addr("add", index=hx.link_lookup(ifname="mgmt0")[0], address=lay.mgmt_ip(i),
                prefixlen=MGMT_NET.prefixlen)
        netns.sysctl(hn, "net.ipv4.tcp_tw_reuse", 1)


def _p2p(h: dict[str, Any], spec: TestbedSpec, lower: tuple[str, str, str], upper: tuple[str, str, str],
         bps: float) -> None:
    """A rate-limited /31 between two switches: (namespace, interface, address) of each end."""
    _veth(h, lower[0], lower[1], upper[0], upper[1])
    for ns, ifname, ip in (lower, upper):
        h[ns].addr("add", index=h[ns].link_lookup(ifname=ifname)[0], address=ip, prefixlen=31)
        _tbf(h[ns], ifname, bps, spec.queue_ms)


def _build_spine_leaf(spec: TestbedSpec, lay: Layout, h: dict[str, Any], hash_seed: int | None) -> None:
    link_bps = spec.link_gbps * 1e9 * spec.scale
    for a in range(spec.leaves):
        ln = lay.leaf_ns(a)
        for k in range(spec.spines):
            lip, sip = lay.uplink_ips(a, k)
            _p2p(h, spec, (ln, f"s{k}", lip), (lay.spine_ns(k), f"l{a}", sip), link_bps)
            h[lay.spine_ns(k)].route("add", dst=lay.host_subnet(a), gateway=lip)
    for a in range(spec.leaves):
        ln = lay.leaf_ns(a)
        for b in range(spec.leaves):
            if b != a:
                h[ln].route("add", dst=lay.host_subnet(b),
                            multipath=[{"gateway": lay.uplink_ips(a, k)[1]} for k in range(spec.spines)])
        _ecmp_sysctls(spec, ln, hash_seed)
    for k in range(spec.spines):
        _answering_sysctls(lay.spine_ns(k))


def _build_clos(spec: TestbedSpec, lay: Layout, h: dict[str, Any], hash_seed: int | None) -> None:
    """Leaves pick an aggregation switch of their pod, aggregation switches a core of their
    plane (both kernel multipath, each with its own hash seed); downward routes are single."""
    n_agg, n_core, per_pod = spec.aggs_per_pod, spec.cores_per_plane, spec.leaves // spec.pods
    link_bps, core_bps = spec.link_gbps * 1e9 * spec.scale, spec.core_link_gbps * 1e9 * spec.scale
    for a in range(spec.leaves):
        p = a // per_pod
        for j in range(n_agg):
            lip, aip = lay.uplink_ips(a, j)
            agg = lay.agg_ns(p * n_agg + j)
            _p2p(h, spec, (lay.leaf_ns(a), f"a{j}", lip), (agg, f"l{a}", aip), link_bps)
            h[agg].route("add", dst=lay.host_subnet(a), gateway=lip)
    for p in range(spec.pods):
        for c in range(spec.spines):
            j = c // n_core
            gip, cip = lay.core_ips(p, c)
            _p2p(h, spec, (lay.agg_ns(p * n_agg + j), f"c{c}", gip), (lay.core_ns(c), f"p{p}", cip), core_bps)
            for b in range(p * per_pod, (p + 1) * per_pod):
                h[lay.core_ns(c)].route("add", dst=lay.host_subnet(b), gateway=gip)
    for a in range(spec.leaves):
        for b in range(spec.leaves):
            if b != a:
                h[lay.leaf_ns(a)].route("add", dst=lay.host_subnet(b),
                                        multipath=[{"gateway": lay.uplink_ips(a, j)[1]} for j in range(n_agg)])
        _ecmp_sysctls(spec, lay.leaf_ns(a), hash_seed)
    for g in range(spec.pods * n_agg):
        p, j = divmod(g, n_agg)
        for b in range(spec.leaves):
            if b // per_pod != p:
                h[lay.agg_ns(g)].route("add", dst=lay.host_subnet(b), multipath=[
                    {"gateway": lay.core_ips(p, j * n_core + r)[1]} for r in range(n_core)])
        _ecmp_sysctls(spec, lay.agg_ns(g), None if hash_seed is None else hash_seed + 1 + g)
        _answering_sysctls(lay.agg_ns(g))
    for c in range(spec.spines):
        _answering_sysctls(lay.core_ns(c))


def _ecmp_sysctls(spec: TestbedSpec, ns: str, seed: int | None) -> None:
    """Forwarding and multipath hashing: ``seed`` None draws a random key for this switch."""
    for key, val in (("net.ipv4.ip_forward", 1), ("net.ipv4.conf.all.rp_filter", 0),
                     ("net.ipv4.conf.default.rp_filter", 0),
                     ("net.ipv4.fib_multipath_hash_fields", _HASH_FIELDS),
                     ("net.ipv4.fib_multipath_hash_policy", HASH_POLICIES[spec.hash_policy]),
                     ("net.ipv4.fib_multipath_hash_seed", seed if seed is not None else _RANDOM.randrange(1, 2**32))):
        netns.sysctl(ns, key, val)


def ecmp_switches(st: State) -> list[str]:
    """The namespaces that hash flows over several next hops: leaves, and on 3 tiers the
    aggregation switches too."""
    spec, lay = st.spec, st.layout
    out = [lay.leaf_ns(a) for a in range(spec.leaves)]
    if spec.three_tier:
        out += [lay.agg_ns(g) for g in range(spec.pods * spec.aggs_per_pod)]
    return out


def hash_keys(seed: int, n: int) -> list[int]:
    """``n`` multipath hash keys that ``seed`` fixes (never 0: the kernel's "random" key)."""
    rng = random.Random(f"ark-testbed-hash-{seed}")
    return [rng.randrange(1, 2**32) for _ in range(n)]


def rekey(st: State, seed: int) -> tuple[list[int], bool]:
    """Give every ECMP switch the hash key ``seed`` fixes; returns the keys, switch by
    switch, and whether any changed (then paths changed: probe again)."""
    keys = hash_keys(seed, len(ecmp_switches(st)))
    changed = False
    for ns, key in zip(ecmp_switches(st), keys, strict=True):
        if netns.read_sysctl(ns, "net.ipv4.fib_multipath_hash_seed") != str(key):
            netns.sysctl(ns, "net.ipv4.fib_multipath_hash_seed", key)
            changed = True
    return keys, changed


def _answering_sysctls(ns: str) -> None:
    """Probes need every time-exceeded answered, from the address the probe came in on."""
    for key, val in (("net.ipv4.ip_forward", 1), ("net.ipv4.conf.all.rp_filter", 0),
                     ("net.ipv4.conf.default.rp_filter", 0), ("net.ipv4.icmp_ratelimit", 0),
                     ("net.ipv4.icmp_msgs_per_sec", 1_000_000), ("net.ipv4.icmp_msgs_burst", 1_000_000),
                     ("net.ipv4.icmp_errors_use_inbound_ifaddr", 1)):
        netns.sysctl(ns, key, val)


def down(prefix: str = "ark", base: str | None = None) -> list[str]:
    """Remove everything ``up`` created for ``prefix`` (idempotent). Returns what was removed."""
    d = state_dir(prefix, base)
    names: set[str] = set()
    with contextlib.suppress(TestbedError):
        names.update(State.load(d).namespaces)
    # After a crash before the state file was written, the names still carry the prefix.
    names.update(n for n in netns.listed(f"{prefix}-") if _ours(prefix, n))
    present = [n for n in sorted(names) if netns.exists(n)]
    for pid in netns.pids_in(present):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    removed = []
    if present:
        from pyroute2 import netns as pnetns

        for n in present:
            with contextlib.suppress(OSError):
                pnetns.remove(n)
                removed.append(n)
    if d.exists():
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return removed


def _ours(prefix: str, name: str) -> bool:
    rest = name[len(prefix) + 1:]
    for kind in ("gpu", "leaf", "spine", "agg", "core"):
        if rest.startswith(kind) and rest[len(kind):].isdigit():
            return True
    return rest == "mgmt"


def status(prefix: str = "ark", base: str | None = None) -> dict[str, Any]:
    st = State.load(state_dir(prefix, base))
    missing = [n for n in st.namespaces if not netns.exists(n)]
    return {"prefix": prefix, "complete": st.complete, "namespaces": len(st.namespaces),
            "missing": missing, "built_s": st.built_s, "down_links": st.down_links,
            "spec": asdict(st.spec)}


def set_link(st: State, leaf: int, spine: int, is_up: bool) -> None:
    """Take the leaf-spine link down or back up (both ends), as a failure would."""
    if st.spec.three_tier:
        raise TestbedError("link: failing links is supported on a 2-tier testbed only")
    if not (0 <= leaf < st.spec.leaves and 0 <= spine < st.spec.spines):
        raise TestbedError(f"link: leaf must be 0..{st.spec.leaves - 1}, spine 0..{st.spec.spines - 1}")
    lay = st.layout
    for ns, ifname in ((lay.leaf_ns(leaf), f"s{spine}"), (lay.spine_ns(spine), f"l{leaf}")):
        with rtnl(ns) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state="up" if is_up else "down")
    key = (leaf, spine)
    if is_up and key in st.down_links:
        st.down_links.remove(key)
    elif not is_up and key not in st.down_links:
        st.down_links.append(key)
    st.save()
    converge(st)


def converge(st: State) -> None:
    """Install the routes a routing protocol would converge to with ``st.down_links`` down.

    Leaf ``b`` reaches leaf ``a`` over every spine both still connect to; a spine reaches
    a leaf over its link when it is up. The kernel would only skip a dead next hop on the
    leaf that lost the link, and it deletes (does not restore) the spine's route.
    """
    lay, spec = st.layout, st.spec
    down = set(st.down_links)
    for b in range(spec.leaves):
        with rtnl(lay.leaf_ns(b)) as ipr:
            for a in range(spec.leaves):
                if a == b:
                    continue
                hops = [{"gateway": lay.uplink_ips(b, k)[1]} for k in range(spec.spines)
                        if (b, k) not in down and (a, k) not in down]
                if hops:
                    ipr.route("replace", dst=lay.host_subnet(a), multipath=hops)
                else:
                    with contextlib.suppress(Exception):
                        ipr.route("del", dst=lay.host_subnet(a))
    for k in range(spec.spines):
        with rtnl(lay.spine_ns(k)) as ipr:
            for a in range(spec.leaves):
                if (a, k) not in down:
                    ipr.route("replace", dst=lay.host_subnet(a), gateway=lay.uplink_ips(a, k)[0])


def spawn_in_host(st: State, i: int, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Any:
    with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
        return netns.spawn(st.layout.host_ns(i), argv, stdout=fh, stderr=fh, stdin=subprocess.DEVNULL, env=env)
