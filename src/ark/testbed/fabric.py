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
import math
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ark.core.topology import Fabric, spine_leaf
from ark.testbed import netns as netns

HASH_POLICIES = {"headers": 3, "l4": 1}
_HASH_FIELDS = 0x0001 | 0x0002 | 0x0004 | 0x0010 | 0x0020  # src ip, dst ip, proto, sport, dport
DEFAULT_STATE_DIR = "/run/ark-testbed"
MGMT_NET = ipaddress.IPv4Network("100.64.0.0/16")
CONTROL_PORT = 7100


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

    def fabric(self) -> Fabric:
        """The nominal fabric (the workload and the paper's units)."""
        return spine_leaf(leaves=self.leaves, spines=self.spines, gpus_per_leaf=self.gpus_per_leaf,
                          link_gbps=self.link_gbps, nic_gbps=self.nic_gbps, transport="tcp-1500")

    def scaled_fabric(self) -> Fabric:
        """The fabric as built: what agents compute leases and backlogs with."""
        return spine_leaf(leaves=self.leaves, spines=self.spines, gpus_per_leaf=self.gpus_per_leaf,
                          link_gbps=self.link_gbps * self.scale, nic_gbps=self.nic_gbps * self.scale,
                          transport="tcp-1500")

    @classmethod
    def from_fabric_config(cls, cfg: Any, **kw: Any) -> TestbedSpec:
        f = cfg.build()
        return cls(leaves=f.n_leaves, spines=f.n_spines, gpus_per_leaf=f.n_hosts // f.n_leaves,
                   link_gbps=f.link_bps / 1e9, nic_gbps=f.hosts[0].nic_bps / 1e9, **kw)


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

    @property
    def mgmt_ns(self) -> str:
        return f"{self.spec.prefix}-mgmt"

    def namespaces(self) -> list[str]:
        s = self.spec
        return ([self.mgmt_ns] + [self.spine_ns(k) for k in range(s.spines)]
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

    def routers(self) -> dict[str, int]:
        """Router address -> spine index: how a probe's offender names a path."""
        return {self.uplink_ips(a, k)[1]: k for a in range(self.spec.leaves) for k in range(self.spec.spines)}

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
    fab = spec.fabric()
    link_bps, nic_bps = spec.link_gbps * 1e9 * spec.scale, spec.nic_gbps * 1e9 * spec.scale
    rnd = random.SystemRandom()
    # management bridge
    mg = h[lay.mgmt_ns]
    mg.link("add", ifname="br0", kind="bridge")
    _up(mg, "br0")
    br = mg.link_lookup(ifname="br0")[0]
    for host in fab.hosts:
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
    for a in range(spec.leaves):
        ln = lay.leaf_ns(a)
        for k in range(spec.spines):
            sn = lay.spine_ns(k)
            _veth(h, ln, f"s{k}", sn, f"l{a}")
            lip, sip = lay.uplink_ips(a, k)
            h[ln].addr("add", index=h[ln].link_lookup(ifname=f"s{k}")[0], address=lip, prefixlen=31)
            h[sn].addr("add", index=h[sn].link_lookup(ifname=f"l{a}")[0], address=sip, prefixlen=31)
            _tbf(h[ln], f"s{k}", link_bps, spec.queue_ms)
            _tbf(h[sn], f"l{a}", link_bps, spec.queue_ms)
            h[sn].route("add", dst=lay.host_subnet(a), gateway=lip)
    for a in range(spec.leaves):
        ln = lay.leaf_ns(a)
        for b in range(spec.leaves):
            if b != a:
                h[ln].route("add", dst=lay.host_subnet(b),
                            multipath=[{"gateway": lay.uplink_ips(a, k)[1]} for k in range(spec.spines)])
        for key, val in (("net.ipv4.ip_forward", 1), ("net.ipv4.conf.all.rp_filter", 0),
                         ("net.ipv4.conf.default.rp_filter", 0),
                         ("net.ipv4.fib_multipath_hash_fields", _HASH_FIELDS),
                         ("net.ipv4.fib_multipath_hash_policy", HASH_POLICIES[spec.hash_policy]),
                         ("net.ipv4.fib_multipath_hash_seed",
                          hash_seed if hash_seed is not None else rnd.randrange(1, 2**32))):
            netns.sysctl(ln, key, val)
    for k in range(spec.spines):
        sn = lay.spine_ns(k)
        # Probes need every time-exceeded answered: lift ICMP rate limits on spines.
        for key, val in (("net.ipv4.ip_forward", 1), ("net.ipv4.conf.all.rp_filter", 0),
                         ("net.ipv4.conf.default.rp_filter", 0), ("net.ipv4.icmp_ratelimit", 0),
                         ("net.ipv4.icmp_msgs_per_sec", 1_000_000), ("net.ipv4.icmp_msgs_burst", 1_000_000)):
            netns.sysctl(sn, key, val)


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
    for kind in ("gpu", "leaf", "spine"):
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


# ---------------------------------------------------------------------------- kernel view
_RTM_GETROUTE, _NLMSG_ERROR = 26, 2
_RTA_DST, _RTA_SRC, _RTA_IIF, _RTA_OIF, _RTA_GATEWAY = 1, 2, 3, 4, 5
_RTA_MULTIPATH, _RTA_IP_PROTO, _RTA_SPORT, _RTA_DPORT = 9, 27, 28, 29


def _rta(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("HH", n, kind) + payload + b"\0" * (-n % 4)


class KernelRoutes:
    """``ip route get ... iif ... ipproto ... sport ... dport ...`` in a leaf, over netlink.

    pyroute2 (0.9) has no RTA_SPORT/RTA_DPORT/RTA_IP_PROTO, so this speaks rtnetlink
    directly: one RTM_GETROUTE per question, answered with the chosen gateway.
    """

    def __init__(self, st: State, leaf: int) -> None:
        self.lay = st.layout
        with netns.inside(self.lay.leaf_ns(leaf)):
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            self.sock.bind((0, 0))
            self._iif = {i: socket.if_nametoindex(f"h{i}") for i in range(st.spec.leaves * st.spec.gpus_per_leaf)
                         if self.lay.leaf_of(i) == leaf}
        self._routers = self.lay.routers()
        self._seq = 0

    def gateway(self, src: int, dst_ip: str, sport: int, dport: int, proto: int = 6) -> str:
        self._seq += 1
        body = struct.pack("BBBBBBBBI", socket.AF_INET, 32, 32, 0, 0, 0, 0, 0, 0)
        body += (_rta(_RTA_DST, socket.inet_aton(dst_ip)) + _rta(_RTA_SRC, socket.inet_aton(self.lay.host_ip(src)))
                 + _rta(_RTA_IIF, struct.pack("I", self._iif[src])) + _rta(_RTA_IP_PROTO, bytes([proto]))
                 + _rta(_RTA_SPORT, struct.pack("!H", sport)) + _rta(_RTA_DPORT, struct.pack("!H", dport)))
        self.sock.send(struct.pack("IHHII", 16 + len(body), _RTM_GETROUTE, 1, self._seq, 0) + body)
        data = self.sock.recv(65536)
        ln, kind = struct.unpack_from("IH", data)
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("i", data, 16)
            raise TestbedError(f"route get {dst_ip} sport {sport}: {os.strerror(-err)}")
        off = 16 + 12
        while off + 4 <= ln:
            n, t = struct.unpack_from("HH", data, off)
            if t == _RTA_GATEWAY:
                return socket.inet_ntoa(data[off + 4 : off + 8])
            off += (n + 3) & ~3
        raise TestbedError(f"route get {dst_ip} sport {sport}: no gateway in the answer")

    def spine(self, src: int, dst_ip: str, sport: int, dport: int, proto: int = 6) -> int:
        return self._routers[self.gateway(src, dst_ip, sport, dport, proto)]

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------- capture
_PACKET_OUTGOING = 4
_ETH_P_ALL = 0x0003  # transmitted packets reach only ETH_P_ALL taps


# TPACKET_V2 receive ring (linux/if_packet.h): the kernel copies each packet's first
# bytes into a shared ring, so a capture that falls behind for a moment loses nothing.
_SOL_PACKET, _PACKET_RX_RING, _PACKET_VERSION, _PACKET_STATISTICS, _TPACKET_V2 = 263, 5, 10, 6, 1
_TP_STATUS_USER = 1
_FRAME = 256  # tpacket2_hdr + sockaddr_ll + the first ~180 bytes of the packet
_BLOCK = 1 << 20
_BLOCKS = 16  # 64 Ki frames per spine: seconds of traffic at the scaled rates
_HDR = struct.Struct("=IIIHHII")  # tp_status, tp_len, tp_snaplen, tp_mac, tp_net, tp_sec, tp_nsec
_PKTTYPE_OFF = 32 + 10  # sockaddr_ll follows the 32-byte aligned header; sll_pkttype at +10
_GAP_S = 0.02  # a pause this long starts a new interval (a later connection may reuse the tuple)

Interval = list[float]  # [first packet time, last packet time, payload bytes]


class SpineCounters:
    """Payload bytes per TCP 4-tuple leaving each spine, from AF_PACKET rings in the spines.

    Counting at the spine's egress sees each packet once; the key is
    (src ip, src port, dst ip, dst port). Only payload is counted, so ACKs (which ECMP
    may send over any spine on the way back) do not blur which spine carried a flow.
    Bytes are kept in time intervals stamped by the kernel, so that a later connection
    reusing a 4-tuple is told apart from an earlier one by when its bytes passed.
    ``drops`` is the kernel's count of packets the rings had no room for.
    """

    def __init__(self, st: State, open_sockets: bool = True) -> None:
        import mmap

        self.st = st
        self.bytes: list[dict[tuple[str, int, str, int], list[Interval]]] = [{} for _ in range(st.spec.spines)]
        self.drops = 0
        self.packets = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._rings: list[mmap.mmap] = []
        for k in range(st.spec.spines if open_sockets else 0):
            with netns.inside(st.layout.spine_ns(k)):
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
            s.setsockopt(_SOL_PACKET, _PACKET_VERSION, _TPACKET_V2)
            frames = _BLOCK // _FRAME * _BLOCKS
            s.setsockopt(_SOL_PACKET, _PACKET_RX_RING, struct.pack("IIII", _BLOCK, _BLOCKS, _FRAME, frames))
            self._rings.append(mmap.mmap(s.fileno(), _BLOCK * _BLOCKS, mmap.MAP_SHARED,
                                         mmap.PROT_READ | mmap.PROT_WRITE))
            self._socks.append(s)

    def start(self) -> None:
        for k, s in enumerate(self._socks):
            t = threading.Thread(target=self._loop, args=(s, self._rings[k], self.bytes[k]), daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, s: socket.socket, ring: Any, counts: dict[tuple[str, int, str, int], list[Interval]]) -> None:
        import select

        nframes = len(ring) // _FRAME
        i = 0
        poller = select.poll()
        poller.register(s.fileno(), select.POLLIN)
        while True:
            off = i * _FRAME
            if not ring[off] & _TP_STATUS_USER:  # tp_status low byte
                if self._stop.is_set():
                    return
                poller.poll(100)
                continue
            _, length, snap, mac, _net, sec, nsec = _HDR.unpack_from(ring, off)
            if ring[off + _PKTTYPE_OFF] == _PACKET_OUTGOING and snap >= 54:
                b = off + mac
                if ring[b + 12:b + 14] == b"\x08\x00" and ring[b + 23] == 6:  # IPv4, TCP
                    t = b + 14 + (ring[b + 14] & 0x0F) * 4
                    # length is the packet's full length, GSO packets included
                    payload = length - (t - b) - (ring[t + 12] >> 4) * 4
                    if payload > 0:
                        self._count(counts, ring, b, t, sec + nsec * 1e-9, payload)
            ring[off:off + 4] = b"\0\0\0\0"  # tp_status = TP_STATUS_KERNEL: the slot is free again
            i = (i + 1) % nframes

    @staticmethod
    def _count(counts: dict[tuple[str, int, str, int], list[Interval]], ring: Any, b: int, t: int, now: float,
               payload: int) -> None:
        key = (socket.inet_ntoa(ring[b + 26:b + 30]), (ring[t] << 8) | ring[t + 1],
               socket.inet_ntoa(ring[b + 30:b + 34]), (ring[t + 2] << 8) | ring[t + 3])
        ivs = counts.get(key)
        if ivs is None:
            counts[key] = [[now, now, payload]]
        elif now - ivs[-1][1] > _GAP_S:
            ivs.append([now, now, payload])
        else:
            last = ivs[-1]
            last[1] = max(last[1], now)
            last[2] += payload

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in self._socks:
            packets, drops = struct.unpack("II", s.getsockopt(_SOL_PACKET, _PACKET_STATISTICS, 8))
            self.packets += packets
            self.drops += drops
        for r in self._rings:
            r.close()
        for s in self._socks:
            s.close()

    def spines_of(self, key: tuple[str, int, str, int], t0: float = -math.inf, t1: float = math.inf,
                  slack_s: float = 0.005) -> dict[int, int]:
        """Spine -> payload bytes of one 4-tuple that passed between wall times ``t0`` and ``t1``."""
        out = {}
        for k, c in enumerate(self.bytes):
            total = sum(int(b) for a, z, b in c.get(key, ()) if z >= t0 - slack_s and a <= t1 + slack_s)
            if total:
                out[k] = total
        return out


@contextlib.contextmanager
def counting(st: State) -> Iterator[SpineCounters]:
    """Spine counters in a separate process (capture threads would starve the caller of the GIL).

    The yielded counters are filled when the block ends.
    """
    import sys

    out = st.dir / "capture.json"
    ready = st.dir / "capture.ready"
    for f in (out, ready):
        f.unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "ark.testbed.fabric", "capture", str(st.dir), str(out), str(ready)],
                         stdin=subprocess.DEVNULL)
    counters = SpineCounters(st, open_sockets=False)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise TestbedError("spine capture did not start")
            time.sleep(0.02)
        yield counters
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if out.exists():
        raw = json.loads(out.read_text())
        counters.bytes = [{tuple(json.loads(k)): v for k, v in c.items()} for c in raw["bytes"]]
        counters.packets, counters.drops = raw["packets"], raw["drops"]


def _capture_main(argv: Sequence[str]) -> int:
    """``python -m ark.testbed.fabric capture STATE_DIR OUT READY``: count until SIGTERM, write OUT."""
    d, out, ready = Path(argv[0]), Path(argv[1]), Path(argv[2])
    st = State.load(d)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    c = SpineCounters(st)
    c.start()
    ready.write_text("ready\n")
    while not stop.wait(0.2):
        pass
    c.stop()
    out.write_text(json.dumps({"packets": c.packets, "drops": c.drops,
                               "bytes": [{json.dumps(list(k)): v for k, v in sp.items()} for sp in c.bytes]}))
    return 0


def spawn_in_host(st: State, i: int, argv: Sequence[str], log: Path) -> Any:
    with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
        return netns.spawn(st.layout.host_ns(i), argv, stdout=fh, stderr=fh, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5 and sys.argv[1] == "capture":
        sys.exit(_capture_main(sys.argv[2:]))
    sys.exit("usage: python -m ark.testbed.fabric capture STATE_DIR OUT READY")
