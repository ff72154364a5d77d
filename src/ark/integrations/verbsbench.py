"""What the verbs interposer costs per QP (``ark bench verbs``).

An engine pays the interposer on each ``ibv_modify_qp``; only INIT -> RTR towards a ruled
peer does work (a rule lookup, a port, a copy of the attributes, a log entry). Each mode
runs the miniature engine (``verbs_engine.c``) against the stand-in libibverbs, whose
``ibv_modify_qp`` only records, and times the call alone, in C:

* ``plain``: the interposer is not loaded (its own process);
* ``idle``: loaded, no rule in the process (every QP of an unsteered process);
* ``other``: the thread's rule names another peer, and a rule for a third is installed;
* ``steered``: the thread's rule names the peer: the flow label of its next port is set;
* ``installed``: no thread rule, a process rule names the peer (how engines that connect
  on their own threads are steered).

The per-QP overhead is a mode's median minus ``idle``'s, the modes taking turns call by
call in one process. The stand-in's own call costs nanoseconds where a real NIC's modify
is a system call of tens of microseconds, so the figures bound the interposer's share.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

from ark.integrations import verbs, verbs_standin
from ark.integrations.verbs import QpRule
from ark.integrations.verbs_standin import Engine

MODES = ("plain", "idle", "other", "steered", "installed")
PEER, OTHER, THIRD = "10.0.1.1", "10.0.2.1", "10.0.3.1"
TARGET_US = 10


def measure(preloaded: bool, calls: int) -> dict[str, list[int]]:
    """Nanoseconds per INIT -> RTR ``ibv_modify_qp``, ``calls`` per mode, in this process
    (started with the stand-in in ``LD_LIBRARY_PATH``, and preloaded or not)."""
    eng = Engine(verbs_standin.build())
    eng.time_rtr(PEER, 200)  # warm the code paths and the allocator
    if not preloaded:
        return {"plain": eng.time_rtr(PEER, calls)}
    other, steered, installed = QpRule(OTHER), QpRule(PEER), QpRule(PEER)
    for r in (other, steered, installed):
        r.add_ports([49153, 50000, 60001], [0, 1, 2])
    third = QpRule(THIRD)
    third.install()
    out: dict[str, list[int]] = {m: [] for m in MODES if m != "plain"}
    for _ in range(calls):
        out["idle"] += _alone(eng, third)
        with other:
            out["other"] += eng.time_rtr(PEER, 1)
        with steered:
            out["steered"] += eng.time_rtr(PEER, 1)
        with installed.installed():
            out["installed"] += eng.time_rtr(PEER, 1)
    if steered.stats().steered != calls or installed.stats().steered != calls:
        raise RuntimeError(f"verbs bench: {steered.stats().steered} and {installed.stats().steered} of {calls} steered")
    for r in (other, steered, installed, third):
        r.close()
    return out


def _alone(eng: Engine, third: QpRule) -> list[int]:
    """One call with no rule installed at all (the process's ordinary state)."""
    third.uninstall()
    try:
        return eng.time_rtr(PEER, 1)
    finally:
        third.install()


def _summary(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {"median_us": round(statistics.median(s) / 1e3, 3), "p99_us": round(s[int(0.99 * (len(s) - 1))] / 1e3, 3)}


def _run(preloaded: bool, calls: int) -> dict[str, list[int]]:
    env = verbs_standin.env(verbs_standin.build(), preload_lib=verbs.library() if preloaded else None)
    cmd = [sys.executable, "-m", "ark.integrations.verbsbench", str(int(preloaded)), str(calls)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"verbs bench: {res.stderr.strip().splitlines()[-1:]}")
    out: dict[str, list[int]] = json.loads(res.stdout)
    return out


def bench(calls: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """``rounds`` of (plain process, preloaded process); per mode the median over rounds."""
    if not 1 <= calls <= 4000:
        raise ValueError(f"calls: expected 1..4000; got {calls}")
    if not 1 <= rounds <= 20:
        raise ValueError(f"rounds: expected 1..20; got {rounds}")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for preloaded in (False, True):
            for mode, ns in _run(preloaded, calls).items():
                runs[mode].append(_summary(ns))
    modes = {m: {k: round(statistics.median(r[k] for r in rs), 3) for k in ("median_us", "p99_us")}
             for m, rs in runs.items()}
    idle = modes["idle"]["median_us"]
    return {"calls": calls, "rounds": rounds, "modes": modes, "runs": runs,
            "overhead_us": {m: round(modes[m]["median_us"] - idle, 3) for m in ("other", "steered", "installed")},
            "preload_us": round(idle - modes["plain"]["median_us"], 3), "target_us": TARGET_US,
            "stand_in": "libibverbs.so.1 stand-in (records only): the interposer's share, not a NIC's modify"}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] == "1", int(sys.argv[2]))))
