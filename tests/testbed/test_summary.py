"""What a set of testbed runs says: paired against ECMP, measured beside simulated."""

from __future__ import annotations

import math

import pytest

from ark.testbed.summary import PARTS, summarize


def _rec(scheme: str, seed: int, fct: float, sim: float, busy: float = 0.5) -> dict:
    parts = {"late_s": 0.001, "lease_s": 0.0 if scheme == "ecmp" else 0.01, "connect_s": 0.002, "transfer_s": fct}
    return {"scheme": scheme, "seed": seed, "fct_mean_s": fct, "sim": {"fct_mean_s": sim},
            "fct_parts_mean_s": parts, "cpu_busy_fraction": busy, "cpu_saturated": busy >= 0.95}


def test_paired_rows_compare_each_scheme_with_ecmp_per_seed_beside_the_simulator() -> None:
    recs = []
    for seed, base in enumerate([0.40, 0.50, 0.45, 0.60, 0.55]):
        recs += [_rec("ecmp", seed, base, 0.5), _rec("ark", seed, base * 0.8, 0.4), _rec("ark-balance", seed, base, 0.5)]
    recs.append(_rec("ark", 9, 0.3, 0.3, busy=0.99))  # no ECMP run for seed 9: not paired
    out = summarize(recs)
    rows = {r["scheme"]: r for r in out["paired"]}
    ark = rows["ark"]
    assert ark["n"] == 5 and ark["rel_by_seed"] == pytest.approx([-0.2] * 5)
    assert ark["significant"] and ark["ratio"] == pytest.approx(0.8) and ark["sim_rel_diff"] == pytest.approx(-0.2)
    same = rows["ark-balance"]
    assert not same["significant"] and same["diff_mean"] == 0.0
    assert out["saturated"] == [{"scheme": "ark", "seed": 9, "cpu_busy_fraction": 0.99}]
    assert set(out["parts"]) == {"ecmp", "ark", "ark-balance"} and set(out["parts"]["ark"]) == set(PARTS)
    assert out["parts"]["ecmp"]["lease_s"] == 0.0 and out["parts"]["ark"]["lease_s"] == pytest.approx(0.01)


def test_a_run_without_a_prediction_or_parts_still_summarizes() -> None:
    recs = [{"scheme": s, "seed": 0, "fct_mean_s": 1.0} for s in ("ecmp", "ark")]
    out = summarize(recs)
    assert out["paired"][0]["n"] == 1 and math.isnan(out["paired"][0]["sim_rel_diff"])
    assert all(math.isnan(v) for v in out["parts"]["ark"].values()) and out["saturated"] == []
