"""Steady state (ark.sim.steady) and what a results file says about itself (ark.sim.report)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ark.sim import config as cfgmod
from ark.sim.experiment import run_sweep
from ark.sim.report import about, fabric_line, go_no_go, markdown_lines
from ark.sim.steady import STEADY_SHARE, check, run_fields, warning


def _run(n: int, rate: float, sojourn: float, fct: float = 0.1, rise: float = 0.0) -> dict[str, float | None]:
    arrivals = np.arange(n) / rate
    fcts = fct * (1 + rise * np.arange(n) / n)
    return run_fields(arrivals, arrivals + sojourn - fcts, fcts)


def test_a_run_shorter_than_its_edge_has_no_steady_part() -> None:
    r = _run(100, 10.0, 20.0)  # 10 s of arrivals, every request 20 s from arrival to KV
    assert r["edge_s"] == pytest.approx(20.0) and r["steady_share"] == 0.0 and r["steady_rise"] is None
    long = _run(10_000, 10.0, 20.0)  # 1,000 s: 40 s of it warm-up and drain
    assert long["steady_share"] == pytest.approx(0.96, abs=0.001) and long["steady_rise"] == pytest.approx(0, abs=1e-9)


def _records(share: float, rise: float | None, load: float, qps: float = 10.0, edge: float = 5.0) -> list[dict]:
    return [{"qps": qps, "scheme": s, "seed": k, "requests": 1000, "offered_load": load, "edge_s": edge,
             "steady_share": share, "steady_rise": rise, "arrival_span_s": 100.0}
            for s in ("ecmp", "ark") for k in (0, 1)]


def test_a_short_run_is_named_with_the_count_that_would_do() -> None:
    (c,) = check(_records(0.2, None, 0.5, qps=35, edge=28.9))
    assert not c.steady and not c.overloaded and c.needed == 4100  # 4 x 35 x 28.9 = 4046, rounded up
    w = warning([c])
    assert w is not None and "runs of 1,000 requests are too short" in w and "--requests 4,100" in w
    (ok,) = check(_records(STEADY_SHARE, 0.05, 0.5))
    assert ok.steady and ok.needed is None and warning([ok]) is None


def test_an_overloaded_point_says_no_count_would_do() -> None:
    for recs in (_records(0.6, 0.8, 0.9), _records(0.6, 0.0, 1.03)):  # rising in every run; offered load >= 1
        (c,) = check(recs)
        assert c.overloaded and c.needed is None
        assert "overloaded" in (warning([c]) or "") and "--requests" not in (warning([c]) or "")
    mixed = _records(0.6, 0.8, 0.9)
    mixed[0]["steady_rise"] = 0.1  # one run that does not rise: not overloaded
    assert not check(mixed)[0].overloaded


@pytest.fixture(scope="module")
def short70b() -> tuple[cfgmod.ExperimentConfig, list[dict]]:
    """A 70B model's prefill lasts seconds: 60 requests at QPS 3 are warm-up and drain only."""
    cfg = cfgmod.from_dict({"fabric": {"leaves": 4, "spines": 2, "gpus_per_leaf": 2, "oversubscription": 2.0,
                                       "hash": "crc32"},
                            "workload": {"model": "llama-3-70b", "requests": 60, "qps": [3]},
                            "experiment": {"schemes": ["ecmp", "ark"], "seeds": 2}})
    return cfg, run_sweep(cfg).records


def test_a_real_short_run_is_flagged_and_results_stand_alone(short70b) -> None:
    cfg, recs = short70b
    (c,) = check(recs)
    assert c.share < STEADY_SHARE and c.needed is not None and c.needed > 60
    a = about(cfg, recs)
    assert a["fabric"]["oversubscription"] == [2.0] and a["fabric"]["link_gbps"] == 100.0 * 2 / (2 * 2.0)
    assert a["fabric"]["hash"] == "crc32" and a["workload"]["requests_per_run"] == 60
    assert a["loads"][0]["offered_load"] > 0 and a["steady_warning"].startswith("runs of 60 requests")
    (g,) = a["go_no_go"]
    assert g["scheme"] == "ark" and "runs not steady" in g["provisional"] and g["line"].startswith("QPS 3: ")
    md = "\n".join(markdown_lines(cfg, recs))
    assert "oversubscription 2:1" in md and "crc32" in md and "| 3 | " in md and "**Warning**" in md
    assert "## Go or no-go" in md and "60 requests per run" in md


def test_go_needs_a_real_gain_with_an_interval_that_excludes_zero() -> None:
    def recs(ark: list[float], ecmp: list[float], other: float | None = None) -> list[dict]:
        rows = [{"qps": 5.0, "scheme": "ecmp", "seed": k, "fct_mean_s": v, "edge_s": 1, "steady_share": 1,
                 "steady_rise": 0, "offered_load": 0.3, "requests": 1000} for k, v in enumerate(ecmp)]
        rows += [{**r, "scheme": "ark", "fct_mean_s": v} for r, v in zip(rows, ark, strict=True)]
        if other is not None:
            rows += [{**r, "scheme": "ecmp-split", "fct_mean_s": other} for r in rows[:len(ecmp)]]
        return rows

    (g,) = go_no_go(recs([0.8, 0.81, 0.79], [1.0, 1.0, 1.0]))
    assert g["go"] and g["change"] == pytest.approx(-0.2) and g["change_hi"] < 0 and not g["provisional"]
    assert not go_no_go(recs([0.99, 0.98, 0.99], [1.0, 1.0, 1.0]))[0]["go"]  # under 3%
    assert not go_no_go(recs([0.7, 1.2, 0.8], [1.0, 1.0, 1.0]))[0]["go"]  # the interval holds 0
    no = go_no_go(recs([0.8, 0.81, 0.79], [1.0, 1.0, 1.0], other=0.6))[0]
    assert not no["go"] and "ecmp-split" in no["why"]
    one = go_no_go(recs([0.8], [1.0]))[0]
    assert math.isnan(one["change_lo"]) and "one seed" in one["provisional"]


def test_the_fabric_line_names_rates_oversubscription_and_hash() -> None:
    line = fabric_line(cfgmod.default())
    assert "16 GPUs" in line and "4 spines" in line and "links 100 Gbit/s" in line
    assert "oversubscription 2:1" in line and "murmur3-hpcc" in line


def test_a_trace_replay_states_the_requests_it_ran(tmp_path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + k:02d}.0000000,{1000 + 100 * k},10\n" for k in range(10)))
    cfg = cfgmod.from_dict({"workload": {"trace": str(trace), "requests": 300, "qps": [5]},
                            "experiment": {"schemes": ["ecmp", "ark"], "seeds": 1}})
    recs = run_sweep(cfg).records
    md = "\n".join(markdown_lines(cfg, recs))
    assert "10 requests per run" in md and "300" not in md and about(cfg, recs)["workload"]["requests_per_run"] == 10
