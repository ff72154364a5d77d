"""The simulator's prediction for the testbed's own flows: no root, no namespaces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ark.core.fabric_config import FabricConfig
from ark.testbed import fabric as tbm
from ark.testbed.fabric import State
from ark.testbed.plan import plan_flows, spec_flows
from ark.testbed.predict import PREDICTED_SCHEMES, predict, predict_all, relative_to_ecmp

TWO_TIER = tbm.TestbedSpec()
CLOS3 = tbm.TestbedSpec.from_fabric_config(FabricConfig(preset="clos3-small"))
REQUESTS, QPS = 150, 20.0  # the testbed's default load


def test_spec_flows_are_plan_flows(tmp_path):
    # plan_flows reads only the spec of its State: the two must give the same plan.
    for spec in (TWO_TIER, CLOS3):
        assert plan_flows(State(spec, tmp_path), REQUESTS, QPS, 3) == spec_flows(spec, REQUESTS, QPS, 3)


@pytest.mark.parametrize("spec", [TWO_TIER, CLOS3], ids=["2-tier", "clos3-small"])
def test_prediction_is_deterministic_and_counts_every_flow(spec):
    flows, _ = spec_flows(spec, REQUESTS, QPS, 0)
    a = predict_all(spec, flows, seed=0)
    assert a == predict_all(spec, flows, seed=0)
    assert list(a) == list(PREDICTED_SCHEMES)
    for p in a.values():
        assert p["flows"] == p["finished"] == len(flows) == REQUESTS
        assert p["link_mbps"] == pytest.approx(100.0)
        assert p["fct_p50_s"] <= p["fct_p95_s"] and "slow start" in p["model"]
    assert predict(spec, flows, "ecmp", 1) != a["ecmp"]  # the seed draws ECMP's ports


@pytest.mark.parametrize("spec", [TWO_TIER, CLOS3], ids=["2-tier", "clos3-small"])
def test_fcts_are_bounded_by_the_ideal_transfer_time(spec):
    flows, _ = spec_flows(spec, REQUESTS, QPS, 0)
    link_bps = spec.link_gbps * 1e9 * spec.scale
    ideal = float(np.mean([f.nbytes * 8 / link_bps for f in flows]))
    for p in predict_all(spec, flows, seed=0).values():
        # Never faster than line rate; at load ~0.67 slowed down, but not by an order of magnitude.
        assert ideal < p["ideal_mean_s"] < p["fct_mean_s"] < 10 * ideal
        assert 1.0 < p["slowdown_mean"] < 10.0


def test_ark_beats_ecmp_on_the_two_tier_testbed():
    means: dict[str, list[float]] = {s: [] for s in PREDICTED_SCHEMES}
    for seed in range(5):
        flows, _ = spec_flows(TWO_TIER, REQUESTS, QPS, seed)
        for s, p in predict_all(TWO_TIER, flows, seed=seed).items():
            means[s].append(p["fct_mean_s"])
        if seed == 0:
            rel = relative_to_ecmp(predict_all(TWO_TIER, flows, seed=seed))
            assert set(rel) == {"ark", "ark-balance", "ark-split"} and all(v < 0 for v in rel.values())
    assert all(np.mean(means[s]) < np.mean(means["ecmp"]) for s in ("ark", "ark-balance", "ark-split"))
    # One part per spine, each finishing with the others: the lowest mean of all.
    assert np.mean(means["ark-split"]) < min(np.mean(means["ark"]), np.mean(means["ark-balance"]))


def test_times_do_not_depend_on_the_scale():
    # Rates and bytes scale together, so an ECMP run (same ports, same paths) takes the same time.
    ten = dataclasses.replace(TWO_TIER, scale=1e-2)
    a = predict(TWO_TIER, spec_flows(TWO_TIER, REQUESTS, QPS, 2)[0], "ecmp", 2)
    b = predict(ten, spec_flows(ten, REQUESTS, QPS, 2)[0], "ecmp", 2)
    assert b["link_mbps"] == pytest.approx(1000.0)
    assert b["fct_mean_s"] == pytest.approx(a["fct_mean_s"], rel=1e-4)


def test_bad_requests_are_refused():
    flows, _ = spec_flows(TWO_TIER, 10, QPS, 0)
    with pytest.raises(tbm.TestbedError, match="^scheme: "):
        predict(TWO_TIER, flows, "spray", 0)
    with pytest.raises(tbm.TestbedError, match="^flows: "):
        predict(TWO_TIER, [], "ecmp", 0)
    with pytest.raises(tbm.TestbedError, match="^preds: "):
        relative_to_ecmp({"ark": {"fct_mean_s": 1.0}})
