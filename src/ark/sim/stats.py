"""Paired bootstrap intervals for comparing schemes over seeds.

Why paired: in a sweep each seed fixes the workload (arrivals, KV sizes, prefill and
decode hosts) that every scheme sees, so most of the seed-to-seed spread of a metric is
the workload's, shared by all schemes. Comparing scheme and baseline *per seed* (the
difference ``value - baseline`` on the same seed) removes that shared part; comparing the
two means as independent samples would keep it and hide real differences.

Why a bootstrap over seeds: the seeds are the independent units (the flows within one run
share queues and are not). :func:`paired` resamples seeds with replacement, takes the
mean per-seed difference of each resample and reports its percentile interval; the ratio
of means (``mean(values) / mean(baseline)``) gets its interval from the same resamples.
What the interval means: were the sweep repeated with fresh seeds, an interval built this
way would hold the true mean difference (over the workload distribution) in about
``level`` of the repeats -- given enough seeds. It says nothing about an operator's
fabric, only about the workload model's seeds.

With few seeds the percentile bootstrap under-covers: it uses the seeds' spread as if it
were the population's (a z-interval with the ``n``-denominator variance, not Student's
t). Measured coverage of the nominal 95% interval, normal per-seed differences
(:func:`coverage`, 4,000 trials, 2,000 resamples each;
``.venv/bin/python -c "from ark.sim.stats import coverage; print([coverage(n, 4000, 2000) for n in (3, 5, 8, 12, 20)])"``):

    seeds      3      5      8      12     20
    coverage   0.754  0.841  0.895  0.907  0.921

With 3 seeds the interval is about the range of the per-seed differences, so
"significant" means the seeds agree in sign -- which 1 in 4 comparisons with no real
difference does by chance (2 x 1/2^3). A useful 95% interval (coverage about 0.9) needs
about 10 seeds or more.
``tests/sim/test_stats.py::test_percentile_bootstrap_under_covers_with_few_seeds`` checks
these figures on fewer trials.

Pure: numpy only, no I/O; a ``seed`` fixes the resamples, so equal inputs give equal output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Paired", "StatsError", "coverage", "paired", "paired_rows"]

NAN_CI = (math.nan, math.nan)


class StatsError(ValueError):
    """A bad argument to :func:`paired` or :func:`paired_rows` (one line, naming the field)."""


@dataclass(frozen=True)
class Paired:
    """One scheme against a baseline over the seeds both have (``value - baseline``)."""

    n: int
    seeds: tuple[int, ...]
    diffs: tuple[float, ...]  # per seed, in seed order
    value_mean: float
    baseline_mean: float
    mean_diff: float
    diff_ci: tuple[float, float]
    ratio: float  # value_mean / baseline_mean
    ratio_ci: tuple[float, float]
    rel_diff: float  # ratio - 1
    significant: bool  # diff_ci excludes 0
    level: float
    verdict: str


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int | np.integer) or resamples < 100:
        raise StatsError(f"resamples: must be an integer >= 100; got {resamples!r}")
    if not (isinstance(level, int | float) and 0.0 < level < 1.0):
        raise StatsError(f"level: must be a number with 0 < level < 1, e.g. 0.95; got {level!r}")


def _pairs(values: Mapping[int, float], baseline: Mapping[int, float]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The seeds in both with finite values on both sides, ascending, and their values."""
    seeds = sorted(s for s in values.keys() & baseline.keys()
                   if math.isfinite(values[s]) and math.isfinite(baseline[s]))
    return (seeds, np.array([float(values[s]) for s in seeds], dtype=float),
            np.array([float(baseline[s]) for s in seeds], dtype=float))


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    if not np.all(np.isfinite(samples)):
        return NAN_CI  # a resampled baseline mean of 0: no ratio
    lo, hi = np.quantile(samples, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def _ratio(num: float | np.ndarray, den: float | np.ndarray) -> Any:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(num, den)


def _pct(x: float) -> str:
    return f"{100.0 * x:+.1f}%"


def _verdict(n: int, diff: float, ci: tuple[float, float], rel: float, rci: tuple[float, float],
             significant: bool) -> str:
    if n == 0:
        return "no seed in both"
    if n < 2:
        return "one seed: no interval"
    if not significant:
        return "no significant difference (CI holds 0)"
    if math.isfinite(rel) and all(map(math.isfinite, rci)):
        return f"{_pct(rel)} [{_pct(rci[0] - 1.0)}, {_pct(rci[1] - 1.0)}]"
    return f"{diff:+.4g} [{ci[0]:+.4g}, {ci[1]:+.4g}]"  # the baseline's mean is 0: no relative change


def paired(values: Mapping[int, float], baseline: Mapping[int, float], *, resamples: int = 10_000,
           level: float = 0.95, seed: int = 0) -> Paired:
    """``values`` against ``baseline`` (both keyed by seed) over the seeds both hold with
    finite values: the mean difference and the ratio of means, each with its percentile
    bootstrap interval at ``level`` (``resamples`` resamples of the seeds, drawn by a numpy
    Generator seeded with ``seed``). With fewer than 2 seeds the intervals are (nan, nan)."""
    _check(resamples, level)
    seeds, v, b = _pairs(values, baseline)
    n, d = len(seeds), v - b
    vm, bm = (float(v.mean()), float(b.mean())) if n else (math.nan, math.nan)
    mean_diff = float(d.mean()) if n else math.nan
    ratio = float(_ratio(vm, bm)) if n else math.nan
    ci, rci = NAN_CI, NAN_CI
    if n >= 2:
        idx = np.random.default_rng(seed).integers(0, n, size=(int(resamples), n))
        ci = _interval(d[idx].mean(axis=1), level)
        rci = _interval(_ratio(v[idx].mean(axis=1), b[idx].mean(axis=1)), level)
    significant = n >= 2 and (ci[0] > 0.0 or ci[1] < 0.0)
    rel = ratio - 1.0
    return Paired(n=n, seeds=tuple(seeds), diffs=tuple(float(x) for x in d), value_mean=vm, baseline_mean=bm,
                  mean_diff=mean_diff, diff_ci=ci, ratio=ratio, ratio_ci=rci, rel_diff=rel,
                  significant=bool(significant), level=float(level),
                  verdict=_verdict(n, mean_diff, ci, rel, rci, bool(significant)))


def _by_scheme(records: Sequence[Mapping[str, Any]], metric: str,
               group: Sequence[str]) -> dict[tuple[Any, ...], dict[str, dict[int, float]]]:
    """group values -> scheme -> seed -> metric, in first-appearance order; records without
    a finite metric are left out."""
    out: dict[tuple[Any, ...], dict[str, dict[int, float]]] = {}
    for r in records:
        x = r.get(metric)
        if not isinstance(x, int | float | np.integer | np.floating) or not math.isfinite(x):
            continue
        g = tuple(r[k] for k in group)
        per_seed = out.setdefault(g, {}).setdefault(r["scheme"], {})
        if r["seed"] in per_seed:
            where = ", ".join(f"{k}={v}" for k, v in zip(group, g, strict=True))
            raise StatsError(f"records: two records for scheme {r['scheme']!r}, seed {r['seed']}"
                             f"{', ' + where if where else ''}; give one per seed (or add the key that "
                             "tells them apart to group)")
        per_seed[r["seed"]] = float(x)
    return out


def paired_rows(records: Sequence[Mapping[str, Any]], metric: str, baseline: str = "ecmp",
                group: Sequence[str] = (), *, resamples: int = 10_000, level: float = 0.95,
                seed: int = 0) -> list[dict[str, Any]]:
    """Every scheme other than ``baseline`` against it on ``metric``, per value of the
    ``group`` keys (e.g. ``("qps",)``), paired over seeds (:func:`paired`). Records need
    ``scheme``, ``seed``, the group keys and the metric; one without a finite metric is
    ignored. Rows come in the records' order of groups, then of schemes; a group without the
    baseline has none."""
    _check(resamples, level)
    rows = []
    for g, schemes in _by_scheme(records, metric, tuple(group)).items():
        base = schemes.get(baseline)
        if base is None:
            continue
        for scheme, vals in schemes.items():
            if scheme == baseline:
                continue
            p = paired(vals, base, resamples=resamples, level=level, seed=seed)
            rows.append({"scheme": scheme, **dict(zip(group, g, strict=True)), "baseline": baseline,
                         "metric": metric, "n": p.n, "seeds": list(p.seeds), "baseline_mean": p.baseline_mean,
                         "mean": p.value_mean, "diff_mean": p.mean_diff, "diff_lo": p.diff_ci[0],
                         "diff_hi": p.diff_ci[1], "ratio": p.ratio, "ratio_lo": p.ratio_ci[0],
                         "ratio_hi": p.ratio_ci[1], "rel_diff": p.rel_diff, "significant": p.significant,
                         "level": p.level, "verdict": p.verdict, "diffs": list(p.diffs)})
    return rows


def coverage(n: int, trials: int = 2000, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> float:
    """The share of ``trials`` samples of ``n`` standard-normal per-seed differences whose
    :func:`paired` interval holds the true mean difference (0): the interval's real coverage."""
    if n < 2 or trials < 1:
        raise StatsError(f"coverage: needs n >= 2 and trials >= 1; got n={n}, trials={trials}")
    rng = np.random.default_rng(seed)
    base = dict.fromkeys(range(n), 10.0)  # any positive baseline; only the differences matter
    hits = 0
    for t in range(trials):
        d = rng.standard_normal(n)
        lo, hi = paired({i: 10.0 + d[i] for i in range(n)}, base, resamples=resamples, level=level, seed=t).diff_ci
        hits += lo <= 0.0 <= hi
    return hits / trials
