from __future__ import annotations

import numpy as np
import pytest

from ark.core.hashing import HASH_MODELS
from ark.core.pathmap import (
    PathMap,
    PathMapError,
    PortBuckets,
    compute_buckets,
    fabric_pathmap,
    parse_port_range,
    switch_path,
)
from ark.core.roce import flow_label_for_sport, udp_sport_from_flow_label
from ark.core.topology import TopologyError, preset, spine_leaf


@pytest.mark.parametrize("name", list(HASH_MODELS))
@pytest.mark.parametrize("selection", ["modulo", "threshold"])
def test_buckets_partition_the_range(name: str, selection: str) -> None:
    pm = compute_buckets(name, 7, "10.0.0.1", "10.0.1.1", 4791, 4, (0, 65535), selection)
    pm.validate()
    allp = np.concatenate(pm.buckets)
    assert len(allp) == 65536 and len(np.unique(allp)) == 65536
    for b in pm.buckets:
        assert np.all(np.diff(b) > 0)  # sorted
    # A decent hash spreads ports roughly evenly.
    assert min(pm.counts()) > 0.2 * 65536 / 4


def test_fabric_map_consistent_with_simulated_switch() -> None:
    for hash_name in HASH_MODELS:
        fab = spine_leaf(hash=hash_name)
        pm = fabric_pathmap(fab, 0, 9)
        rng = np.random.default_rng(0)
        for port in rng.integers(pm.port_range[0], pm.port_range[1] + 1, 300):
            assert pm.path_of(int(port)) == switch_path(fab, 0, 9, int(port), 4791), hash_name


def test_intra_leaf_single_path() -> None:
    fab = preset("paper")
    pm = fabric_pathmap(fab, 0, 1)
    assert pm.paths == 1 and pm.counts() == [16384]
    assert fab.stages(0, 1) == ()


def test_save_load_roundtrip(tmp_path) -> None:
    pm = compute_buckets("crc32", 3, "10.0.0.2", "10.0.1.3", 4791, 4)
    f = tmp_path / "m.json"
    pm.save(f)
    back = PathMap.load(f)
    assert back.counts() == pm.counts()
    assert all(np.array_equal(a, b) for a, b in zip(back.buckets, pm.buckets, strict=True))
    assert back.path_of(50000) == pm.path_of(50000)


def test_load_rejects_bad_files(tmp_path) -> None:
    f = tmp_path / "bad.json"
    f.write_text('{"hash": "crc32"}')
    with pytest.raises(PathMapError, match="malformed"):
        PathMap.load(f)
    d = compute_buckets("crc32", 3, "10.0.0.2", "10.0.1.3", 4791, 2, (0, 9)).to_dict()
    d["ports"]["0"] = d["ports"]["0"][1:]  # type: ignore[index]
    with pytest.raises(PathMapError, match="partition"):
        PathMap.from_dict(d)


def test_port_buckets_never_reuse_a_port_in_use() -> None:
    pm = compute_buckets("crc32", 0, "10.0.0.1", "10.0.1.1", 4791, 4, (60000, 60063))
    b = PortBuckets(pm)
    n0 = pm.counts()[0]
    got = [b.take(0) for _ in range(n0)]
    assert len(set(got)) == n0 and all(pm.path_of(p) == 0 for p in got)
    with pytest.raises(PathMapError, match="in use"):
        b.take(0)
    b.give(got[3])
    assert b.take(0) == got[3]


def test_port_range_parsing() -> None:
    assert parse_port_range("49152-65535") == (49152, 65535)
    for bad in ("1-", "5-2", "0-70000", "x"):
        with pytest.raises(PathMapError, match="port-range"):
            parse_port_range(bad)


def test_roce_flow_label_reaches_every_port_in_range() -> None:
    for port in range(0xC000, 0x10000):
        fl = flow_label_for_sport(port)
        assert fl is not None and fl != 0 and fl < 1 << 20
        assert udp_sport_from_flow_label(fl) == port
    assert flow_label_for_sport(0xC000) == 0x4001
    assert flow_label_for_sport(1234) is None


def test_topology_links_and_paths() -> None:
    fab = preset("paper")
    assert fab.n_hosts == 16 and fab.n_spines == 4 and fab.n_leaves == 2
    assert fab.role_hosts("prefill") == tuple(range(8))
    assert fab.role_hosts("decode") == tuple(range(8, 16))
    links = fab.path_links(0, 8, 2)
    assert [fab.links[lk].kind for lk in links] == ["host-up", "uplink", "downlink", "host-down"]
    assert fab.spine_of_link(links[1]) == 2 and fab.spine_of_link(links[2]) == 2
    assert fab.spine_of_link(links[0]) is None
    assert abs(fab.path_rate_bps(0, 8, 0) - 100e9 * fab.efficiency) < 1
    # Per-link: flows between disjoint leaf pairs use disjoint links.
    f4 = spine_leaf(leaves=4)
    a = set(sum(f4.stages(0, 8), ()))
    b = set(sum(f4.stages(16, 24), ()))
    assert not a & b


def test_topology_errors_name_the_field() -> None:
    with pytest.raises(TopologyError, match="fabric.spines"):
        spine_leaf(spines=0)
    with pytest.raises(TopologyError, match="fabric.hash: must be one of"):
        spine_leaf(hash="sha1")
    with pytest.raises(TopologyError, match="fabric.preset"):
        preset("huge")
