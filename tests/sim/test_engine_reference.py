"""The engine's figures on small fixed runs, against figures kept from an earlier engine.

A rewrite of the event loop, the fair-share kernel, the path maps or the control planes
must leave every run's results as they were: the integers (events, races, fallbacks,
path mismatches, messages, per-spine concurrency, moves) exactly, the floats (FCT and
TTFT statistics) within ``REL``. ``REL`` is 1e-9 relative: float sums taken in another
order differ by a few ulps (about 1e-16 relative) per operation, and a flow's completion
time goes through at most a few thousand rate changes in these runs, so rounding alone
stays below 1e-12; a changed decision (one event reordered, one path chosen otherwise)
moves a mean FCT by far more than 1e-6.

The figures live in ``data/engine_reference.json``. ``python tests/sim/test_engine_reference.py
--write`` rewrites them from the engine installed, which is done only when a change is
meant to change results (and then the change says why).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from ark.sim.config import from_dict
from ark.sim.experiment import RunSpec, run_one

DATA = Path(__file__).with_name("data") / "engine_reference.json"
REL = 1e-9
FLOATS = ("fct_mean_s", "fct_p50_s", "fct_p95_s", "fct_p99_s", "ttft_mean_s", "ttft_p95_s", "control_delay_mean_s",
          "control_delay_max_s")
INTS = ("races", "fallbacks", "path_mismatches", "control_messages", "events", "max_concurrent_per_spine",
        "race_moved", "moves", "rehashes", "stale", "rebuild_repathed", "mismatches_after_rebuild")
ALL_2TIER = ("ecmp", "ark", "ark-balance", "ark-split", "ecmp-split", "spray", "plb", "letflow", "conga", "hedera",
             "oracle-path")
ARK = ("ark", "ark-balance", "ark-split")

# name -> (config overrides, schemes, QPS, seed). Placement is pinned on every fabric: the
# figures must not move when a default placement does.
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...], float, int]] = {
    "paper": ({"workload": {"requests": 250}}, ALL_2TIER, 25.0, 0),
    "paper-q30": ({"workload": {"requests": 200}}, ("ecmp", "ark", "ark-balance", "spray"), 30.0, 1),
    "paper-arbiter": ({"workload": {"requests": 250}, "network": {"control": "arbiter"}}, ARK, 25.0, 0),
    "paper-jitter-per-layer": ({"workload": {"requests": 80},
                                "serving": {"kv_transfer": "per-layer", "placement": "round-robin"},
                                "network": {"control_jitter_us": 5.0}},
                               (*ARK, "letflow", "conga"), 25.0, 0),
    "paper-slow-control": ({"workload": {"requests": 200}, "network": {"control_delay_us": 20000.0}}, ARK, 25.0, 0),
    "paper-jitter-slow-control": ({"workload": {"requests": 200},
                                   "network": {"control_delay_us": 2000.0, "control_jitter_us": 2000.0}},
                                  ("ark", "ark-balance"), 25.0, 0),
    "paper-skew-in-band": ({"workload": {"requests": 150},
                            "network": {"clock_skew_us": 50.0, "control_path": "data-fabric",
                                        "control_delay_us": 200.0}},
                           ("ark", "ark-balance"), 25.0, 0),
    "paper-link-down": ({"workload": {"requests": 200}, "failure": {"leaf": 0, "spine": 1, "at_s": 1.0,
                                                                    "detect_s": 0.5}},
                        ("ecmp", *ARK, "plb", "conga", "hedera", "spray"), 25.0, 0),
    "paper-link-degraded": ({"workload": {"requests": 200},
                             "failure": {"leaf": 1, "spine": 2, "at_s": 1.0, "fraction": 0.25}},
                            ("ecmp", "ark", "ark-balance"), 25.0, 0),
    "clos3": ({"fabric": {"preset": "clos3-small"}, "workload": {"requests": 250}, "serving": {"placement": "random"}},
              ("ecmp", *ARK, "ecmp-split", "spray", "oracle-path"), 30.0, 0),
    "clos3-arbiter": ({"fabric": {"preset": "clos3-small"}, "workload": {"requests": 250},
                       "serving": {"placement": "random"}, "network": {"control": "arbiter"}}, ARK, 30.0, 0),
}
SLOW_CASES: dict[str, tuple[dict[str, Any], tuple[str, ...], float, int]] = {
    **{f"paper-full-q{q:g}-s{s}": ({}, ALL_2TIER, q, s) for q in (15.0, 25.0, 30.0) for s in (0, 1)},
    "scale-3000": ({"fabric": {"preset": "scale"}, "workload": {"requests": 3000},
                    "serving": {"placement": "random"}}, ("ecmp", "ark", "ark-balance", "spray"), 1400.0, 0),
}


def figures(overrides: dict[str, Any], scheme: str, qps: float, seed: int) -> dict[str, Any]:
    cfg = from_dict({**overrides, "experiment": {"schemes": [scheme], "seeds": [seed]}})
    rec = run_one(cfg, RunSpec(scheme, qps, seed)).record
    return {k: rec[k] for k in (*FLOATS, *INTS)}


def _runs(cases: dict[str, tuple[dict[str, Any], tuple[str, ...], float, int]]) -> list[tuple[str, str]]:
    return [(name, s) for name, (_, schemes, _, _) in cases.items() for s in schemes]


def _check(cases: dict[str, tuple[dict[str, Any], tuple[str, ...], float, int]], name: str, scheme: str) -> None:
    want = json.loads(DATA.read_text())[name][scheme]
    got = figures(cases[name][0], scheme, cases[name][2], cases[name][3])
    for k in INTS:
        assert got[k] == want[k], f"{name}/{scheme}: {k} is {got[k]}, was {want[k]}"
    for k in FLOATS:
        ok = math.isclose(got[k], want[k], rel_tol=REL) or (math.isnan(got[k]) and math.isnan(want[k]))
        assert ok, f"{name}/{scheme}: {k} is {got[k]!r}, was {want[k]!r}"


@pytest.mark.parametrize(("name", "scheme"), _runs(CASES))
def test_results_equal_the_kept_figures(name: str, scheme: str) -> None:
    _check(CASES, name, scheme)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "scheme"), _runs(SLOW_CASES))
def test_results_equal_the_kept_figures_on_full_runs(name: str, scheme: str) -> None:
    _check(SLOW_CASES, name, scheme)


def _write(names: list[str]) -> None:
    """Rewrite the named cases (all when none are named), one line per run; keep the others."""
    cases = {**CASES, **SLOW_CASES}
    out = json.loads(DATA.read_text()) if DATA.is_file() else {}
    for name in names or cases:
        ov, schemes, q, seed = cases[name]
        out[name] = {s: figures(ov, s, q, seed) for s in schemes}
    lines = []
    for name in sorted(out):
        runs = [f'  "{s}": {json.dumps(out[name][s], sort_keys=True, separators=(",", ":"))}' for s in sorted(out[name])]
        lines.append(f' "{name}": {{\n' + ",\n".join(runs) + "\n }")
    DATA.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__" and sys.argv[1:2] == ["--write"]:
    _write(sys.argv[2:])
