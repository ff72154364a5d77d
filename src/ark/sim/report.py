"""What a results file says about itself, so that it stands alone.

* :func:`fabric_facts`: the fabric's shape, rates, oversubscription, hash and transport;
* :func:`loads`: per QPS, the offered load and whether its runs were steady
  (:mod:`ark.sim.steady`);
* :func:`go_no_go`: per QPS, whether ARK pays off against ECMP: **go** when the best ARK
  policy is within :data:`NEAR` of the best deployable scheme and its change in mean FCT
  against ECMP is at least :data:`GAIN` with a paired interval over the seeds that excludes
  0; **no-go** otherwise; *provisional* when the runs were not steady or had one seed.

``results.json`` carries them under ``about`` (:func:`about`); ``results.md`` opens with
them (:func:`markdown_lines`). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ark.sim.config import ExperimentConfig
from ark.sim.engine import ARK_OFFERED
from ark.sim.stats import paired_rows
from ark.sim.steady import STEADY_SHARE, check, warning

IDEAL = "spray"  # the bound: not something a host-side operator can deploy on a RoCE fabric
BOUNDS = (IDEAL, "oracle-path")  # measured for reference, never recommended
NEAR = 0.05  # within 5% of the best deployable scheme counts as as good
GAIN = 0.03  # a change in mean FCT smaller than this is no reason to deploy anything


def fabric_facts(cfg: ExperimentConfig) -> dict[str, Any]:
    """The fabric as a reader of the results needs it: shape, rates, oversubscription, hash."""
    fab = cfg.fabric.build()
    f = cfg.fabric
    out: dict[str, Any] = {
        "tiers": fab.tiers, "gpus": fab.n_hosts, "leaves": fab.n_leaves, f"{fab.top_kind}s": fab.n_spines,
        "nic_gbps": fab.hosts[0].nic_bps / 1e9, "link_gbps": fab.link_bps / 1e9,
        "oversubscription": [round(x, 4) for x in fab.oversubscription()],
        "hash": f.hash, "selection": f.selection, "seed": "per switch" if f.seed is None else f.seed,
        "transport": f.transport, "goodput": round(fab.efficiency, 4),
        "prefill_gpus": len(fab.role_hosts("prefill")), "decode_gpus": len(fab.role_hosts("decode")),
    }
    if fab.tiers == 3:
        out["core_link_gbps"] = getattr(fab, "core_link_bps", 0.0) / 1e9
        out["agg_hash"] = f.agg_hash or f.hash
    return out


def fabric_line(cfg: ExperimentConfig) -> str:
    x = fabric_facts(cfg)
    top = "cores" if x["tiers"] == 3 else "spines"
    rates = f"links {x['link_gbps']:g} Gbit/s" + (f", core links {x['core_link_gbps']:g} Gbit/s" if x["tiers"] == 3
                                                   else "")
    over = ":".join(f"{o:g}" for o in x["oversubscription"])
    hashes = x["hash"] + (f" (aggregation tier {x['agg_hash']})" if x["tiers"] == 3 and x["agg_hash"] != x["hash"]
                          else "")
    return (f"{x['gpus']} GPUs ({x['prefill_gpus']} prefill, {x['decode_gpus']} decode), {x['leaves']} leaves, "
            f"{x[top]} {top} ({x['tiers']} tiers); NICs {x['nic_gbps']:g} Gbit/s, {rates}; oversubscription "
            f"{over}:1; ECMP hash {hashes}, {x['selection']}, seed {x['seed']}; {x['transport']} "
            f"({x['goodput']:.1%} goodput)")


def loads(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per QPS: offered load (mean over seeds) and steadiness (:func:`ark.sim.steady.check`)."""
    return [c.as_dict() for c in check(records)]


def _means(records: Sequence[dict[str, Any]], q: float) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in records:
        if r["qps"] == q:
            by.setdefault(r["scheme"], []).append(r["fct_mean_s"])
    return {s: float(np.mean(v)) for s, v in by.items()}


def _decide(q: float, means: dict[str, float], pair: dict[str, Any], steady: bool) -> dict[str, Any]:
    best_ark = min((s for s in means if s in ARK_OFFERED), key=lambda s: means[s])
    dep = [s for s in means if s not in BOUNDS]
    best = min(dep, key=lambda s: means[s])
    change, lo, hi = pair["ratio"] - 1, pair["ratio_lo"] - 1, pair["ratio_hi"] - 1
    near = means[best_ark] <= means[best] * (1 + NEAR)
    if not near:
        go, why = False, f"{best} is more than {NEAR:.0%} better"
    elif change > -GAIN:
        go, why = False, f"a gain under {GAIN:.0%}"
    elif math.isnan(hi):
        go, why = True, "one seed: no interval"
    elif hi >= 0:
        go, why = False, "its interval holds 0"
    else:
        go, why = True, f"interval excludes 0, within {NEAR:.0%} of the best deployable scheme"
    provisional = [w for w, c in (("runs not steady", not steady), ("one seed", pair["n"] < 2)) if c]
    return {"qps": q, "go": go, "scheme": best_ark, "change": change, "change_lo": lo, "change_hi": hi,
            "seeds": pair["n"], "level": pair["level"], "best_deployable": best, "why": why,
            "provisional": provisional}


def go_no_go(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per QPS with ECMP and an ARK policy among the schemes: the best ARK policy's verdict
    against ECMP (see the module docstring). Empty when ECMP or every ARK policy is missing."""
    steady = {c.qps: c.steady for c in check(records)}
    out = []
    for q in sorted({r["qps"] for r in records}):
        means = _means(records, q)
        if "ecmp" not in means or not any(s in ARK_OFFERED for s in means):
            continue
        best_ark = min((s for s in means if s in ARK_OFFERED), key=lambda s: means[s])
        sel = [r for r in records if r["qps"] == q and r["scheme"] in ("ecmp", best_ark)]
        pair = paired_rows(sel, "fct_mean_s", "ecmp", ("qps",), resamples=2000)[0]
        out.append(_decide(q, means, pair, steady[q]))
    return out


def go_line(d: dict[str, Any]) -> str:
    """``QPS 25: GO: ark-split -28.6% mean FCT against ECMP [-35.5%, -21.6%] (2 seeds; ...)``."""
    ci = "[—]" if math.isnan(d["change_lo"]) else f"[{d['change_lo']:+.1%}, {d['change_hi']:+.1%}]"
    tail = f"; provisional: {', '.join(d['provisional'])}" if d["provisional"] else ""
    return (f"QPS {d['qps']:g}: {'GO' if d['go'] else 'NO-GO'}: {d['scheme']} {d['change']:+.1%} mean FCT against "
            f"ECMP {ci} ({d['seeds']} seed{'s' if d['seeds'] != 1 else ''}, {d['level']:.0%} interval; {d['why']}){tail}")


def about(cfg: ExperimentConfig, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The header of ``results.json``: fabric, workload, loads, steadiness, go/no-go."""
    w = cfg.workload
    return {
        "fabric": fabric_facts(cfg),
        "workload": {"model": w.model, "requests_per_run": max((r["requests"] for r in records), default=0),
                     "trace": w.trace, "kv_transfer": cfg.serving.kv_transfer, "serving": cfg.serving.mode},
        "schemes": list(dict.fromkeys(r["scheme"] for r in records)), "seeds": list(cfg.seeds),
        "loads": loads(records), "steady_warning": warning(check(records)),
        "go_no_go": [{**{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()},
                      "line": go_line(d)} for d in go_no_go(records)],
    }


def markdown_lines(cfg: ExperimentConfig, records: Sequence[dict[str, Any]]) -> list[str]:
    """The opening of ``results.md``: the fabric, offered load and steadiness per QPS, go/no-go."""
    n = max((r["requests"] for r in records), default=0)
    w = cfg.workload
    src = f"trace `{w.trace}`" if w.trace else f"{w.model} (Zipf {w.theta:g} prompts)"
    lines = [f"Fabric: {fabric_line(cfg)}.", "",
             f"Workload: {src}, {n:,} requests per run, seeds {', '.join(map(str, cfg.seeds))}, KV transfer "
             f"`{cfg.serving.kv_transfer}`, serving `{cfg.serving.mode}`; figures are means over seeds.", "",
             "## Load and steady state", "",
             f"Offered load: KV bytes per second that cross leaves over the prefill leaves' uplink capacity. Edge: "
             f"the P95 time from a request's arrival to its KV cache's arrival; a run's requests within one edge of "
             f"its first or last arrival are its warm-up and drain, the rest its steady part (at least "
             f"{STEADY_SHARE:.0%} for a steady run).", "",
             "| QPS | offered load | edge (s) | steady part | steady | requests that would do |", "|---|---|---|---|---|---|"]
    for c in check(records):
        state = "yes" if c.steady else "overloaded" if c.overloaded else "no: too short"
        need = f"{c.needed:,}" if c.needed else ("none (overloaded)" if c.overloaded else "—")
        lines.append(f"| {c.qps:g} | {c.offered_load:.2f} | {c.edge_s:.1f} | {c.share:.0%} | {state} | {need} |")
    warn = warning(check(records))
    if warn:
        lines += ["", f"**Warning**: {warn}."]
    gos = go_no_go(records)
    if gos:
        lines += ["", "## Go or no-go", "",
                  f"Go: the best ARK policy is within {NEAR:.0%} of the best deployable scheme and its change in mean "
                  f"FCT against ECMP is {GAIN:.0%} or more, with a paired interval over the seeds that excludes 0.", ""]
        lines += [f"* {go_line(d)}" for d in gos]
    return lines


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{-100 * x:+.1f}%"


def results_markdown(cfg: ExperimentConfig, records: Sequence[dict[str, Any]],
                     summary: Sequence[dict[str, Any]]) -> str:
    """``ark reproduce``'s ``results.md``: the opening of :func:`markdown_lines`, then mean and
    P95 FCT and TTFT per scheme and QPS (``summary``: :func:`ark.sim.experiment.summarize`)."""
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scheme"] for r in records))}
    lines = ["# Results", "", *markdown_lines(cfg, records), "", "## FCT and TTFT per scheme", "",
             "Mean over seeds; Δ: change against ECMP at the same QPS (negative is better).", "",
             "| QPS | scheme | mean FCT (ms) | Δ | P95 FCT (ms) | Δ | mean TTFT (ms) | Δ | P95 TTFT (ms) | Δ |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary, key=lambda r: (r["qps"], order.get(r["scheme"], 99))):
        ecmp = r["scheme"] == "ecmp"
        cells = [f"{r[m] * 1e3:.0f} | {'—' if ecmp else _pct(r[m.removesuffix('_s') + '_reduction'])}"
                 for m in ("fct_mean_s", "fct_p95_s", "ttft_mean_s", "ttft_p95_s")]
        lines.append(f"| {r['qps']:g} | {r['scheme']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
