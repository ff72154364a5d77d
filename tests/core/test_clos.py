"""The 3-tier Clos description, its path maps (the hash inverted at every ECMP decision)
and reservations over it."""

from __future__ import annotations

import numpy as np
import pytest

from ark.core.clos import ClosFabric, clos3
from ark.core.fabric_config import FabricConfig
from ark.core.messages import Reserve
from ark.core.pathmap import PathMapCache, fabric_pathmap, switch_path
from ark.core.protocol import ArkCore
from ark.core.schema import convert
from ark.core.topology import TopologyError, preset


def _walk(fab: ClosFabric, links: tuple[int, ...]) -> list[str]:
    """The nodes a sequence of links visits; fails unless each link starts where the last ended."""
    nodes = [fab.links[links[0]].src]
    for lk in links:
        assert fab.links[lk].src == nodes[-1], (nodes, fab.links[lk])
        nodes.append(fab.links[lk].dst)
    return nodes


@pytest.fixture(scope="module")
def fab() -> ClosFabric:
    # 3 pods x 2 leaves x 3 aggregation switches, 2 cores per plane, 2 hosts per leaf.
    return clos3(pods=3, leaves_per_pod=2, aggs_per_pod=3, cores_per_plane=2, gpus_per_leaf=2)


def test_link_ids_are_dense_and_every_path_is_a_walk_from_source_to_destination(fab: ClosFabric) -> None:
    assert [lk.id for lk in fab.links] == list(range(fab.n_links))
    for src in range(fab.n_hosts):
        for dst in range(fab.n_hosts):
            if src == dst:
                continue
            n = fab.n_paths(src, dst)
            same_leaf = fab.leaf_of(src) == fab.leaf_of(dst)
            same_pod = fab.pod_of(src) == fab.pod_of(dst)
            assert n == (1 if same_leaf else 3 if same_pod else 6)
            stages = fab.stages(src, dst)
            assert len(stages) == (0 if same_leaf else 2 if same_pod else 4)
            assert all(len(st) == n for st in stages)
            for k in range(n):
                nodes = _walk(fab, fab.path_links(src, dst, k))
                assert nodes[0] == f"gpu{src}" and nodes[-1] == f"gpu{dst}"
                top = fab.top_switch(src, dst, k)
                if same_pod:
                    assert top is None and not any(x.startswith("core") for x in nodes)
                else:
                    # path k = j * cores_per_plane + r crosses aggregation j of both pods and core k
                    assert nodes[3] == f"core{k}" == f"core{top}"
                    assert nodes[2] == f"agg{fab.pod_of(src) * 3 + k // 2}"


def test_oversubscription_sets_the_link_rates() -> None:
    f = FabricConfig(pods=2, leaves_per_pod=4, aggs_per_pod=4, cores_per_plane=2, gpus_per_leaf=8,
                     oversubscription=(2.0, 4.0)).build()
    assert isinstance(f, ClosFabric)
    assert f.link_bps == pytest.approx(8 * 100e9 / (4 * 2.0))
    assert f.core_link_bps == pytest.approx(4 * f.link_bps / (2 * 4.0))
    assert f.oversubscription() == pytest.approx((2.0, 4.0))
    scale = preset("scale")
    assert (scale.n_hosts, scale.pods, scale.aggs_per_pod, scale.cores_per_plane) == (1024, 8, 16, 4)
    assert scale.oversubscription() == pytest.approx((2.0, 1.0)) and scale.link_bps == scale.core_link_bps == 100e9
    # prefill and decode pools span every pod
    pods = {(scale.pod_of(h), role) for role in ("prefill", "decode") for h in scale.role_hosts(role)}
    assert len(pods) == 16


def test_config_keys_per_tier() -> None:
    f = convert({"pods": 2, "hash": "crc32", "seed": 7, "agg_hash": "crc16-ccitt", "agg_selection": "threshold"},
                FabricConfig).build()
    assert isinstance(f, ClosFabric)
    assert {(s.hash, s.seed, s.selection) for s in f.leaves} == {("crc32", 7, "modulo")}
    assert {(s.hash, s.seed, s.selection) for s in f.aggs} == {("crc16-ccitt", 7, "threshold")}
    own = FabricConfig(pods=2).build()
    assert len({s.seed for s in (*own.leaves, *own.aggs)}) == len(own.leaves) + len(own.aggs)
    with pytest.raises(TopologyError, match="aggs_per_pod: must be 1..64"):
        clos3(aggs_per_pod=65)


@pytest.mark.parametrize(
    "tiers",
    [
        dict(hash="murmur3-hpcc"),
        dict(hash="crc32", agg_hash="crc16-bisync"),
        dict(hash="crc32-hi", selection="threshold", agg_hash="murmur3-hpcc", agg_selection="modulo"),
        dict(hash="xor16", agg_hash="crc32-lo", agg_seed=99),
    ],
)
def test_path_maps_invert_every_hop_and_agree_with_the_switches(tiers: dict) -> None:
    fab = clos3(pods=2, leaves_per_pod=2, aggs_per_pod=4, cores_per_plane=3, gpus_per_leaf=2, **tiers)
    src, dst = 0, fab.n_hosts - 1
    pm = fabric_pathmap(fab, src, dst, 4791, (0, 0xFFFF))
    pm.validate()  # a partition of the whole port range
    assert pm.paths == 12
    rng = np.random.default_rng(0)
    for port in rng.integers(0, 0x10000, 400).tolist():
        assert pm.path_of(port) == switch_path(fab, src, dst, port, 4791)
    intra = fabric_pathmap(fab, 0, 2)  # other leaf, same pod: the leaf alone decides
    assert intra.paths == 4
    for port in rng.integers(0xC000, 0x10000, 200).tolist():
        assert intra.path_of(port) == switch_path(fab, 0, 2, port, 4791)


def test_one_hash_and_seed_on_every_tier_polarises() -> None:
    """With one hash, seed and selection everywhere, the aggregation switch's choice is a
    function of the leaf's: only aggs_per_pod of aggs x cores paths carry anything."""
    same = clos3(pods=2, aggs_per_pod=4, cores_per_plane=4, hash="murmur3-hpcc", seed=5)
    own = clos3(pods=2, aggs_per_pod=4, cores_per_plane=4, hash="murmur3-hpcc")
    dst = same.n_hosts - 1
    assert sum(c > 0 for c in fabric_pathmap(same, 0, dst).counts()) == 4
    assert sum(c > 0 for c in fabric_pathmap(own, 0, dst).counts()) == 16


def test_reservations_cover_every_link_and_intra_pod_flows_only_theirs(fab: ClosFabric) -> None:
    maps = PathMapCache(fab)
    core = ArkCore(0, fab, maps)
    far = fab.n_hosts - 1  # another pod
    dec = core.request(far, 10**9, 0.0)
    assert dec.reserved and dec.path == 0
    held = set(core.link_holders())
    assert held == set(fab.path_links(0, far, 0)[1:-1]) and len(held) == 4
    # The next flow from the same leaf cannot use the same leaf uplink: paths 0 and 1 share it.
    assert core.request(far - 1, 10**9, 0.0).path == 2
    # An intra-pod flow from the same leaf holds only a leaf uplink and a downlink, and
    # avoids the uplinks held above.
    near = 2  # leaf 1, pod 0
    dec = core.request(near, 10**9, 0.0)
    assert dec.path == 2 and fab.n_paths(0, near) == 3
    links = set(fab.path_links(0, near, 2)[1:-1])
    assert len(links) == 2 and links <= set(core.link_holders())
    # A peer's reservation on another leaf pair shares no link with ours: no conflict.
    core.receive(Reserve((5, 1), 0.0, 5, 7, 4791, 0, 49152, 10**9, 1e11), 0.0)
    assert core.exclusive_conflicts() == []
