"""A lazy path map answers every question as the full map does, hashing only what it needs."""

from __future__ import annotations

import random

import pytest

from ark.core.clos import clos3
from ark.core.pathmap import ROCE_PORT_RANGE, LazyPathMap, PathMapError, PortBuckets, fabric_pathmap
from ark.core.topology import preset, spine_leaf

FABRICS = {
    "paper": preset("paper"),
    "clos3": clos3(pods=2, leaves_per_pod=2, aggs_per_pod=4, cores_per_plane=2, gpus_per_leaf=2),
    "clos3-crc-one-seed": clos3(pods=3, leaves_per_pod=2, aggs_per_pod=4, cores_per_plane=4, gpus_per_leaf=2,
                                hash="crc32", seed=7),  # polarised: some paths no port reaches
    "leaf-threshold": spine_leaf(leaves=3, spines=5, gpus_per_leaf=2, hash="crc16-ccitt", selection="threshold"),
}


@pytest.mark.parametrize("name", sorted(FABRICS))
def test_lazy_and_full_maps_agree(name: str) -> None:
    fab, rng = FABRICS[name], random.Random(1)
    for _ in range(4):
        src, dst = rng.sample(range(fab.n_hosts), 2)
        full, lazy = fabric_pathmap(fab, src, dst), LazyPathMap(fab, src, dst)
        assert lazy.path_of(ROCE_PORT_RANGE[1]) == full.path_of(ROCE_PORT_RANGE[1])  # before any hashing
        assert lazy.usable_mask == full.usable_mask
        assert lazy.static_ports() == full.static_ports()
        for port in rng.sample(range(*ROCE_PORT_RANGE), 200):
            assert lazy.path_of(port) == full.path_of(port)
        assert [b.tolist() for b in lazy.buckets] == [b.tolist() for b in full.buckets] and lazy.complete


def test_a_lazy_map_hashes_only_what_the_questions_need() -> None:
    fab = FABRICS["clos3"]
    lazy = LazyPathMap(fab, 0, fab.n_hosts - 1)
    assert lazy.usable_mask == (1 << lazy.paths) - 1
    assert not lazy.complete and lazy._next - ROCE_PORT_RANGE[0] <= 4 * LazyPathMap.CHUNK


@pytest.mark.parametrize("name", sorted(FABRICS))
def test_port_buckets_hand_out_the_same_ports_from_either_map(name: str) -> None:
    """Round-robin walks, wrap-arounds and ports in use: the same sequence from both maps."""
    fab, rng = FABRICS[name], random.Random(2)
    src, dst = 0, fab.n_hosts - 1
    narrow = (ROCE_PORT_RANGE[0], ROCE_PORT_RANGE[0] + 40)  # few ports per path: the walks wrap
    for ports in (ROCE_PORT_RANGE, narrow):
        full = PortBuckets(fabric_pathmap(fab, src, dst, port_range=ports))
        lazy = PortBuckets(LazyPathMap(fab, src, dst, port_range=ports))
        assert full.usable_mask == lazy.usable_mask
        usable = [k for k in range(full.map.paths) if full.usable_mask >> k & 1]
        for _ in range(300):
            k = rng.choice(usable)
            if rng.random() < 0.3 and full.in_use:
                p = rng.choice(sorted(full.in_use))
                full.give(p)
                lazy.give(p)
            a, b = full.try_take(k), lazy.try_take(k)
            assert a == b
            if a is not None:
                full.give(a)
                lazy.give(b)  # type: ignore[arg-type]
                assert full.take(k) == lazy.take(k)
            assert full.cursors == lazy.cursors
        full = PortBuckets(fabric_pathmap(fab, src, dst, port_range=ports))
        lazy = PortBuckets(LazyPathMap(fab, src, dst, port_range=ports))
        for _ in range(300):  # takes alone: the lazy walk hashes on only as far as each cursor needs
            k = rng.choice(usable)
            if all(p in full.in_use for p in full.map.ports_of(k)):
                with pytest.raises(PathMapError, match="in use"):
                    lazy.take(k)
                continue
            a, b = full.take(k), lazy.take(k)
            assert a == b and full.cursors == lazy.cursors
            if rng.random() < 0.8:
                full.give(a)
                lazy.give(b)
