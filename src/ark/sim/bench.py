"""Benchmarks: the controller's costs and the reproduction's wall time (data, no printing)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ark.core.hashing import hash_model
from ark.core.lease import LeasePolicy
from ark.core.messages import Reserve, encode
from ark.core.pathmap import ROCE_PORT_RANGE, PathMapCache, compute_buckets
from ark.core.protocol import ArkCore
from ark.core.topology import spine_leaf
from ark.sim.config import ExperimentConfig
from ark.sim.engine import Progress

# The paper's controller costs (Intel i9, one thread), for side-by-side reporting.
PAPER = {
    "precompute_ms_per_peer": 326.0,
    "hash_ns_per_port": 4100.0,
    "lookup_us": 0.87,
    "select_us_k4": 3.48,
    "select_us_k1000": 870.0,
}


def _best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _per_call_us(fn: Callable[[], object], n: int, repeat: int = 5) -> float:
    def loop() -> None:
        for _ in range(n):
            fn()

    return _best_of(loop, repeat) / n * 1e6


def _core_with_busy(spines: int, busy: int, lease: LeasePolicy | None = None) -> tuple[ArkCore, int]:
    """A core on a 2-leaf fabric with ``spines`` paths, the first ``busy`` reserved."""
    fab = spine_leaf(leaves=2, spines=spines, gpus_per_leaf=2, hash="crc32", seed=0)
    maps = PathMapCache(fab, (0, 0xFFFF))
    core = ArkCore(0, fab, maps, policy="ark", lease=lease)
    # Host 1 (leaf 0, like host 0) holds paths 0..busy-1 towards host 3 (leaf 1); host 0
    # then asks for a path to host 2 (leaf 1), which crosses the same uplinks.
    for k in range(busy):
        core.receive(Reserve((1, k + 1), 0.0, 1, 3, 4791, k, 49152 + k, 10**9, 1e11), 0.0)
    return core, 2


def controller(hash_name: str = "murmur3-hpcc", repeat: int = 7) -> dict[str, Any]:
    """Per-peer precompute, hashing, path selection and full reserve-decision costs."""
    src, dst = "10.0.0.1", "10.0.1.1"
    pre_full = _best_of(lambda: compute_buckets(hash_name, 17, src, dst, 4791, 4, (0, 0xFFFF)), repeat)
    pre_roce = _best_of(lambda: compute_buckets(hash_name, 17, src, dst, 4791, 4, ROCE_PORT_RANGE), repeat)
    model = hash_model(hash_name)
    ports = np.arange(65536)
    vec = _best_of(lambda: model.hash_ports(17, 0x0A000001, 0x0A000101, 4791, ports), repeat)
    scalar_us = _per_call_us(lambda: model.hash_one(17, 0x0A000001, 0x0A000101, 50000, 4791), 2000)

    core4, d4 = _core_with_busy(4, 3)
    core1k, d1k = _core_with_busy(1000, 999)
    sel4 = _per_call_us(lambda: core4.select_path(d4), 20000)
    sel1k = _per_call_us(lambda: core1k.select_path(d1k), 20000)
    assert core4.select_path(d4) == 3 and core1k.select_path(d1k) == 999

    plain, leased = _decisions(None), _decisions(LeasePolicy())
    return {
        "hash": hash_name,
        "precompute_ms_per_peer": pre_full * 1e3,
        "precompute_ms_per_peer_16384": pre_roce * 1e3,
        "hash_ns_per_port": vec / 65536 * 1e9,
        "hash_one_us": scalar_us,
        "select_us_k4": sel4,
        "select_us_k1000": sel1k,
        "decision_us_p50": float(np.percentile(plain, 50)),
        "decision_us_p99": float(np.percentile(plain, 99)),
        "decision_lease_us_p50": float(np.percentile(leased, 50)),
        "decision_lease_us_p99": float(np.percentile(leased, 99)),
        "paper": PAPER,
    }


def _decisions(lease: LeasePolicy | None, n: int = 20000) -> np.ndarray:
    """Microseconds per full decision (select + port + RESERVE + wire encoding; with a
    lease policy, its expiry and the lease bookkeeping an agent has), each followed by a
    release and a tick that are not timed."""
    core, dst_host = _core_with_busy(4, 0, lease)
    samples = []
    now = 1.0
    for _ in range(n):
        t = time.perf_counter_ns()
        dec = core.request(dst_host, 10**9, now)
        for m in dec.messages:
            encode(m)
        samples.append(time.perf_counter_ns() - t)
        core.release(dec.flow, now + 5e-4)
        core.tick(now)
        now += 1e-3
    return np.asarray(samples[n // 20:]) / 1e3


SCALE_QPS = 1400.0  # offered load about 0.76 of the prefill leaves' uplinks on the scale fabric (1,024 GPUs)
GPUS_PER_POD = 128  # the scale fabric's pod: 4 leaves x 32 GPUs, 16 aggregation switches, 4 cores per plane
SCALE_PRESETS = {1024: "scale", 8192: "scale-8k"}


def scale_qps(gpus: int) -> float:
    """The arrival rate that loads ``gpus`` GPUs as QPS 1400 loads 1,024 (the same per GPU)."""
    return SCALE_QPS * gpus / 1024


def scale_config(requests: int = 100_000, qps: float | None = None, gpus: int = 1024) -> ExperimentConfig:
    """The scale benchmark: ``gpus`` GPUs on 3-tier pods of the ``scale`` fabric's shape
    (``gpus / 128`` pods of 4 leaves x 32 GPUs, 2:1 at the leaves; 1,024 GPUs: the ``scale``
    preset, 8,192: ``scale-8k``), prefill and decode pools on every pod, each request's GPUs
    drawn at random (a global scheduler), Poisson arrivals at :func:`scale_qps` unless told."""
    from ark.core.clos import CLOS_PRESETS
    from ark.core.schema import ConfigError
    from ark.sim.config import from_dict

    if gpus < GPUS_PER_POD or gpus % GPUS_PER_POD:
        raise ConfigError(f"gpus: must be a multiple of {GPUS_PER_POD} (pods of 128 GPUs); got {gpus}")
    if gpus in SCALE_PRESETS:
        fabric: dict[str, Any] = {"preset": SCALE_PRESETS[gpus]}
    else:
        fabric = {**CLOS_PRESETS["scale"], "pods": gpus // GPUS_PER_POD}
        fabric["oversubscription"] = list(fabric["oversubscription"])
    return from_dict({
        "fabric": fabric,
        "workload": {"requests": requests, "qps": [scale_qps(gpus) if qps is None else qps]},
        "serving": {"placement": "random"},
        "experiment": {"seeds": [0]},
    })


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _scale_run(args: tuple[ExperimentConfig, str, Progress | None]) -> dict[str, Any]:
    """One run in a fresh worker process: wall time, events and the process's peak memory."""
    from ark.sim.experiment import RunSpec, run_one

    cfg, scheme, progress = args
    t, cpu = time.perf_counter(), time.process_time()
    rec = run_one(cfg, RunSpec(scheme, cfg.workload.qps_list[0], cfg.seeds[0]), progress).record
    wall = time.perf_counter() - t
    return {
        "wall_s": wall,
        "cpu_s": time.process_time() - cpu,  # this process's CPU: the wall time it would take alone
        "peak_rss_mb": _peak_rss_mb(),
        "events": rec["events"],
        "events_per_s": rec["events"] / wall if wall > 0 else 0.0,
        "offered_load": rec["offered_load"],
        "flows_cross_pod": rec["flows_cross_pod"],
        "fct_mean_s": rec["fct_mean_s"],
        "fct_p95_s": rec["fct_p95_s"],
        "path_mismatches": rec["path_mismatches"],
        "fallbacks": rec["fallbacks"],
        "races": rec["races"],
    }


def _baseline_s() -> float:
    """Wall time of one fixed small run (paper fabric, ECMP, QPS 25, 1,000 requests): the
    machine's speed at the moment, to read the scale figures against."""
    from ark.sim.config import default
    from ark.sim.experiment import RunSpec, run_one

    t = time.perf_counter()
    run_one(default(), RunSpec("ecmp", 25.0, 0))
    return time.perf_counter() - t


def scale(schemes: tuple[str, ...], requests: int = 100_000, qps: float | None = None, gpus: int = 1024,
          progress: Progress | None = None) -> list[dict[str, Any]]:
    """Each scheme of the scale benchmark in its own fresh process, one after the other
    (``progress``: a picklable function the worker calls as the run goes, see :meth:`FluidSim.run`)."""
    from concurrent.futures import ProcessPoolExecutor

    cfg = scale_config(requests, qps, gpus)
    out = []
    for scheme in schemes:
        base = _baseline_s()
        with ProcessPoolExecutor(max_workers=1) as ex:
            res = ex.submit(_scale_run, (cfg, scheme, progress)).result()
        out.append({"gpus": gpus, "requests": requests, "scheme": scheme, "qps": cfg.workload.qps_list[0], **res,
                    "cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2), "baseline_s": base})
    return out


def scaling_exponents(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Least-squares slopes of log wall time, log CPU time and log peak memory: against GPUs
    at each fixed (scheme, requests), and against requests at each fixed (scheme, GPUs),
    where a series has two or more points (wall ~ x^slope). On a shared machine the CPU
    time is the steadier figure: it is the wall time the run would take alone."""
    fits = []
    for axis, fixed in (("gpus", "requests"), ("requests", "gpus")):
        for key in sorted({(r["scheme"], r[fixed]) for r in rows}):
            pts = sorted((r[axis], r["wall_s"], r["cpu_s"], r["peak_rss_mb"]) for r in rows
                         if (r["scheme"], r[fixed]) == key)
            if len({p[0] for p in pts}) < 2:
                continue
            x = np.log([p[0] for p in pts])

            def slope(i: int, pts: list[tuple[int, float, float, float]] = pts, x: np.ndarray = x) -> float:
                return float(np.polyfit(x, np.log([p[i] for p in pts]), 1)[0])

            fits.append({"scheme": key[0], "against": axis, fixed: key[1], "points": len(pts),
                         "wall_exponent": slope(1), "cpu_exponent": slope(2), "memory_exponent": slope(3)})
    return fits


def reproduce(cfg: ExperimentConfig, jobs: int) -> dict[str, Any]:
    """Wall time and simulator events per second of a whole sweep."""
    from ark.sim.experiment import plan, run_sweep

    t = time.perf_counter()
    sweep = run_sweep(cfg, jobs=jobs)
    wall = time.perf_counter() - t
    events = sum(r["events"] for r in sweep.records)
    return {
        "runs": len(plan(cfg)),
        "requests_per_run": cfg.workload.requests,
        "jobs": jobs,
        "cpus": os.cpu_count(),
        "wall_s": wall,
        "events": events,
        "events_per_s": events / wall if wall > 0 else 0.0,
    }


def compare(cfg: ExperimentConfig, jobs: int) -> dict[str, Any]:
    """Wall time of the ``ark compare`` sweep, next to the ``ark reproduce`` sweep of the same
    experiment measured just after it (the machine's speed at the moment)."""
    from ark.sim.compare import compare_config, run_compare
    from ark.sim.experiment import plan, run_sweep

    load_before = os.getloadavg()[0]
    ccfg = compare_config(cfg)
    t = time.perf_counter()
    comp = run_compare(ccfg, jobs=jobs)
    wall = time.perf_counter() - t
    t = time.perf_counter()
    run_sweep(cfg, jobs=jobs)
    base = time.perf_counter() - t
    events = sum(r["events"] for r in comp.records)
    per_scheme: dict[str, int] = {}
    for r in comp.records:
        per_scheme[r["scheme"]] = per_scheme.get(r["scheme"], 0) + r["events"]
    return {
        "runs": len(plan(ccfg)),
        "schemes": list(ccfg.schemes),
        "requests_per_run": cfg.workload.requests,
        "jobs": jobs,
        "cpus": os.cpu_count(),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "wall_s": wall,
        "events": events,
        "events_per_s": events / wall if wall > 0 else 0.0,
        "events_by_scheme": per_scheme,
        "reproduce_runs": len(plan(cfg)),
        "reproduce_wall_s": base,
        "ratio_to_reproduce": wall / base if base > 0 else 0.0,
        "target_wall_s": 60.0,
    }
