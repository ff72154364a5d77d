"""The race window: how slow, jittery or skewed the control plane can be before ARK's gain goes.

Two hosts that reserve inside each other's delivery window may take the same path; the
smaller key keeps it and the other flow is re-pathed (a *race*). :func:`race_config` puts
the prefill GPUs on three leaves (24 hosts) and the decode GPUs on a fourth, so every flow
competes for the same four spine-to-leaf downlinks and 24 replicas decide concurrently
(the decode leaf's downlinks carry the paper fabric's load: 0.86 at QPS 25).
:func:`race_points` sweeps the one-way control delay (1 us to 1 s, shared table), jitter,
clock skew between hosts and control messages on the data fabric (each host its own
replica and clock), and, beside them, the request round trip to one arbiter that decides
for every host (``[network] control = "arbiter"``: no replica, no race, each flow waits
the round trip for its grant); :func:`run_race_window` runs ECMP once per seed and each
ARK scheme at every point, and reports per point the races and flows moved per 1,000
flows, the FCT against a zero-delay broadcast control plane and ARK's gain over ECMP;
:func:`halving_delay` finds the delay at which that gain is half its zero-delay value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import numpy as np

from ark.sim.config import ExperimentConfig, from_dict
from ark.sim.experiment import RunSpec, run_tasks

RACE_QPS = 25.0
RACE_SCHEMES = ("ark", "ark-split")
DELAYS_US = (1, 10, 100, 1000, 10_000, 30_000, 100_000, 300_000, 1_000_000)
JITTERS_US = (100, 1000, 10_000)
SKEWS_US = (10, 100, 1000, 10_000)
QUEUES_KB = (100, 1000, 10_000)
ARBITER_RTTS_US = (0, 50, 200, 1000, 5000)  # request round trips host -> arbiter -> host
BASE_DELAY_US = 20.0  # jitter, skew and in-band points start from the default delay


@dataclass(frozen=True)
class RacePoint:
    """One control plane: broadcast with its one-way delay, jitter, skew and where control
    messages travel, or one arbiter with its request round trip."""

    sweep: str  # "delay", "jitter", "skew", "data-fabric", "arbiter" or "reference"
    delay_us: float
    jitter_us: float = 0.0
    skew_us: float = 0.0
    control_path: str = "separate"
    queue_kb: float = 0.0
    control: str = "broadcast"  # or "arbiter"
    rtt_us: float = 0.0  # the arbiter's request round trip

    def network(self) -> dict[str, Any]:
        net: dict[str, Any] = {"control_delay_us": self.delay_us, "control_jitter_us": self.jitter_us,
                               "clock_skew_us": self.skew_us, "control_path": self.control_path,
                               "control": self.control, "arbiter_rtt_us": self.rtt_us}
        if self.control_path == "data-fabric":
            net["data_queue_kb"] = self.queue_kb
        return net


def race_config(requests: int = 1000, seeds: int | Sequence[int] = 3, qps: float = RACE_QPS,
                base: ExperimentConfig | None = None) -> ExperimentConfig:
    """Four leaves, four spines, 8 GPUs per leaf: prefill on leaves 0-2, decode on leaf 3
    (or ``base``'s fabric and settings when given), at one QPS."""
    d = msgspec.to_builtins(base) if base is not None else {
        "fabric": {"leaves": 4, "spines": 4, "gpus_per_leaf": 8, "prefill_leaves": [0, 1, 2], "decode_leaves": [3]}}
    d.setdefault("workload", {}).update({"requests": requests, "qps": [qps]})
    d.setdefault("experiment", {})["seeds"] = seeds if isinstance(seeds, int) else list(seeds)
    return from_dict(d)


def race_points(delays: Sequence[float] = DELAYS_US, jitters: Sequence[float] = JITTERS_US,
                skews: Sequence[float] = SKEWS_US, queues: Sequence[float] = QUEUES_KB,
                rtts: Sequence[float] = ARBITER_RTTS_US) -> list[RacePoint]:
    """The zero-delay reference, then each sweep (jitter, skew, in-band from 20 us), then
    the arbiter's round trips (its one-way delay field unused: 0)."""
    pts = [RacePoint("reference", 0.0)]
    pts += [RacePoint("delay", float(d)) for d in delays]
    pts += [RacePoint("jitter", BASE_DELAY_US, jitter_us=float(j)) for j in jitters]
    pts += [RacePoint("skew", BASE_DELAY_US, skew_us=float(s)) for s in skews]
    pts += [RacePoint("data-fabric", BASE_DELAY_US, control_path="data-fabric", queue_kb=float(q)) for q in queues]
    pts += [RacePoint("arbiter", 0.0, control="arbiter", rtt_us=float(r)) for r in rtts]
    return pts


def _with_network(cfg: ExperimentConfig, net: dict[str, Any]) -> ExperimentConfig:
    d = msgspec.to_builtins(cfg)
    d["network"].update(net)
    return from_dict(d)


def run_race_window(cfg: ExperimentConfig, points: Sequence[RacePoint], schemes: Sequence[str] = RACE_SCHEMES,
                    jobs: int = 1, progress: Callable[[RunSpec], None] | None = None) -> list[dict[str, Any]]:
    """One row per (point, scheme), plus ECMP's (the control plane does not touch it)."""
    qps = cfg.workload.qps_list[0]
    tasks = [(cfg, RunSpec("ecmp", qps, s)) for s in cfg.seeds]
    keys: list[tuple[RacePoint | None, str]] = [(None, "ecmp")] * len(cfg.seeds)
    for p in points:
        pc = _with_network(cfg, p.network())
        for scheme in schemes:
            tasks += [(pc, RunSpec(scheme, qps, s)) for s in cfg.seeds]
            keys += [(p, scheme)] * len(cfg.seeds)
    outs = run_tasks(tasks, jobs, progress)
    groups: dict[tuple[RacePoint | None, str], list[dict[str, Any]]] = {}
    for key, out in zip(keys, outs, strict=True):
        groups.setdefault(key, []).append(out.record)
    return _rows(groups, schemes)


def _rows(groups: dict[tuple[RacePoint | None, str], list[dict[str, Any]]], schemes: Sequence[str]) -> list[dict[str, Any]]:
    ecmp = float(np.mean([r["fct_mean_s"] for r in groups[(None, "ecmp")]]))
    rows = [{"sweep": "ecmp", "scheme": "ecmp", "fct_mean_s": ecmp}]
    ref = {s: float(np.mean([r["fct_mean_s"] for r in rs])) for (p, s), rs in groups.items()
           if p is not None and p.sweep == "reference"}
    for (p, s), rs in groups.items():
        if p is None:
            continue
        flows = sum(r["requests"] for r in rs)
        fct = float(np.mean([r["fct_mean_s"] for r in rs]))
        rows.append({**asdict(p), "scheme": s, "fct_mean_s": fct,
                     "fct_p95_s": float(np.mean([r["fct_p95_s"] for r in rs])),
                     "races_per_1000": 1000.0 * sum(r["races"] for r in rs) / flows,
                     "moved_per_1000": 1000.0 * sum(r["race_moved"] for r in rs) / flows,
                     "mismatches": int(sum(r["path_mismatches"] for r in rs)),
                     "control_delay_mean_us": 1e6 * float(np.mean([r["control_delay_mean_s"] for r in rs])),
                     "control_delay_max_us": 1e6 * max(r["control_delay_max_s"] for r in rs),
                     "fct_change": fct / ref[s] - 1.0, "gain_vs_ecmp": 1.0 - fct / ecmp})
    return rows


def halving_delay(rows: Sequence[dict[str, Any]], scheme: str) -> float | None:
    """The one-way delay (us) at which ``scheme``'s gain over ECMP is half its zero-delay
    gain, interpolated in log(delay) between the two sweep points around it; None when the
    gain stays above half over the whole sweep, or when there is no gain to halve."""
    ref = next(r for r in rows if r["scheme"] == scheme and r["sweep"] == "reference")
    if not ref["gain_vs_ecmp"] > 0:
        return None
    half = ref["gain_vs_ecmp"] / 2
    pts = sorted((r["delay_us"], r["gain_vs_ecmp"]) for r in rows if r["scheme"] == scheme and r["sweep"] == "delay")
    prev: tuple[float, float] | None = None
    for d, g in pts:
        if g <= half:
            if prev is None or prev[1] == g:
                return d
            (d0, g0) = prev
            frac = (g0 - half) / (g0 - g)
            return float(math.exp(math.log(d0) + frac * (math.log(d) - math.log(d0))))
        prev = (d, g)
    return None


def placement(cfg: ExperimentConfig) -> str:
    """Where the sweep's prefill and decode GPUs sit, in words."""
    fab = cfg.fabric.build()

    def where(role: str) -> str:
        hosts = fab.role_hosts(role)
        leaves = sorted({fab.leaf_of(h) for h in hosts})
        return f"{len(hosts)} {role} GPUs on {'leaves' if len(leaves) > 1 else 'leaf'} {', '.join(map(str, leaves))}"

    return f"{where('prefill')}; {where('decode')}"


def markdown(rows: Sequence[dict[str, Any]], schemes: Sequence[str], cfg: ExperimentConfig) -> str:
    """The race-window table, one section per sweep, and each scheme's halving delay."""
    ecmp = next(r for r in rows if r["scheme"] == "ecmp")["fct_mean_s"]
    lines = ["# Race window", "",
             f"{placement(cfg)}; QPS {cfg.workload.qps_list[0]:g}, "
             f"{cfg.workload.requests} requests per run, seeds {', '.join(map(str, cfg.seeds))}; ECMP mean FCT "
             f"{ecmp * 1e3:.0f} ms. Races and moved flows per 1,000 flows; FCT change against a zero-delay "
             "broadcast control plane; gain = ARK's mean-FCT reduction against ECMP. Arbiter rows: one arbiter "
             "decides for every host, each flow starts a request round trip (RTT) after it arrives.", "",
             "| sweep | delay (us) | jitter (us) | skew (us) | queue (kB) | arbiter RTT (us) | scheme | races / 1000 "
             "| moved / 1000 | mean FCT (ms) | vs zero delay | gain vs ECMP |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["scheme"] == "ecmp":
            continue
        q = f"{r['queue_kb']:g}" if r["control_path"] == "data-fabric" else "—"
        arb = r["control"] == "arbiter"
        delay, rtt = ("—", f"{r['rtt_us']:g}") if arb else (f"{r['delay_us']:g}", "—")
        lines.append(f"| {r['sweep']} | {delay} | {r['jitter_us']:g} | {r['skew_us']:g} | {q} | {rtt} | "
                     f"{r['scheme']} | {r['races_per_1000']:.1f} | {r['moved_per_1000']:.1f} | "
                     f"{r['fct_mean_s'] * 1e3:.0f} | {100 * r['fct_change']:+.1f}% | {100 * r['gain_vs_ecmp']:+.1f}% |")
    lines.append("")
    for s in schemes:
        h = halving_delay(rows, s)
        lines.append(f"* `{s}`: gain over ECMP halves at a one-way delay of "
                     + ("more than the sweep's largest" if h is None else f"{h / 1e3:,.1f} ms") + ".")
    return "\n".join(lines) + "\n"
