"""Paired bootstrap over seeds: exact small cases, determinism, input checks, coverage."""

from __future__ import annotations

import math

import pytest

from ark.sim.stats import StatsError, coverage, paired, paired_rows


def test_constant_difference_gives_a_zero_width_interval_at_it() -> None:
    p = paired({0: 3.0, 1: 5.0, 2: 9.0}, {0: 2.5, 1: 4.5, 2: 8.5})
    assert p.n == 3 and p.seeds == (0, 1, 2) and p.diffs == (0.5, 0.5, 0.5)
    assert p.mean_diff == 0.5 and p.diff_ci == (0.5, 0.5)
    assert p.significant
    assert p.ratio == pytest.approx(17 / 15.5) and p.rel_diff == pytest.approx(17 / 15.5 - 1)
    assert p.ratio_ci[0] < p.ratio < p.ratio_ci[1]  # the means move with the resampled seeds
    assert p.verdict == f"+{100 * (17 / 15.5 - 1):.1f}% [{p.ratio_ci[0] * 100 - 100:+.1f}%, " \
                        f"{p.ratio_ci[1] * 100 - 100:+.1f}%]"


def test_a_lower_value_on_every_seed_is_a_significant_reduction() -> None:
    base = {s: 10.0 + s for s in range(8)}
    p = paired({s: v * 0.9 for s, v in base.items()}, base)
    assert p.diff_ci[1] < 0 and p.significant
    assert p.verdict.startswith("-10.0% [") and p.ratio_ci[1] < 1.0


def test_mixed_signs_are_not_significant() -> None:
    p = paired({0: 1.0, 1: 3.0, 2: 2.0, 3: 4.0}, {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0})
    assert p.diffs == (-1.0, 1.0, 0.0, 1.0)
    assert p.diff_ci[0] < 0 < p.diff_ci[1] and not p.significant
    assert p.verdict == "no significant difference (CI holds 0)"


def test_same_inputs_same_output_and_the_seed_fixes_the_resamples() -> None:
    v, b = {s: math.sqrt(s + 0.5) * (s % 3) for s in range(6)}, {s: 2.0 for s in range(6)}
    assert paired(v, b) == paired(dict(reversed(v.items())), b)
    assert paired(v, b, seed=1) == paired(v, b, seed=1)
    assert paired(v, b, seed=1).diff_ci != paired(v, b, seed=2).diff_ci


def test_unpaired_and_non_finite_seeds_are_dropped() -> None:
    p = paired({0: 2.0, 1: 3.0, 2: math.nan, 5: 1.0, 7: 4.0}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 7: math.inf})
    assert p.seeds == (0, 1) and p.diffs == (1.0, 2.0) and p.mean_diff == 1.5


def test_one_seed_has_no_interval() -> None:
    p = paired({0: 2.0, 1: math.nan}, {0: 1.0, 1: 1.0})
    assert p.n == 1 and p.mean_diff == 1.0 and p.ratio == 2.0
    assert all(math.isnan(x) for x in (*p.diff_ci, *p.ratio_ci))
    assert not p.significant and p.verdict == "one seed: no interval"
    assert paired({}, {0: 1.0}).verdict == "no seed in both"


def test_a_zero_baseline_has_no_ratio_but_a_difference() -> None:
    p = paired({0: 1.0, 1: 1.0}, {0: 0.0, 1: 0.0})
    assert math.isnan(p.ratio_ci[0]) and p.significant and p.verdict == "+1 [+1, +1]"


@pytest.mark.parametrize(
    ("kw", "needles"),
    [({"resamples": 99}, ["resamples", ">= 100"]), ({"resamples": 1000.0}, ["resamples", "integer"]),
     ({"level": 1.0}, ["level", "0 < level < 1"]), ({"level": 0}, ["level"]), ({"level": math.nan}, ["level"])],
)
def test_bad_resamples_or_level_is_a_one_line_error(kw: dict, needles: list[str]) -> None:
    with pytest.raises(StatsError) as e:
        paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 1.0}, **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    with pytest.raises(ValueError, match="level"):
        paired_rows([], "fct_mean_s", level=2.0)


def _rec(scheme: str, qps: float, seed: int, fct: float) -> dict:
    return {"scheme": scheme, "qps": qps, "seed": seed, "fct_mean_s": fct}


def test_paired_rows_per_group_against_the_baseline() -> None:
    recs = [_rec("ecmp", q, s, q + s) for q in (5.0, 10.0) for s in range(3)]
    recs += [_rec("ark", q, s, (q + s) * 0.5) for q in (5.0, 10.0) for s in range(3)]
    recs += [_rec("spray", 5.0, s, math.nan) for s in range(3)]  # ignored: no finite metric
    recs += [{"scheme": "plb", "qps": 5.0, "seed": 0}, _rec("ark", 20.0, 0, 1.0)]  # no metric; no baseline
    rows = paired_rows(recs, "fct_mean_s", "ecmp", ("qps",))
    assert [(r["scheme"], r["qps"]) for r in rows] == [("ark", 5.0), ("ark", 10.0)]
    r = rows[0]
    want = paired({s: (5.0 + s) * 0.5 for s in range(3)}, {s: 5.0 + s for s in range(3)})
    assert r["n"] == 3 and r["seeds"] == [0, 1, 2] and r["diffs"] == list(want.diffs)
    assert (r["baseline_mean"], r["mean"], r["diff_mean"]) == (6.0, 3.0, -3.0)
    assert (r["diff_lo"], r["diff_hi"], r["ratio_lo"], r["ratio_hi"]) == (*want.diff_ci, *want.ratio_ci)
    assert r["ratio"] == 0.5 and r["significant"] and r["verdict"] == want.verdict
    assert r["baseline"] == "ecmp" and r["metric"] == "fct_mean_s"
    with pytest.raises(StatsError, match="two records for scheme 'ecmp', seed 0"):
        paired_rows(recs, "fct_mean_s", "ecmp")  # no group: seed 0 of two QPS in one pool


def test_paired_rows_ungrouped_needs_one_record_per_seed() -> None:
    recs = [_rec("ecmp", 5.0, 0, 1.0), _rec("ecmp", 5.0, 1, 2.0), _rec("ark", 5.0, 0, 0.5), _rec("ark", 5.0, 1, 1.0)]
    (row,) = paired_rows(recs, "fct_mean_s")
    assert "qps" not in row and row["ratio"] == 0.5
    with pytest.raises(StatsError, match="two records for scheme 'ark', seed 0, qps=5.0"):
        paired_rows([*recs, _rec("ark", 5.0, 0, 3.0)], "fct_mean_s", group=("qps",))


def test_percentile_bootstrap_under_covers_with_few_seeds() -> None:
    """The module docstring's coverage figures (4,000 trials there: 0.754 at 3 seeds, 0.907
    at 12), on fewer trials: 3 seeds cover about 3 in 4, 12 seeds about 0.9."""
    three, twelve = coverage(3, 400, 1000), coverage(12, 400, 1000)
    assert 0.68 <= three <= 0.82
    assert 0.86 <= twelve <= 0.95
