"""Sweeps of (scheme, QPS, seed) runs and their result records.

Each (QPS, seed) pair fixes one workload that every scheme sees (common random numbers),
so scheme differences are not workload noise. Records are plain dicts with a fixed key
order; ``write_results`` serialises them deterministically.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.pathmap import PathMapCache
from ark.core.topology import PATH_KINDS, Fabric
from ark.sim.config import ExperimentConfig
from ark.sim.engine import MAP_CACHE, FluidSim, Progress
from ark.sim.report import about
from ark.sim.serving import Placed
from ark.sim.steady import RUN_KEYS, run_fields
from ark.sim.workload import Request, ZipfWorkload, load_trace

RECORD_KEYS = (
    "scheme", "qps", "seed", "requests", "offered_load", "flows_same_leaf", "flows_same_pod",
    "flows_cross_pod", "fct_mean_s", "fct_p50_s", "fct_p95_s",
    "fct_p99_s", "ttft_mean_s", "ttft_p95_s", "tpot_mean_s", "max_concurrent_per_spine",
    "races", "fallbacks", "path_mismatches", "control_messages", "events", *RUN_KEYS,
)
TIMELINE_QPS = 25.0

_PATHMAPS: dict[tuple[Fabric, tuple[int, int]], PathMapCache] = {}


# Further keys of every record (results.json keeps RECORD_KEYS; ark compare writes these too).
EXTRA_KEYS = ("race_moved", "moves", "rehashes", "stale", "rebuild_repathed", "mismatches_after_rebuild",
              "control_delay_mean_s", "control_delay_max_s", "control", "arbiter_rtt_s")
PHASES = ("before", "during", "after")  # flows by start time around a link change


@dataclass(frozen=True)
class RunSpec:
    scheme: str
    qps: float
    seed: int
    record_timeline: bool = False
    keep_flows: bool = False


@dataclass
class RunOutput:
    record: dict[str, Any]
    timeline: list[tuple[float, tuple[int, ...]]] | None
    # With keep_flows: per flow (bytes, start, FCT), in flow order.
    flows: tuple[list[int], list[float], list[float]] | None = None


def _pathmaps(fabric: Fabric, port_range: tuple[int, int]) -> PathMapCache:
    # Per-process cache: path maps depend only on the fabric, never on the run.
    key = (fabric, port_range)
    c = _PATHMAPS.get(key)
    if c is None:
        c = _PATHMAPS[key] = PathMapCache(fabric, port_range, capacity=MAP_CACHE, lazy=True)
    return c


def _seed_words(seed: int, qps: float) -> list[int]:
    return [seed, round(qps * 1000)]


def workload(cfg: ExperimentConfig, qps: float, seed: int) -> list[Request]:
    w = cfg.workload
    if w.trace is not None:
        # A trace fixes arrivals; ``qps`` rescales them to that mean rate.
        reqs = load_trace(w.trace, limit=w.requests)
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        if len(reqs) > 1 and span > 0:
            scale = (len(reqs) - 1) / span / qps
            reqs = [Request(r.id, r.arrival_s * scale, r.prefill_tokens, r.decode_tokens) for r in reqs]
        return reqs
    rng = np.random.default_rng(_seed_words(seed, qps))
    return ZipfWorkload(qps, w.requests, w.theta, w.min_tokens, w.max_tokens, w.pd_ratio).generate(rng)


def place(cfg: ExperimentConfig, fabric: Fabric, qps: float, seed: int) -> list[Placed]:
    """The run's requests with their GPUs and KV flows (the simulator and the testbed share it)."""
    prefill, decode = fabric.role_hosts("prefill"), fabric.role_hosts("decode")
    serving = cfg.serving.build(cfg.workload.model).for_fabric(len({fabric.pod_of(h) for h in prefill + decode}))
    reqs = workload(cfg, qps, seed)
    place_rng = np.random.default_rng(_seed_words(seed, qps) + [1])
    return serving.place(reqs, prefill, decode, place_rng)


def path_kinds(fabric: Fabric, pairs: Sequence[tuple[int, int]]) -> dict[str, int]:
    """KV flows per path kind (same leaf, same pod, cross-pod), every kind present."""
    out = dict.fromkeys(PATH_KINDS, 0)
    for src, dst in pairs:
        out[fabric.path_kind(src, dst)] += 1
    return out


def path_kind_keys(counts: dict[str, int]) -> dict[str, int]:
    """``path_kinds`` as record keys: ``flows_same_leaf``, ``flows_same_pod``, ``flows_cross_pod``."""
    return {"flows_" + k.replace("-", "_"): v for k, v in counts.items()}


def path_kind_summary(records: Sequence[dict[str, Any]]) -> str:
    """One line: the share of KV flows per path kind, as a range over the runs' workloads
    (the records of one scheme: every scheme of a (QPS, seed) sees the same flows)."""
    first = [r for r in records if r["scheme"] == records[0]["scheme"]] if records else []
    parts = []
    for kind in PATH_KINDS:
        key = "flows_" + kind.replace("-", "_")
        shares = [100 * r[key] / max(1, r["requests"]) for r in first if key in r]
        if shares:
            lo, hi = min(shares), max(shares)
            parts.append(f"{kind} {lo:.1f}%" if lo == hi else f"{kind} {lo:.1f}-{hi:.1f}%")
    return ("KV flows by path, per run: " + ", ".join(parts) + " (same-leaf: no reservable link; same-pod: "
            "leaf, spine or aggregation switch, leaf; cross-pod: through the core)")


def offered_load(fabric: Fabric, placed: Sequence[Placed], qps: float) -> float:
    """Nominal offered load: KV bytes per second that cross leaves, over the prefill leaves'
    uplink capacity (QPS x mean KV bytes x 8 x cross-leaf share / (uplink rate x leaves));
    2-tier: the uplink rate of a leaf is link rate x spines."""
    mean_bytes = float(np.mean([p.kv_bytes for p in placed]))
    cross = sum(fabric.n_paths(p.prefill_gpu, p.decode_gpu) > 1 for p in placed) / len(placed)
    leaves_up = {fabric.hosts[p.prefill_gpu].leaf for p in placed}
    up_bps = sum(fabric.uplink_bps(a) for a in leaves_up) / len(leaves_up)
    return qps * mean_bytes * 8 * cross / (up_bps * max(1, len(leaves_up)))


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else math.nan


def run_one(cfg: ExperimentConfig, spec: RunSpec, progress: Progress | None = None) -> RunOutput:
    """Simulate one (scheme, QPS, seed) and summarise it as a record (``progress``: see
    :meth:`FluidSim.run`)."""
    fabric = cfg.fabric.build()
    serving = cfg.serving.build(cfg.workload.model)
    placed = place(cfg, fabric, spec.qps, spec.seed)
    flows = [FlowSpec(i, p.prefill_gpu, p.decode_gpu, p.kv_bytes, p.kv_start_s) for i, p in enumerate(placed)]
    net = cfg.network
    sim = FluidSim(
        fabric,
        spec.scheme,
        seed=int(np.random.SeedSequence(_seed_words(spec.seed, spec.qps) + [2]).generate_state(1)[0]),
        control_delay_s=net.control_delay_us * 1e-6,
        control_jitter_s=net.control_jitter_us * 1e-6,
        dport=net.dport,
        port_range=net.source_ports,
        pathmaps=_pathmaps(fabric, net.source_ports),
        record_timeline=spec.record_timeline,
        params=cfg.params,
        chunks=cfg.serving.chunks(cfg.workload.model),
        chunk_gap_s=cfg.serving.layer_gap_us * 1e-6,
        change=cfg.failure,
        clock_skew_s=net.clock_skew_us * 1e-6,
        control_on_data=net.control_path == "data-fabric",
        data_queue_bytes=net.data_queue_kb * 1e3,
        control=net.control,
        arbiter_rtt_s=net.arbiter_rtt_us / 1e6,  # 200 us reads 0.0002 s in the records
    )
    res = sim.run(flows, progress)
    fcts = [f.fct_s for f in res.flows]
    timing = serving.timings(placed, fcts)
    fct = np.asarray(fcts)
    ttft = np.asarray([t.ttft_s for t in timing])
    tpot = np.asarray([t.tpot_s for t in timing])
    load = offered_load(fabric, placed, spec.qps)
    record = {
        "scheme": spec.scheme,
        "qps": spec.qps,
        "seed": spec.seed,
        "requests": len(placed),
        "offered_load": round(load, 6),
        **path_kind_keys(path_kinds(fabric, [(f.src, f.dst) for f in flows])),
        "fct_mean_s": float(fct.mean()),
        "fct_p50_s": _pct(fct, 50),
        "fct_p95_s": _pct(fct, 95),
        "fct_p99_s": _pct(fct, 99),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p95_s": _pct(ttft, 95),
        "tpot_mean_s": float(tpot.mean()),
        "max_concurrent_per_spine": list(res.max_concurrent_per_spine),
        "races": res.races,
        "fallbacks": res.fallbacks,
        "path_mismatches": res.path_mismatches,
        "control_messages": res.control_messages,
        "events": res.events,
        **{k: getattr(res, k) for k in EXTRA_KEYS},
        **run_fields([p.request.arrival_s for p in placed], [p.kv_start_s for p in placed], fcts),
    }
    if cfg.failure is not None:
        record.update(phase_fcts(cfg.failure.at_s, cfg.failure.window_s, [f.start_s for f in flows], fcts))
    kept = ([f.nbytes for f in flows], [f.start_s for f in flows], fcts) if spec.keep_flows else None
    return RunOutput(record, res.spine_timeline if spec.record_timeline else None, kept)


def phase_fcts(at: float, window: float, starts: Sequence[float], fcts: Sequence[float]) -> dict[str, Any]:
    """Mean FCT and count of the flows that start before ``at - window``, within ``window``
    of ``at`` (during the change) and after ``at + window``: the same flows for every scheme."""
    out: dict[str, Any] = {}
    for name, lo, hi in (("before", -math.inf, at - window), ("during", at - window, at + window),
                         ("after", at + window, math.inf)):
        sel = [f for s, f in zip(starts, fcts, strict=True) if lo <= s < hi]
        out[f"fct_{name}_s"] = float(np.mean(sel)) if sel else math.nan
        out[f"flows_{name}"] = len(sel)
    return out


def plan(cfg: ExperimentConfig, keep_flows: bool = False) -> list[RunSpec]:
    """Every run of a sweep; the timeline is recorded at QPS 25 (or the nearest QPS)."""
    qs = cfg.workload.qps_list
    tq = min(qs, key=lambda q: (abs(q - TIMELINE_QPS), q))
    specs = []
    for q in qs:
        for s in cfg.schemes:
            for i, seed in enumerate(cfg.seeds):
                specs.append(RunSpec(s, q, seed, record_timeline=(q == tq and i == 0), keep_flows=keep_flows))
    return specs


def _run_task(args: tuple[ExperimentConfig, RunSpec]) -> RunOutput:
    return run_one(*args)


def run_tasks(
    tasks: Sequence[tuple[ExperimentConfig, RunSpec]], jobs: int = 1, progress: Callable[[RunSpec], None] | None = None,
) -> list[RunOutput]:
    """Runs of possibly different experiments, on a pool of ``jobs`` processes; the outputs
    in the order of ``tasks`` (so results do not depend on ``jobs``)."""
    outs: list[RunOutput | None] = [None] * len(tasks)
    if jobs <= 1:
        for i, t in enumerate(tasks):
            outs[i] = run_one(*t)
            if progress is not None:
                progress(t[1])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            order = sorted(range(len(tasks)), key=lambda i: -tasks[i][1].qps)
            futs = {ex.submit(_run_task, tasks[i]): i for i in order}
            for fut in as_completed(futs):
                outs[futs[fut]] = fut.result()
                if progress is not None:
                    progress(tasks[futs[fut]][1])
    done = [o for o in outs if o is not None]
    assert len(done) == len(tasks)  # every task has its output
    return done


FlowKey = tuple[str, float, int]  # (scheme, qps, seed)


@dataclass
class Sweep:
    records: list[dict[str, Any]]
    timelines: dict[str, list[tuple[float, tuple[int, ...]]]]
    timeline_qps: float | None
    flows: dict[FlowKey, tuple[list[int], list[float], list[float]]] = field(default_factory=dict)


def run_sweep(
    cfg: ExperimentConfig,
    jobs: int = 1,
    progress: Callable[[RunSpec], None] | None = None,
    keep_flows: bool = False,
) -> Sweep:
    specs = plan(cfg, keep_flows)
    outs = dict(zip(specs, run_tasks([(cfg, sp) for sp in specs], jobs, progress), strict=True))
    records = [outs[sp].record for sp in specs]
    timelines: dict[str, list[tuple[float, tuple[int, ...]]]] = {}
    tq = None
    for sp in specs:
        tl = outs[sp].timeline
        if tl is not None:
            timelines[sp.scheme] = tl
            tq = sp.qps
    flows = {(sp.scheme, sp.qps, sp.seed): f for sp in specs if (f := outs[sp].flows) is not None}
    return Sweep(records, timelines, tq, flows)


# ---------------------------------------------------------------------------------------
# Summaries and files
# ---------------------------------------------------------------------------------------
SUMMARY_METRICS = ("fct_mean_s", "fct_p95_s", "ttft_mean_s", "ttft_p95_s")


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds per (QPS, scheme), with the reduction versus ECMP (fraction)."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["qps"], r["scheme"]), []).append(r)
    out = []
    for (q, s), rs in groups.items():
        row: dict[str, Any] = {"qps": q, "scheme": s, "seeds": len(rs)}
        for m in SUMMARY_METRICS:
            row[m] = float(np.mean([r[m] for r in rs]))
        row["max_concurrent_per_spine"] = [
            max(r["max_concurrent_per_spine"][k] for r in rs) for k in range(len(rs[0]["max_concurrent_per_spine"]))
        ]
        row["races"] = int(sum(r["races"] for r in rs))
        row["fallbacks"] = int(sum(r["fallbacks"] for r in rs))
        row["path_mismatches"] = int(sum(r["path_mismatches"] for r in rs))
        out.append(row)
    base = {(r["qps"]): r for r in out if r["scheme"] == "ecmp"}
    for row in out:
        b = base.get(row["qps"])
        for m in SUMMARY_METRICS:
            key = m.replace("_s", "") + "_reduction"
            row[key] = None if b is None or b[m] == 0 else 1.0 - row[m] / b[m]
    return out


def write_results(out_dir: str | Path, sweep: Sweep, cfg: ExperimentConfig) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recs = [{k: r[k] for k in RECORD_KEYS} for r in sweep.records]
    paths = [out / "results.json", out / "results.csv"]
    paths[0].write_text(json.dumps({"about": about(cfg, sweep.records), "records": recs}, indent=1) + "\n")
    with paths[1].open("w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(RECORD_KEYS)
        for r in recs:
            wr.writerow(
                [";".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in RECORD_KEYS]
            )
    if sweep.timelines:
        p = out / "spine_concurrency.json"
        p.write_text(
            json.dumps(
                {"qps": sweep.timeline_qps, "seed": cfg.seeds[0],
                 "timelines": {s: [[t, list(c)] for t, c in tl] for s, tl in sweep.timelines.items()}},
            )
            + "\n"
        )
        paths.append(p)
    return paths
