"""``ark compare``: every scheme an operator could run, on the same workloads.

:func:`run_compare` runs the experiment's sweep for :data:`COMPARED` (or a chosen subset),
keeping every flow's size and FCT; the rest turns the records into what an operator reads:
mean FCT against the ideal spray and against ECMP (:func:`fct_table`), the scheme to run at
each load (:func:`decisions`), FCT before, during and after a link change
(:func:`failure_table`), slowdown against flow size (:func:`slowdown`) and the one-page
``results.md`` (:func:`markdown`); :func:`paired_table` gives each scheme's mean FCT against
ECMP and spray with a paired bootstrap interval over the seeds. Nothing here prints or plots
(``ark.cli.compare`` does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ark.sim.balancers import TWO_TIER_ONLY
from ark.sim.config import ExperimentConfig
from ark.sim.engine import ARK_OFFERED, ARK_SCHEMES
from ark.sim.experiment import (
    EXTRA_KEYS,
    PHASES,
    RECORD_KEYS,
    RunSpec,
    Sweep,
    path_kind_summary,
    run_sweep,
    summarize,
    write_results,
)
from ark.sim.report import BOUNDS, IDEAL, NEAR, markdown_lines
from ark.sim.stats import paired_rows

COMPARED = ("ecmp", "plb", "letflow", "conga", "hedera", "ecmp-split", "ark", "ark-balance", "ark-split",
            "oracle-path", "spray")
DETAIL_QPS = 25.0  # slowdown against size is drawn at the sweep's QPS nearest this
PAIRED_AGAINST = ("ecmp", IDEAL)  # the deployed default and the bound
PAIRED_METRIC = "fct_mean_s"


@dataclass
class Comparison:
    cfg: ExperimentConfig
    sweep: Sweep

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.sweep.records

    @cached_property
    def summary(self) -> list[dict[str, Any]]:
        """:func:`fct_table` of the records."""
        return fct_table(self.records)

    @cached_property
    def decisions(self) -> list[dict[str, Any]]:
        return decisions(self.summary)

    @cached_property
    def failure(self) -> list[dict[str, Any]]:
        """:func:`failure_table` of the records."""
        return failure_table(self.records)

    @cached_property
    def paired(self) -> list[dict[str, Any]]:
        """:func:`paired_table` of the records."""
        return paired_table(self.records)


def compare_config(cfg: ExperimentConfig, schemes: Sequence[str] | None = None) -> ExperimentConfig:
    """The experiment with the compared schemes (unless given, all of :data:`COMPARED` the
    fabric can run: the leaf-local ones only on 2 tiers)."""
    runnable = tuple(s for s in COMPARED if not (cfg.fabric.three_tier and s in TWO_TIER_ONLY))
    return cfg.with_overrides(schemes=tuple(schemes or runnable))


def run_compare(cfg: ExperimentConfig, jobs: int = 1, progress: Callable[[RunSpec], None] | None = None) -> Comparison:
    return Comparison(cfg, run_sweep(cfg, jobs=jobs, progress=progress, keep_flows=True))


def _mean(xs: Sequence[float]) -> float:
    vals = [x for x in xs if not math.isnan(x)]
    return float(np.mean(vals)) if vals else math.nan


def fct_table(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (QPS, scheme): the seeds' mean of mean / P95 / P99 FCT, the ratio to the ideal
    spray and the change against ECMP (negative is better)."""
    rows = summarize(records)
    by: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault((r["qps"], r["scheme"]), []).append(r)
    spray = {r["qps"]: r["fct_mean_s"] for r in rows if r["scheme"] == IDEAL}
    for row in rows:
        rs = by[(row["qps"], row["scheme"])]
        row["fct_p99_s"] = _mean([r["fct_p99_s"] for r in rs])
        s = spray.get(row["qps"])
        row["x_spray"] = row["fct_mean_s"] / s if s else math.nan
        red = row.get("fct_mean_reduction")
        row["vs_ecmp"] = math.nan if red is None else -red
    return rows


def decisions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per QPS: the deployable scheme with the lowest mean FCT, every scheme within
    :data:`NEAR` of it, and the best ARK policy and best other scheme against spray."""
    out = []
    for q in sorted({r["qps"] for r in rows}):
        at = sorted((r for r in rows if r["qps"] == q and r["scheme"] not in BOUNDS), key=lambda r: r["fct_mean_s"])
        if not at:
            continue
        best = at[0]
        ark = [r for r in at if r["scheme"] in ARK_OFFERED]
        other = [r for r in at if r["scheme"] not in ARK_OFFERED]
        out.append({
            "qps": q,
            "best": best["scheme"],
            "best_fct_s": best["fct_mean_s"],
            "as_good": [r["scheme"] for r in at if r["fct_mean_s"] <= best["fct_mean_s"] * (1 + NEAR)],
            "best_ark": ark[0]["scheme"] if ark else None,
            "best_ark_x_spray": ark[0]["x_spray"] if ark else math.nan,
            "best_ark_vs_ecmp": ark[0]["vs_ecmp"] if ark else math.nan,
            "best_other": other[0]["scheme"] if other else None,
            "best_other_x_spray": other[0]["x_spray"] if other else math.nan,
        })
    return out


def failure_table(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (QPS, scheme) of a run with a link change: mean FCT of the flows that started
    before, during and after it, and what ARK's map rebuild did."""
    by: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in records:
        if "fct_during_s" in r:
            by.setdefault((r["qps"], r["scheme"]), []).append(r)
    out = []
    for (q, s), rs in by.items():
        row: dict[str, Any] = {"qps": q, "scheme": s}
        for ph in PHASES:
            row[f"fct_{ph}_s"] = _mean([r[f"fct_{ph}_s"] for r in rs])
            row[f"flows_{ph}"] = int(sum(r[f"flows_{ph}"] for r in rs))
        for k in ("stale", "rebuild_repathed", "mismatches_after_rebuild", "path_mismatches"):
            row[k] = int(sum(r[k] for r in rs))
        out.append(row)
    return out


def paired_table(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scheme against ECMP and against spray (those of the two that ran), per QPS, on
    mean FCT, paired over the run's seeds (:func:`ark.sim.stats.paired_rows`): ordered by
    baseline, QPS, then the schemes' run order."""
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scheme"] for r in records))}
    rows = [r for b in PAIRED_AGAINST if b in order for r in paired_rows(records, PAIRED_METRIC, b, ("qps",))]
    return sorted(rows, key=lambda r: (PAIRED_AGAINST.index(r["baseline"]), r["qps"], order[r["scheme"]]))


def paired_cells(row: dict[str, Any]) -> tuple[str, str]:
    """A :func:`paired_table` row's mean difference (ms) and ratio, each with its interval."""
    def ci(lo: float, hi: float, f: str) -> str:
        return "[—]" if math.isnan(lo) else f"[{lo:{f}}, {hi:{f}}]"  # nan: one seed

    d = f"{row['diff_mean'] * 1e3:+.1f} {ci(row['diff_lo'] * 1e3, row['diff_hi'] * 1e3, '+.1f')}"
    return d, f"{row['ratio']:.3f} {ci(row['ratio_lo'], row['ratio_hi'], '.3f')}"


def slowdown(sweep: Sweep, nic_bytes_per_s: float, qps: float, bins: int = 8) -> list[dict[str, Any]]:
    """Mean FCT over the ideal (size / NIC goodput) per flow-size bin, per scheme at ``qps``."""
    sizes = [s for (_, q, _), (b, _, _) in sweep.flows.items() if q == qps for s in b]
    if not sizes:
        return []
    edges = np.geomspace(min(sizes), max(sizes) * (1 + 1e-9), bins + 1)
    out = []
    for scheme in dict.fromkeys(k[0] for k in sweep.flows):
        b = np.concatenate([np.asarray(v[0], float) for k, v in sweep.flows.items() if k[0] == scheme and k[1] == qps])
        f = np.concatenate([np.asarray(v[2], float) for k, v in sweep.flows.items() if k[0] == scheme and k[1] == qps])
        idx = np.clip(np.searchsorted(edges, b, side="right") - 1, 0, bins - 1)
        for i in range(bins):
            sel = idx == i
            if sel.any():
                out.append({"scheme": scheme, "qps": qps, "size_lo": float(edges[i]), "size_hi": float(edges[i + 1]),
                            "flows": int(sel.sum()),
                            "slowdown": float(np.mean(f[sel] / (b[sel] / nic_bytes_per_s)))})
    return out


def detail_qps(cfg: ExperimentConfig) -> float:
    return min(cfg.workload.qps_list, key=lambda q: (abs(q - DETAIL_QPS), q))


def write_compare(out_dir: str | Path, comp: Comparison) -> list[Path]:
    """results.json / results.csv (the usual records), compare.json (every record key and
    the derived tables) and results.md."""
    out = Path(out_dir)
    paths = write_results(out, comp.sweep, comp.cfg)
    full = [{k: r[k] for k in (*RECORD_KEYS, *EXTRA_KEYS, *_phase_keys(r))} for r in comp.records]
    p = out / "compare.json"
    p.write_text(json.dumps({"records": full, "summary": comp.summary, "decisions": comp.decisions,
                             "failure": comp.failure, "paired": comp.paired}, indent=1) + "\n")
    md = out / "results.md"
    md.write_text(markdown(comp))
    return [*paths, p, md]


def _phase_keys(r: dict[str, Any]) -> list[str]:
    return [k for ph in PHASES for k in (f"fct_{ph}_s", f"flows_{ph}") if k in r]


def _ms(x: float) -> str:
    return "—" if math.isnan(x) else f"{x * 1e3:.0f}"


def markdown(comp: Comparison) -> str:
    """The one-page summary: FCT per scheme and load, the decision table, the link change."""
    cfg, rows = comp.cfg, comp.summary
    schemes = list(dict.fromkeys(r["scheme"] for r in comp.records))
    qs = sorted({r["qps"] for r in rows})
    cell = {(r["qps"], r["scheme"]): r for r in rows}
    lines = [
        "# Scheme comparison", "", *markdown_lines(cfg, comp.records), "",
        path_kind_summary(comp.records) + ".", "",
        "## Mean FCT (ms) and ratio to the ideal spray", "",
        "| scheme | " + " | ".join(f"QPS {q:g}" for q in qs) + " |", "|---" * (len(qs) + 1) + "|",
    ]
    for s in schemes:  # a row per scheme: eleven schemes would not fit a page as columns
        lines.append(f"| {s} | " + " | ".join(
            f"{_ms(cell[(q, s)]['fct_mean_s'])} ({cell[(q, s)]['x_spray']:.2f}x)" if (q, s) in cell else "—"
            for q in qs) + " |")
    lines += ["", "## Which scheme at which load", "",
              f"Best deployable scheme (lowest mean FCT; `{IDEAL}` and `oracle-path` are bounds, not deployable), "
              "the schemes within "
              f"{NEAR:.0%} of it, and the best ARK policy and best other scheme against the bound.", "",
              "| QPS | best | as good (within 5%) | best ARK policy | x spray | vs ECMP | best other | x spray |",
              "|---|---|---|---|---|---|---|---|"]
    for d in comp.decisions:
        lines.append(f"| {d['qps']:g} | {d['best']} ({_ms(d['best_fct_s'])} ms) | {', '.join(d['as_good'])} | "
                     f"{d['best_ark'] or '—'} | {d['best_ark_x_spray']:.2f} | {100 * d['best_ark_vs_ecmp']:+.1f}% | "
                     f"{d['best_other'] or '—'} | {d['best_other_x_spray']:.2f} |")
    lines += _failure_lines(comp)
    lines += _paired_lines(comp.paired)
    return "\n".join(lines) + "\n"


def _failure_lines(comp: Comparison) -> list[str]:
    ch, table = comp.cfg.failure, comp.failure
    if ch is None or not table:
        return []
    lines = ["", f"## Link change: {ch.label()}", "",
             f"Flows by start time: before ({ch.at_s - ch.window_s:g} s), during (within {ch.window_s:g} s of the "
             f"change), after; ARK rebuilds its maps {ch.detect_s:g} s after a failure.", "",
             "| QPS | scheme | before (ms) | during (ms) | after (ms) | ARK sub-flows left stale | re-reserved "
             "| mismatches after rebuild |", "|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scheme"] for r in comp.records))}
    for r in sorted(table, key=lambda r: (r["qps"], order[r["scheme"]])):
        ark = r["scheme"] in ARK_SCHEMES
        lines.append(f"| {r['qps']:g} | {r['scheme']} | {_ms(r['fct_before_s'])} | {_ms(r['fct_during_s'])} | "
                     f"{_ms(r['fct_after_s'])} | {r['stale'] if ark else '—'} | "
                     f"{r['rebuild_repathed'] if ark else '—'} | {r['mismatches_after_rebuild'] if ark else '—'} |")
    return lines


def _paired_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Mean FCT against ECMP and spray, paired over seeds", ""]
    if max(r["n"] for r in rows) < 2:
        return [*lines, "One seed: no interval (`--seeds N`; about 10 seeds or more for a useful one)."]
    lines += [f"Per seed, the scheme's mean FCT minus the baseline's on the same workload; the mean of those "
              f"differences and the ratio of the means, each with a {rows[0]['level']:.0%} percentile bootstrap "
              "interval over the seeds. A verdict is the change with the ratio's interval where the difference's "
              "interval excludes 0. With few seeds the interval is too narrow: with 3 it is about the range of the "
              "per-seed differences and holds the true difference about 3 times in 4 (docs/simulator.md).", "",
              "| QPS | scheme | against | seeds | Δ mean FCT (ms) [CI] | ratio [CI] | verdict |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        d, ratio = paired_cells(r)
        lines.append(f"| {r['qps']:g} | {r['scheme']} | {r['baseline']} | {r['n']} | {d} | {ratio} | {r['verdict']} |")
    return lines
