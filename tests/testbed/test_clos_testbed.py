"""The 3-tier namespace testbed: layout everywhere; build, two-hop probing and a run as root."""

from __future__ import annotations

import json

import pytest

from ark.agent.probe import HopRouters, ProbeResult, load_routers, pathmap_from_probes
from ark.core.fabric_config import FabricConfig
from ark.testbed import fabric as tbm
from ark.testbed import netns
from ark.testbed.fabric import Layout

SPEC = tbm.TestbedSpec.from_fabric_config(FabricConfig(preset="clos3-small"), prefix="arkc")


# --------------------------------------------------------------------------- no root
def test_layout_of_a_three_tier_testbed():
    assert SPEC.three_tier and (SPEC.pods, SPEC.aggs_per_pod, SPEC.cores_per_plane, SPEC.spines) == (2, 2, 2, 4)
    lay = Layout(SPEC)
    ns = lay.namespaces()
    assert len(ns) == len(set(ns)) == 1 + 4 + 4 + 4 + 16
    assert lay.counted() == [f"arkc-agg{g}" for g in range(4)] + [f"arkc-core{c}" for c in range(4)]
    hops = lay.hop_routers()
    assert [h["ttl"] for h in hops["hops"]] == [2, 3] and hops["members"] == [2, 2]
    assert sorted(set(hops["hops"][0]["routers"].values())) == [0, 1]
    assert sorted(set(hops["hops"][1]["routers"].values())) == [0, 1, 2, 3]
    assert SPEC.fabric().n_paths(0, 15) == 4 and SPEC.scaled_fabric().link_bps == pytest.approx(1e8)


def test_two_hop_answers_make_a_path_only_when_they_agree(tmp_path):
    lay = Layout(SPEC)
    f = tmp_path / "routers.json"
    f.write_text(json.dumps(lay.hop_routers()))
    routers = load_routers(str(f))
    assert isinstance(routers, HopRouters)
    agg1, core3, core0 = lay.uplink_ips(0, 1)[1], lay.core_ips(0, 3)[1], lay.core_ips(0, 0)[1]
    r2 = ProbeResult("10.0.3.1", 5201, "tcp", {100: agg1, 101: agg1, 102: agg1}, ttl=2)
    r3 = ProbeResult("10.0.3.1", 5201, "tcp", {100: core3, 101: core0}, ttl=3)
    pm, unknown = pathmap_from_probes([r2, r3], routers, src_ip="10.0.0.1", paths=4, port_range=(100, 199))
    # 100: aggregation 1 then core 3 (plane 1): path 3; 101: core 0 is not above aggregation 1;
    # 102: no TTL-3 answer.
    assert pm.path_of(100) == 3 and pm.path_of(101) == -1 and pm.path_of(102) == -1 and unknown == 2
    assert routers.for_paths(2).ttls == (2,)  # a peer in the same pod: the leaf's choice alone


# --------------------------------------------------------------------------- root
root = pytest.mark.root
needs_ns = pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("tb3"))
    tbm.down("arkc", base)
    st = tbm.up(SPEC, base)
    yield st, base
    tbm.down("arkc", base)


@root
@needs_ns
def test_probes_learn_both_choices_and_agree_with_the_kernel_at_each_hop(bed):
    from ark.testbed.probing import probe

    st, _ = bed
    fab = st.spec.fabric()
    pairs = {s: {d for d in fab.role_hosts("decode") if fab.n_paths(s, d) > 1} for s in fab.role_hosts("prefill")}
    res = probe(st, pairs, 64)
    assert res["probe_checked_by_hop"][1] > 0  # ports towards the other pod, checked at the aggregation switch
    assert all(a >= 0.999 for a in res["probe_agreement_by_hop"]) and res["probe_agreement_fraction"] >= 0.999


@root
@needs_ns
def test_a_run_puts_every_ark_flow_on_its_reserved_aggregation_switches_and_core(bed):
    from ark.testbed import run as tr

    st, _ = bed
    ark = tr.run(st, tr.RunParams(scheme="ark", requests=24, qps=8.0, seed=1, sample=64))
    assert ark["errors"] == 0 and ark["path_checked"] == 24 and ark["path_match_fraction"] == 1.0
    assert all(a >= 0.999 for a in ark["probe_agreement_by_hop"])
    cross = [f for f in ark["flows"] if f["spine"] is not None]  # counted at a core: between pods
    assert cross and all(f["spine"] == f["reserved_spine"] for f in cross)
    with pytest.raises(tbm.TestbedError, match="2-tier testbed only"):
        tbm.set_link(st, 0, 0, False)
