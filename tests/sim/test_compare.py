"""ark compare's tables and the best ARK policy's targets on the paper preset."""

from __future__ import annotations

import math

import pytest

from ark.sim import config
from ark.sim.compare import (
    compare_config,
    decisions,
    fct_table,
    markdown,
    paired_cells,
    paired_table,
    run_compare,
    slowdown,
)
from ark.sim.config import from_dict
from ark.sim.experiment import run_sweep
from ark.sim.racewindow import halving_delay, race_config, race_points, run_race_window


def _at(rows: list[dict], q: float, s: str) -> dict:
    return next(r for r in rows if r["qps"] == q and r["scheme"] == s)


def _targets(rows: list[dict], qs: tuple[float, ...]) -> None:
    for q in qs:
        if q <= 25:
            assert _at(rows, q, "ark-split")["x_spray"] <= 1.10, q
    if 30.0 in qs:
        assert _at(rows, 30.0, "ark-split")["vs_ecmp"] <= -0.35


def test_ark_split_targets_on_one_seed() -> None:
    """The best ARK policy: within 10% of spray at QPS 25, 35% below ECMP at QPS 30."""
    cfg = config.default().with_overrides(schemes=("ecmp", "ark-split", "spray"), qps=(25.0, 30.0), seeds=(0,))
    _targets(fct_table(run_sweep(cfg, jobs=2).records), (25.0, 30.0))


@pytest.mark.slow
def test_ark_split_targets_at_every_qps_over_the_default_seeds() -> None:
    cfg = config.default().with_overrides(schemes=("ecmp", "ark-split", "spray"))
    _targets(fct_table(run_sweep(cfg, jobs=2).records), config.DEFAULT_QPS)


def test_compare_tables_and_summary() -> None:
    cfg = compare_config(from_dict({"workload": {"requests": 120, "qps": [5, 20]}, "experiment": {"seeds": 1}}),
                         ("ecmp", "conga", "ark", "ark-balance", "spray"))
    comp = run_compare(cfg)
    tab = fct_table(comp.records)
    for d in decisions(tab):
        at = [r for r in tab if r["qps"] == d["qps"] and r["scheme"] != "spray"]
        assert d["best_fct_s"] == min(r["fct_mean_s"] for r in at)
        near = {r["scheme"] for r in at if r["fct_mean_s"] <= 1.05 * d["best_fct_s"]}
        assert set(d["as_good"]) == near and "spray" not in d["as_good"]
        fct = {r["scheme"]: r["fct_mean_s"] for r in at}
        assert d["best_ark"] == min(("ark", "ark-balance"), key=fct.__getitem__)
        assert d["best_other"] == min(("ecmp", "conga"), key=fct.__getitem__)
    md = markdown(comp)
    assert "## Which scheme at which load" in md and "| 20 |" in md
    assert md.endswith("One seed: no interval (`--seeds N`; about 10 seeds or more for a useful one).\n")
    assert {(r["baseline"], r["n"]) for r in comp.paired} == {("ecmp", 1), ("spray", 1)}
    for r in tab:
        assert math.isclose(r["x_spray"], r["fct_mean_s"] / _at(tab, r["qps"], "spray")["fct_mean_s"])
    sd = slowdown(comp.sweep, 100e9 * cfg.fabric.build().efficiency / 8, 20.0)
    assert sd and all(r["slowdown"] >= 1.0 - 1e-9 for r in sd)
    assert sum(r["flows"] for r in sd if r["scheme"] == "ecmp") == 120


def test_results_do_not_depend_on_jobs() -> None:
    cfg = from_dict({"workload": {"requests": 80, "qps": [10, 25]}, "experiment": {"seeds": 2,
                     "schemes": ["plb", "conga", "ark-split"]}})
    assert run_sweep(cfg, jobs=1).records == run_sweep(cfg, jobs=2).records


def test_halving_delay_interpolates_in_log_delay() -> None:
    rows = [{"scheme": "ark", "sweep": "reference", "delay_us": 0.0, "gain_vs_ecmp": 0.4}]
    rows += [{"scheme": "ark", "sweep": "delay", "delay_us": d, "gain_vs_ecmp": g}
             for d, g in ((10.0, 0.4), (100.0, 0.3), (1000.0, 0.1))]
    assert halving_delay(rows, "ark") == pytest.approx(10 ** 2.5)
    assert halving_delay(rows[:3], "ark") is None
    no_gain = [{**rows[0], "gain_vs_ecmp": -0.05}, *rows[1:]]  # nothing to halve: a later loss is no "halving"
    assert halving_delay(no_gain, "ark") is None


def test_races_grow_with_the_control_delay() -> None:
    cfg = race_config(requests=200, seeds=1)
    pts = race_points(delays=(10.0, 300_000.0), jitters=(), skews=(1000.0,), queues=())
    rows = run_race_window(cfg, pts, ("ark",))
    by = {(r["sweep"], r.get("delay_us")): r for r in rows if r["scheme"] == "ark"}
    assert by[("delay", 300_000.0)]["races_per_1000"] > by[("delay", 10.0)]["races_per_1000"]
    ref, slow = by[("reference", 0.0)], by[("delay", 300_000.0)]
    assert math.isclose(slow["fct_change"], slow["fct_mean_s"] / ref["fct_mean_s"] - 1.0)
    assert all(r["mismatches"] == 0 for r in rows if r["scheme"] == "ark")


def test_paired_table_against_ecmp_and_spray_per_qps() -> None:
    recs = [{"scheme": s, "qps": q, "seed": seed, "fct_mean_s": f * q * (1 + seed / 10)}
            for q in (20.0, 5.0) for s, f in (("ark", 0.5), ("ecmp", 1.0), ("spray", 0.4)) for seed in range(4)]
    rows = paired_table(recs)
    assert [(r["baseline"], r["qps"], r["scheme"]) for r in rows] == [
        ("ecmp", 5.0, "ark"), ("ecmp", 5.0, "spray"), ("ecmp", 20.0, "ark"), ("ecmp", 20.0, "spray"),
        ("spray", 5.0, "ark"), ("spray", 5.0, "ecmp"), ("spray", 20.0, "ark"), ("spray", 20.0, "ecmp")]
    r = rows[0]  # ark is half of ECMP on every seed: the ratio's interval is that point
    assert r["ratio"] == r["ratio_lo"] == r["ratio_hi"] == 0.5 and r["verdict"] == "-50.0% [-50.0%, -50.0%]"
    d, ratio = paired_cells(r)  # per seed -2.5, -2.75, -3, -3.25 s
    assert d == f"-2875.0 [{r['diff_lo'] * 1e3:+.1f}, {r['diff_hi'] * 1e3:+.1f}]" and ratio == "0.500 [0.500, 0.500]"
    assert -3250 <= r["diff_lo"] * 1e3 < -2875 < r["diff_hi"] * 1e3 <= -2500
    assert paired_table([x for x in recs if x["scheme"] != "spray"]) == rows[:1] + rows[2:3]
