"""The published experiment's shape, on the embedded default config (2 leaves, 4 spines, LLaMA-3-8B, Zipf 0.7)."""

from __future__ import annotations

import pytest

from ark.sim import config as config
from ark.sim.experiment import run_sweep, summarize


@pytest.fixture(scope="module")
def rows() -> dict[tuple[float, str], dict]:
    sw = run_sweep(config.default(), jobs=2)
    assert all(r["path_mismatches"] == 0 for r in sw.records)
    return {(r["qps"], r["scheme"]): r for r in summarize(sw.records)}


QPS = config.DEFAULT_QPS


def red(rows, q, s, m="fct_mean_reduction") -> float:
    return rows[(q, s)][m]


def test_low_load_gain_is_small(rows) -> None:
    assert red(rows, 1.0, "ark") < 0.05


def test_peak_gain_between_10_and_25(rows) -> None:
    peak_q = max(QPS, key=lambda q: red(rows, q, "ark"))
    assert 10 <= peak_q <= 25
    assert 0.20 <= red(rows, peak_q, "ark") <= 0.45
    assert red(rows, peak_q, "ark", "fct_p95_reduction") >= 0.25
    assert red(rows, 30.0, "ark") < red(rows, peak_q, "ark")


def test_ttft_gain_smaller_than_fct_gain(rows) -> None:
    for q in QPS:
        if q > 1:
            assert red(rows, q, "ark", "ttft_mean_reduction") < red(rows, q, "ark")


def test_ecmp_piles_more_flows_per_spine(rows) -> None:
    assert max(rows[(25.0, "ecmp")]["max_concurrent_per_spine"]) > max(rows[(25.0, "ark")]["max_concurrent_per_spine"])


def test_balance_at_least_as_good_and_better_at_30(rows) -> None:
    for q in QPS:
        assert red(rows, q, "ark-balance") >= red(rows, q, "ark") - 0.01
    assert red(rows, 30.0, "ark-balance") - red(rows, 30.0, "ark") >= 0.10


def test_nothing_beats_ideal_spraying(rows) -> None:
    for q in QPS:
        for s in ("ecmp", "ark", "ark-balance"):
            assert rows[(q, s)]["fct_mean_s"] >= rows[(q, "spray")]["fct_mean_s"] * 0.999
