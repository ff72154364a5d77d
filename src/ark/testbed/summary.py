"""What a set of testbed runs says, with the uncertainty a reader needs to judge it.

Every scheme of a seed runs the same flows (the seed fixes the workload, the switches'
hash keys and ECMP's source ports), so schemes are compared *paired* by seed: the
difference of mean FCT per seed, its mean and a bootstrap 95% interval over seeds
(:mod:`ark.sim.stats`), and the same for the ratio. The simulator's prediction for the
same flows (:mod:`ark.testbed.predict`) is paired the same way, so that measured and
predicted gains sit side by side. Runs whose cores were saturated are listed: on this
machine a saturated run measures the CPU, not the fabric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ark.sim.stats import paired_rows

PARTS = ("late_s", "lease_s", "connect_s", "transfer_s")  # a flow's FCT, in the order they happen


def summarize(records: Sequence[dict[str, Any]], baseline: str = "ecmp") -> dict[str, Any]:
    """Paired comparisons against ``baseline`` (measured and simulated), where each
    scheme's mean FCT goes, and the runs that saturated the machine."""
    flat = [{**r, "sim_fct_mean_s": r.get("sim", {}).get("fct_mean_s", math.nan)} for r in records]
    measured = paired_rows(flat, "fct_mean_s", baseline=baseline)
    predicted = {row["scheme"]: row for row in paired_rows(flat, "sim_fct_mean_s", baseline=baseline)}
    base = {r["seed"]: r["fct_mean_s"] for r in flat if r["scheme"] == baseline}
    for row in measured:
        mine = {r["seed"]: r["fct_mean_s"] for r in flat if r["scheme"] == row["scheme"]}
        row["rel_by_seed"] = [mine[s] / base[s] - 1 for s in row["seeds"]]
        sim = predicted.get(row["scheme"])
        row["sim_rel_diff"] = sim["rel_diff"] if sim else math.nan
        row["sim_verdict"] = sim["verdict"] if sim else "-"
    return {"paired": measured, "parts": fct_parts(records), "saturated": saturated(records)}


def fct_parts(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per scheme, the mean over runs of each part of the mean FCT (s)."""
    out: dict[str, dict[str, float]] = {}
    for scheme in dict.fromkeys(r["scheme"] for r in records):
        runs = [r.get("fct_parts_mean_s", {}) for r in records if r["scheme"] == scheme]
        out[scheme] = {k: finite_mean([p.get(k) for p in runs]) for k in PARTS}
    return out


def saturated(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"scheme": r["scheme"], "seed": r["seed"], "cpu_busy_fraction": r.get("cpu_busy_fraction")}
            for r in records if r.get("cpu_saturated")]


def finite_mean(xs: Sequence[float | None]) -> float:
    """The mean of the finite values (nan when there is none)."""
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else math.nan
