"""Fabric descriptions: hosts, switches and directed links of a 2-tier spine-leaf.

A :class:`Fabric` only *describes* a network (like mininet's ``Topo``); the fluid
simulator, the namespace testbed and a real cluster file each realise it. The 3-tier
Clos (pods of leaves and aggregation switches under a core layer) is
:class:`ark.core.clos.ClosFabric`, a subclass with the same interface.

What every consumer uses, whatever the depth:

* :meth:`Fabric.stages`: the reservable links of every equal-cost path, per hop stage;
* :meth:`Fabric.ecmp_hops`: the switches that choose between those paths, hop by hop
  (path maps invert the hash at each of them);
* :meth:`Fabric.top_switch`: the top-tier switch a path crosses (spine, or core).

Link numbering of the 2-tier fabric is fixed so that every realisation agrees on link ids:

* ``0 .. H-1``            host ``h`` -> its leaf (NIC transmit)
* ``H .. 2H-1``           leaf -> host ``h`` (NIC receive)
* ``2H + a*S + k``        leaf ``a`` -> spine ``k`` (uplink)
* ``2H + L*S + k*L + b``  spine ``k`` -> leaf ``b`` (downlink)

Only leaf-spine links are *reservable*: they are the links an ECMP decision chooses
between. Host NIC links are shared by every path of a host, so reserving them would make
a second flow from the same GPU find no free path at all.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from functools import cached_property

HASH_SELECTIONS = ("modulo", "threshold")
ROLES = ("prefill", "decode", "none")

# Goodput / line-rate per transport: payload / (payload + per-packet wire overhead).
# Wire overhead counts preamble+SFD (8), Ethernet header (14), FCS (4), inter-frame gap (12).
# RoCEv2 adds IPv4 (20) + UDP (8) + BTH (12) + ICRC (4); TCP adds IPv4 (20) + TCP with
# timestamps (32) inside a 1500-byte MTU.
# Payload bytes per packet, and wire bytes per packet (0: no overhead).
PACKET_BYTES: dict[str, tuple[int, int]] = {
    "rocev2-4096": (4096, 4096 + 38 + 44),
    "rocev2-1024": (1024, 1024 + 38 + 44),
    "tcp-1500": (1448, 1500 + 38),
    "ideal": (4096, 0),
}
TRANSPORTS: dict[str, float] = {t: payload / wire if wire else 1.0 for t, (payload, wire) in PACKET_BYTES.items()}


class TopologyError(ValueError):
    """A fabric description that cannot be built."""


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    ip: str
    leaf: int
    nic_bps: float
    role: str
    node_id: int

    @cached_property
    def ip_int(self) -> int:  # parsed once: the simulated switches hash it per packet decision
        return int(ipaddress.IPv4Address(self.ip))


@dataclass(frozen=True)
class Switch:
    kind: str  # "leaf", "spine", "agg" or "core"
    index: int
    name: str
    node_id: int
    hash: str
    seed: int
    selection: str


@dataclass(frozen=True)
class EcmpHop:
    """One upward ECMP decision: ``switches[i]`` decides when the previous hops' members
    read ``i`` (mixed radix); each picks one of ``members`` next hops."""

    switches: tuple[Switch, ...]
    members: int


@dataclass(frozen=True)
class Link:
    id: int
    src: str
    dst: str
    capacity_bps: float
    kind: str  # host-up, host-down, uplink, downlink


# Where a flow's two ends sit: under one leaf (no reservable link), under two leaves of one
# pod (leaf -> aggregation/spine -> leaf) or in two pods (3-tier fabrics: through the core).
PATH_KINDS = ("same-leaf", "same-pod", "cross-pod")


@dataclass(frozen=True)
class Fabric:
    """A 2-tier spine-leaf fabric.

    ``efficiency`` is payload goodput over line rate (see :data:`TRANSPORTS`); every link
    carries ``capacity_bps * efficiency`` bits of payload per second.
    """

    hosts: tuple[Host, ...]
    leaves: tuple[Switch, ...]
    spines: tuple[Switch, ...]
    link_bps: float
    transport: str = "rocev2-4096"
    links: tuple[Link, ...] = field(default=(), compare=False)

    @property
    def efficiency(self) -> float:
        return TRANSPORTS[self.transport]

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    @property
    def n_spines(self) -> int:
        return len(self.spines)

    @property
    def n_leaves(self) -> int:
        return len(self.leaves)

    @property
    def n_links(self) -> int:
        return 2 * self.n_hosts + 2 * self.n_leaves * self.n_spines

    # ---- link ids -------------------------------------------------------------------
    def tx_link(self, host: int) -> int:
        return host

    def rx_link(self, host: int) -> int:
        return self.n_hosts + host

    def uplink(self, leaf: int, spine: int) -> int:
        return 2 * self.n_hosts + leaf * self.n_spines + spine

    def downlink(self, spine: int, leaf: int) -> int:
        return 2 * self.n_hosts + self.n_leaves * self.n_spines + spine * self.n_leaves + leaf

    def spine_of_link(self, link: int) -> int | None:
        """The spine a leaf-spine link touches, or None for a host link."""
        base = 2 * self.n_hosts
        if link < base:
            return None
        off = link - base
        per = self.n_leaves * self.n_spines
        if off < per:
            return off % self.n_spines
        return (off - per) // self.n_leaves

    # ---- lookups -------------------------------------------------------------------
    def role_hosts(self, role: str) -> tuple[int, ...]:
        return tuple(h.index for h in self.hosts if h.role == role)

    # ---- paths ---------------------------------------------------------------------
    def stages(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
        """Reservable links of every equal-cost path from host ``src`` to ``dst``.

        Returns one tuple per hop stage, indexed by path: path ``k`` uses
        ``stage[k]`` of every stage. Intra-leaf traffic crosses no reservable link and
        has no stages (one path).
        """
        a, b = self.hosts[src].leaf, self.hosts[dst].leaf
        if a == b:
            return ()
        ups = tuple(self.uplink(a, k) for k in range(self.n_spines))
        downs = tuple(self.downlink(k, b) for k in range(self.n_spines))
        return (ups, downs)

    def n_paths(self, src: int, dst: int) -> int:
        return 1 if self.hosts[src].leaf == self.hosts[dst].leaf else self.n_spines

    def path_links(self, src: int, dst: int, path: int) -> tuple[int, ...]:
        """Every directed link (NICs included) a flow on ``path`` crosses."""
        mid = tuple(stage[path] for stage in self.stages(src, dst))
        return (self.tx_link(src), *mid, self.rx_link(dst))

    def path_rate_bps(self, src: int, dst: int, path: int) -> float:
        """Payload rate of a lone flow on ``path``."""
        caps = [self.links[lk].capacity_bps for lk in self.path_links(src, dst, path)]
        return min(caps) * self.efficiency

    def source_switch(self, src: int) -> Switch:
        """The switch whose ECMP decision picks the path for flows leaving ``src``."""
        return self.leaves[self.hosts[src].leaf]

    def ecmp_hops(self, src: int, dst: int) -> tuple[EcmpHop, ...]:
        """The ECMP decisions a packet from ``src`` to ``dst`` meets, upward hop by hop.

        Path index = the members chosen, read as a mixed-radix number (first hop most
        significant). Here only the source leaf chooses: member ``k`` is spine ``k``.
        """
        if self.n_paths(src, dst) == 1:
            return ()
        return (EcmpHop((self.source_switch(src),), self.n_spines),)

    def top_switch(self, src: int, dst: int, path: int) -> int | None:
        """The top-tier switch (here a spine) that ``path`` crosses; None if it crosses none."""
        return None if self.n_paths(src, dst) == 1 else path

    @property
    def tiers(self) -> int:
        return 2

    @property
    def top_kind(self) -> str:
        """What the top tier's switches are called."""
        return "spine"

    def leaf_of(self, host: int) -> int:
        return self.hosts[host].leaf

    def pod_of(self, host: int) -> int:
        """The pod ``host`` sits in (a 2-tier fabric is one pod)."""
        return 0

    def path_kind(self, src: int, dst: int) -> str:
        """Which tiers a flow from ``src`` to ``dst`` crosses: one of :data:`PATH_KINDS`."""
        if self.hosts[src].leaf == self.hosts[dst].leaf:
            return "same-leaf"
        return "same-pod" if self.pod_of(src) == self.pod_of(dst) else "cross-pod"

    def uplink_bps(self, leaf: int) -> float:
        """Line rate out of ``leaf`` towards the upper tier (all its uplinks)."""
        return self.link_bps * self.n_spines

    def oversubscription(self) -> tuple[float, ...]:
        """Per tier, bandwidth from below over bandwidth upward (leaf tier only here)."""
        per_leaf = [h.nic_bps for h in self.hosts if h.leaf == 0]
        return (sum(per_leaf) / self.uplink_bps(0),)


def spine_leaf(
    *,
    leaves: int = 2,
    spines: int = 4,
    gpus_per_leaf: int = 8,
    link_gbps: float = 100.0,
    nic_gbps: float = 100.0,
    hash: str = "murmur3-hpcc",
    seed: int | None = None,
    selection: str = "modulo",
    transport: str = "rocev2-4096",
    prefill_leaves: tuple[int, ...] | None = None,
    decode_leaves: tuple[int, ...] | None = None,
    subnet: str = "10.0.0.0/8",
) -> Fabric:
    """Build a 2-tier spine-leaf fabric.

    Node ids follow ns-3's convention (hosts first, then leaves, then spines). When
    ``seed`` is None each switch hashes with its node id as seed, as the HPCC/AstraSim
    switch does; otherwise every switch uses ``seed``. Host ``i`` of leaf ``a`` gets the
    address ``<subnet base> + a*256 + i + 1``. By default prefill GPUs sit on the first
    half of the leaves and decode GPUs on the rest (the paper: leaf 0 / leaf 1).
    """
    _check_dimensions(leaves, spines, gpus_per_leaf, link_gbps, nic_gbps)
    check_hashing(hash, seed, selection, transport)
    if prefill_leaves is None:
        prefill_leaves = tuple(range(max(1, leaves // 2)))
    if decode_leaves is None:
        decode_leaves = tuple(range(leaves // 2, leaves)) if leaves > 1 else (0,)
    hosts = place_hosts(subnet, leaves, gpus_per_leaf, nic_gbps, prefill_leaves, decode_leaves)
    nid = len(hosts)
    leaf_sw = tuple(
        Switch("leaf", a, f"leaf{a}", nid + a, hash, nid + a if seed is None else seed, selection)
        for a in range(leaves)
    )
    nid += leaves
    spine_sw = tuple(
        Switch("spine", k, f"spine{k}", nid + k, hash, nid + k if seed is None else seed, selection)
        for k in range(spines)
    )
    fab = Fabric(hosts, leaf_sw, spine_sw, link_gbps * 1e9, transport)
    return Fabric(fab.hosts, fab.leaves, fab.spines, fab.link_bps, transport, _links(fab))


def _check_dimensions(leaves: int, spines: int, gpus_per_leaf: int, link_gbps: float, nic_gbps: float) -> None:
    if leaves < 1:
        raise TopologyError(f"fabric.leaves: must be >= 1, got {leaves}")
    if spines < 1:
        raise TopologyError(f"fabric.spines: must be >= 1, got {spines}")
    if gpus_per_leaf < 1 or gpus_per_leaf > 250:
        raise TopologyError(f"fabric.gpus_per_leaf: must be 1..250, got {gpus_per_leaf}")
    if link_gbps <= 0:
        raise TopologyError(f"fabric.link_gbps: must be > 0, got {link_gbps}")
    if nic_gbps <= 0:
        raise TopologyError(f"fabric.nic_gbps: must be > 0, got {nic_gbps}")


def check_hashing(hash: str, seed: int | None, selection: str, transport: str, prefix: str = "fabric.") -> None:
    """Hash model, seed and selection of a tier (``prefix`` names its config keys)."""
    from ark.core.hashing import HASH_MODELS  # local import: hashing does not need topology

    if hash not in HASH_MODELS:
        raise TopologyError(f"{prefix}hash: must be one of {', '.join(HASH_MODELS)}; got {hash!r}")
    if selection not in HASH_SELECTIONS:
        raise TopologyError(f"{prefix}selection: must be one of {', '.join(HASH_SELECTIONS)}; got {selection!r}")
    if transport not in TRANSPORTS:
        raise TopologyError(f"fabric.transport: must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if seed is not None and not 0 <= seed < 2**32:
        raise TopologyError(f"{prefix}seed: must be 0..4294967295, got {seed}")


def place_hosts(
    subnet: str, leaves: int, per_leaf: int, nic_gbps: float,
    prefill_leaves: tuple[int, ...], decode_leaves: tuple[int, ...],
) -> tuple[Host, ...]:
    """Check the role groups and the subnet, then put ``per_leaf`` hosts on each leaf."""
    for name, group in (("prefill_leaves", prefill_leaves), ("decode_leaves", decode_leaves)):
        for leaf in group:
            if not 0 <= leaf < leaves:
                raise TopologyError(f"fabric.{name}: leaf {leaf} outside 0..{leaves - 1}")
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise TopologyError(f"fabric.subnet: not an IPv4 network: {subnet!r}") from e
    if net.num_addresses < leaves * 256:
        raise TopologyError(f"fabric.subnet: {subnet} too small for {leaves} leaves")
    return hosts_on_leaves(net, leaves, per_leaf, nic_gbps * 1e9, prefill_leaves, decode_leaves)


def hosts_on_leaves(
    net: ipaddress.IPv4Network, leaves: int, per_leaf: int, nic_bps: float,
    prefill_leaves: tuple[int, ...], decode_leaves: tuple[int, ...],
) -> tuple[Host, ...]:
    """``per_leaf`` hosts on each leaf: host ``i`` of leaf ``a`` is ``<net> + a*256 + i + 1``."""
    hosts = []
    for a in range(leaves):
        for i in range(per_leaf):
            idx = a * per_leaf + i
            role = "prefill" if a in prefill_leaves else "decode" if a in decode_leaves else "none"
            if a in prefill_leaves and a in decode_leaves:
                # A leaf in both groups alternates roles so each pool gets GPUs there.
                role = "prefill" if i % 2 == 0 else "decode"
            ip = str(net.network_address + a * 256 + i + 1)
            hosts.append(Host(idx, f"gpu{idx}", ip, a, nic_bps, role, idx))
    return tuple(hosts)


def _links(fab: Fabric) -> tuple[Link, ...]:
    """Every directed link, numbered as the module docstring says."""
    links: list[Link] = []
    for h in fab.hosts:
        links.append(Link(fab.tx_link(h.index), h.name, f"leaf{h.leaf}", h.nic_bps, "host-up"))
    for h in fab.hosts:
        links.append(Link(fab.rx_link(h.index), f"leaf{h.leaf}", h.name, h.nic_bps, "host-down"))
    for a in range(fab.n_leaves):
        for k in range(fab.n_spines):
            links.append(Link(fab.uplink(a, k), f"leaf{a}", f"spine{k}", fab.link_bps, "uplink"))
    for k in range(fab.n_spines):
        for b in range(fab.n_leaves):
            links.append(Link(fab.downlink(k, b), f"spine{k}", f"leaf{b}", fab.link_bps, "downlink"))
    assert [lk.id for lk in links] == list(range(len(links)))
    return tuple(links)


PRESETS = {
    "paper": dict(leaves=2, spines=4, gpus_per_leaf=8, link_gbps=100.0, nic_gbps=100.0),
}


def preset_names() -> tuple[str, ...]:
    """Every named fabric: the 2-tier ones here and the 3-tier ones of :mod:`ark.core.clos`."""
    from ark.core.clos import CLOS_PRESETS

    return (*PRESETS, *CLOS_PRESETS)


def preset(name: str) -> Fabric:
    """A named fabric; ``paper`` is the published 2-leaf, 4-spine, 16-GPU fabric, ``scale``
    the 1,024-GPU 3-tier Clos (see :mod:`ark.core.clos`)."""
    from ark.core.clos import CLOS_PRESETS, clos_preset

    if name in CLOS_PRESETS:
        return clos_preset(name)
    if name not in PRESETS:
        raise TopologyError(f"fabric.preset: must be one of {', '.join(preset_names())}; got {name!r}")
    return spine_leaf(**PRESETS[name])  # type: ignore[arg-type]
