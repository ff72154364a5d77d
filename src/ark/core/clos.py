"""3-tier Clos fabrics: pods of leaves and aggregation switches under a core layer.

Shape. ``pods`` pods; each holds ``leaves_per_pod`` leaves and ``aggs_per_pod``
aggregation switches, every leaf linked once to every aggregation switch of its pod.
The core layer has one *plane* per aggregation index: plane ``j`` holds
``cores_per_plane`` core switches, and aggregation switch ``j`` of every pod links once to
each of them. So a core reaches each pod through exactly one aggregation switch and every
downward hop is determined; the upward hops choose by ECMP:

* leaf ``a`` picks aggregation switch ``j`` of its pod (``aggs_per_pod`` members);
* aggregation switch ``(p, j)`` picks core ``(j, r)`` (``cores_per_plane`` members).

Paths. Between pods, path ``k = j * cores_per_plane + r``, which is also the index of the
core it crosses; inside a pod (different leaves), path ``k = j``; inside a leaf, one path.

Rates come from the oversubscription of each tier: ``leaf = gpus x NIC rate / (aggs x
leaf-agg rate)``, ``agg = leaves x leaf-agg rate / (cores per plane x agg-core rate)``.

Link ids (``H`` hosts, ``L`` leaves, ``A`` aggregation switches per pod, ``R`` cores per
plane, ``P`` pods):

* ``0 .. H-1`` host -> leaf, ``H .. 2H-1`` leaf -> host (as in the 2-tier fabric);
* ``2H + a*A + j``                 leaf ``a`` -> aggregation switch ``j`` of its pod;
* ``2H + L*A + a*A + j``           that switch -> leaf ``a``;
* ``2H + 2*L*A + (p*A + j)*R + r`` aggregation ``(p, j)`` -> core ``(j, r)``;
* ``2H + 2*L*A + P*A*R + (p*A + j)*R + r`` core ``(j, r)`` -> aggregation ``(p, j)``.

Switch node ids follow hosts, then leaves, then aggregation switches (pod-major), then
cores (plane-major); with ``seed`` unset each switch hashes with its node id as seed, so
every switch has its own seed. One ``seed`` for all of them polarises the hashes when
every tier also shares the hash model and selection (see :mod:`ark.sim.polarisation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ark.core.topology import (
    EcmpHop,
    Fabric,
    Link,
    Switch,
    TopologyError,
    check_hashing,
    place_hosts,
)

CLOS_PRESETS: dict[str, dict[str, object]] = {
    # The fabric of the scale benchmark: 1,024 GPUs, 2:1 at the leaves, 1:1 above, 100 Gbit/s links.
    "scale": dict(pods=8, leaves_per_pod=4, aggs_per_pod=16, cores_per_plane=4, gpus_per_leaf=32,
                  nic_gbps=100.0, oversubscription=(2.0, 1.0)),
    # The same pods, 64 of them: 8,192 GPUs (the large run of the scale benchmark).
    "scale-8k": dict(pods=64, leaves_per_pod=4, aggs_per_pod=16, cores_per_plane=4, gpus_per_leaf=32,
                     nic_gbps=100.0, oversubscription=(2.0, 1.0)),
    # Small enough for network namespaces: 16 hosts, 4 paths between pods.
    "clos3-small": dict(pods=2, leaves_per_pod=2, aggs_per_pod=2, cores_per_plane=2, gpus_per_leaf=4,
                        nic_gbps=100.0, oversubscription=(2.0, 1.0)),
}


@dataclass(frozen=True)
class ClosFabric(Fabric):
    """A 3-tier Clos; ``spines`` holds the core switches (the top tier), ``link_bps`` is
    the leaf-aggregation rate and ``core_link_bps`` the aggregation-core rate."""

    pods: int = 1
    aggs: tuple[Switch, ...] = ()
    core_link_bps: float = 0.0
    # Derived once (the fabric is frozen): its shape, and stages per (source, destination) leaf.
    leaves_per_pod: int = field(init=False, compare=False, repr=False, default=1)
    aggs_per_pod: int = field(init=False, compare=False, repr=False, default=1)
    cores_per_plane: int = field(init=False, compare=False, repr=False, default=1)
    _stage_cache: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = field(
        init=False, compare=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        per_pod = max(1, len(self.aggs) // max(1, self.pods))
        object.__setattr__(self, "leaves_per_pod", max(1, self.n_leaves // max(1, self.pods)))
        object.__setattr__(self, "aggs_per_pod", per_pod)
        object.__setattr__(self, "cores_per_plane", max(1, self.n_spines // per_pod))

    # ---- shape ----------------------------------------------------------------------
    @property
    def tiers(self) -> int:
        return 3

    @property
    def top_kind(self) -> str:
        return "core"

    def pod_of_leaf(self, leaf: int) -> int:
        return leaf // self.leaves_per_pod

    def pod_of(self, host: int) -> int:
        return self.pod_of_leaf(self.hosts[host].leaf)

    @property
    def n_links(self) -> int:
        a, r = self.aggs_per_pod, self.cores_per_plane
        return 2 * self.n_hosts + 2 * self.n_leaves * a + 2 * self.pods * a * r

    # ---- link ids -------------------------------------------------------------------
    def uplink(self, leaf: int, agg: int) -> int:
        """Leaf ``leaf`` -> aggregation switch ``agg`` (index within the leaf's pod)."""
        return 2 * self.n_hosts + leaf * self.aggs_per_pod + agg

    def downlink(self, agg: int, leaf: int) -> int:
        """Aggregation switch ``agg`` (index within the pod) -> leaf ``leaf``."""
        return 2 * self.n_hosts + (self.n_leaves + leaf) * self.aggs_per_pod + agg

    def agg_uplink(self, pod: int, agg: int, core: int) -> int:
        """Aggregation ``(pod, agg)`` -> core ``core`` of plane ``agg`` (0..cores_per_plane-1)."""
        base = 2 * self.n_hosts + 2 * self.n_leaves * self.aggs_per_pod
        return base + (pod * self.aggs_per_pod + agg) * self.cores_per_plane + core

    def core_downlink(self, pod: int, agg: int, core: int) -> int:
        """Core ``core`` of plane ``agg`` -> aggregation ``(pod, agg)``."""
        return self.agg_uplink(pod, agg, core) + self.pods * self.aggs_per_pod * self.cores_per_plane

    def spine_of_link(self, link: int) -> int | None:
        """The core a link touches (agg-core links), or None."""
        base = 2 * self.n_hosts + 2 * self.n_leaves * self.aggs_per_pod
        if link < base:
            return None
        off = (link - base) % (self.pods * self.aggs_per_pod * self.cores_per_plane)
        agg_global, r = divmod(off, self.cores_per_plane)
        return (agg_global % self.aggs_per_pod) * self.cores_per_plane + r

    # ---- paths ----------------------------------------------------------------------
    def n_paths(self, src: int, dst: int) -> int:
        a, b = self.hosts[src].leaf, self.hosts[dst].leaf
        if a == b:
            return 1
        if self.pod_of_leaf(a) == self.pod_of_leaf(b):
            return self.aggs_per_pod
        return self.aggs_per_pod * self.cores_per_plane

    def stages(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
        """Reservable links per hop stage, indexed by path (see the module docstring)."""
        a, b = self.hosts[src].leaf, self.hosts[dst].leaf
        got = self._stage_cache.get((a, b))
        if got is None:
            got = self._stage_cache[(a, b)] = self._leaf_stages(a, b)
        return got

    def _leaf_stages(self, a: int, b: int) -> tuple[tuple[int, ...], ...]:
        if a == b:
            return ()
        p, q = self.pod_of_leaf(a), self.pod_of_leaf(b)
        n_agg = self.aggs_per_pod
        if p == q:
            return (tuple(self.uplink(a, j) for j in range(n_agg)), tuple(self.downlink(j, b) for j in range(n_agg)))
        paths = [divmod(k, self.cores_per_plane) for k in range(n_agg * self.cores_per_plane)]
        return (
            tuple(self.uplink(a, j) for j, _ in paths),
            tuple(self.agg_uplink(p, j, r) for j, r in paths),
            tuple(self.core_downlink(q, j, r) for j, r in paths),
            tuple(self.downlink(j, b) for j, _ in paths),
        )

    def ecmp_hops(self, src: int, dst: int) -> tuple[EcmpHop, ...]:
        a, b = self.hosts[src].leaf, self.hosts[dst].leaf
        if a == b:
            return ()
        first = EcmpHop((self.leaves[a],), self.aggs_per_pod)
        p = self.pod_of_leaf(a)
        if p == self.pod_of_leaf(b):
            return (first,)
        aggs = self.aggs[p * self.aggs_per_pod:(p + 1) * self.aggs_per_pod]
        return (first, EcmpHop(aggs, self.cores_per_plane))

    def top_switch(self, src: int, dst: int, path: int) -> int | None:
        """The core a cross-pod path crosses (its index is the path's); None inside a pod."""
        return path if self.pod_of(src) != self.pod_of(dst) else None

    def uplink_bps(self, leaf: int) -> float:
        return self.link_bps * self.aggs_per_pod

    def oversubscription(self) -> tuple[float, ...]:
        """(leaf tier, aggregation tier): bandwidth from below over bandwidth upward."""
        leaf = sum(h.nic_bps for h in self.hosts if h.leaf == 0) / self.uplink_bps(0)
        agg = self.leaves_per_pod * self.link_bps / (self.cores_per_plane * self.core_link_bps)
        return (leaf, agg)


def clos3(
    *,
    pods: int = 2,
    leaves_per_pod: int = 2,
    aggs_per_pod: int = 2,
    cores_per_plane: int = 2,
    gpus_per_leaf: int = 4,
    nic_gbps: float = 100.0,
    oversubscription: tuple[float, float] = (1.0, 1.0),
    hash: str = "murmur3-hpcc",
    seed: int | None = None,
    selection: str = "modulo",
    agg_hash: str | None = None,
    agg_seed: int | None = None,
    agg_selection: str | None = None,
    transport: str = "rocev2-4096",
    prefill_leaves: tuple[int, ...] | None = None,
    decode_leaves: tuple[int, ...] | None = None,
    subnet: str = "10.0.0.0/8",
) -> ClosFabric:
    """Build a 3-tier Clos (see the module docstring).

    ``hash``/``seed``/``selection`` apply to every switch; ``agg_*`` override them for the
    aggregation tier. ``seed`` None: each switch's node id (a seed per switch). By default
    the first half of every pod's leaves hold prefill GPUs and the rest decode GPUs (a
    one-leaf pod alternates roles on its leaf), so both pools span every pod.
    """
    _check_shape(pods, leaves_per_pod, aggs_per_pod, cores_per_plane, gpus_per_leaf, nic_gbps, oversubscription)
    a_hash, a_sel = agg_hash or hash, agg_selection or selection
    a_seed = seed if agg_seed is None else agg_seed
    check_hashing(hash, seed, selection, transport)
    check_hashing(a_hash, a_seed, a_sel, transport, prefix="fabric.agg_")
    n_leaves = pods * leaves_per_pod
    prefill, decode = _default_roles(pods, leaves_per_pod, prefill_leaves, decode_leaves)
    hosts = place_hosts(subnet, n_leaves, gpus_per_leaf, nic_gbps, prefill, decode)
    leaf_bps = gpus_per_leaf * nic_gbps * 1e9 / (aggs_per_pod * oversubscription[0])
    core_bps = leaves_per_pod * leaf_bps / (cores_per_plane * oversubscription[1])
    nid = len(hosts)

    def sw(kind: str, i: int, h: str, s: int | None, sel: str) -> Switch:
        return Switch(kind, i, f"{kind}{i}", nid + i, h, nid + i if s is None else s, sel)

    leaves = tuple(sw("leaf", i, hash, seed, selection) for i in range(n_leaves))
    nid += n_leaves
    aggs = tuple(sw("agg", i, a_hash, a_seed, a_sel) for i in range(pods * aggs_per_pod))
    nid += len(aggs)
    cores = tuple(sw("core", i, hash, seed, selection) for i in range(aggs_per_pod * cores_per_plane))
    fab = ClosFabric(hosts, leaves, cores, leaf_bps, transport, (), pods, aggs, core_bps)
    return ClosFabric(hosts, leaves, cores, leaf_bps, transport, _links(fab), pods, aggs, core_bps)


def _default_roles(
    pods: int, per_pod: int, prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    first = [p * per_pod + i for p in range(pods) for i in range(max(1, per_pod // 2))]
    rest = [p * per_pod + i for p in range(pods) for i in range(per_pod // 2, per_pod)]
    return (tuple(first) if prefill is None else prefill, tuple(rest) if decode is None else decode)


def _check_shape(
    pods: int, leaves: int, aggs: int, cores: int, gpus: int, nic_gbps: float, over: tuple[float, float],
) -> None:
    for name, v, hi in (("pods", pods, 256), ("leaves_per_pod", leaves, 256), ("aggs_per_pod", aggs, 64),
                        ("cores_per_plane", cores, 64), ("gpus_per_leaf", gpus, 250)):
        if not 1 <= v <= hi:
            raise TopologyError(f"fabric.{name}: must be 1..{hi}, got {v}")
    if aggs * cores > 1024:
        raise TopologyError(f"fabric.cores_per_plane: aggs_per_pod x cores_per_plane must be <= 1024, got {aggs * cores}")
    if not nic_gbps > 0:
        raise TopologyError(f"fabric.nic_gbps: must be > 0, got {nic_gbps}")
    if len(over) != 2 or not all(0 < x <= 64 for x in over):
        raise TopologyError(f"fabric.oversubscription: must be [leaf tier, aggregation tier], each in (0, 64]; got {list(over)}")


def _links(fab: ClosFabric) -> tuple[Link, ...]:
    """Every directed link, numbered as the module docstring says."""
    links: list[Link] = []
    for h in fab.hosts:
        links.append(Link(fab.tx_link(h.index), h.name, f"leaf{h.leaf}", h.nic_bps, "host-up"))
    for h in fab.hosts:
        links.append(Link(fab.rx_link(h.index), f"leaf{h.leaf}", h.name, h.nic_bps, "host-down"))
    n_agg, n_core = fab.aggs_per_pod, fab.cores_per_plane
    for leaf in range(fab.n_leaves):
        for j in range(n_agg):
            agg = fab.aggs[fab.pod_of_leaf(leaf) * n_agg + j].name
            links.append(Link(fab.uplink(leaf, j), f"leaf{leaf}", agg, fab.link_bps, "uplink"))
    for leaf in range(fab.n_leaves):
        for j in range(n_agg):
            agg = fab.aggs[fab.pod_of_leaf(leaf) * n_agg + j].name
            links.append(Link(fab.downlink(j, leaf), agg, f"leaf{leaf}", fab.link_bps, "downlink"))
    for kind in ("agg-uplink", "core-downlink"):
        for p in range(fab.pods):
            for j in range(n_agg):
                for r in range(n_core):
                    agg, core = f"agg{p * n_agg + j}", f"core{j * n_core + r}"
                    lid = fab.agg_uplink(p, j, r) if kind == "agg-uplink" else fab.core_downlink(p, j, r)
                    src, dst = (agg, core) if kind == "agg-uplink" else (core, agg)
                    links.append(Link(lid, src, dst, fab.core_link_bps, kind))
    assert [lk.id for lk in links] == list(range(len(links)))
    return tuple(links)


def clos_preset(name: str) -> ClosFabric:
    if name not in CLOS_PRESETS:
        raise TopologyError(f"fabric.preset: must be one of {', '.join(CLOS_PRESETS)}; got {name!r}")
    return clos3(**CLOS_PRESETS[name])  # type: ignore[arg-type]
