"""A link failure in the middle of a testbed run, and how long the hosts take to follow it.

At its time the link goes down (routes converge as a routing protocol's would); agents
notice the re-hash by their periodic checks and re-probe, or, under ECMP (no agents),
every source host re-probes. The record says when each step happened.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ark.agent.client import ArkClient
from ark.testbed.fabric import State, set_link
from ark.testbed.plan import Pairs
from ark.testbed.probing import Progress, check_maps, probe

if TYPE_CHECKING:
    from ark.testbed.run import RunParams

DETECT_TIMEOUT_S = 10.0


def fabric_change(st: State, params: RunParams, pairs: Pairs, cluster: Path, t0: float,
                   apis: dict[int, str], change: dict[str, Any], progress: Progress) -> None:
    """Fail a link at its time; every source host re-probes and re-paths (agents: API ``refresh``)."""
    try:
        _change(st, params, pairs, cluster, t0, apis, change, progress)
    except Exception as e:  # reported in the record; the run itself goes on
        change["error"] = f"{type(e).__name__}: {e}"


def _change(st: State, params: RunParams, pairs: Pairs, cluster: Path, t0: float,
            apis: dict[int, str], change: dict[str, Any], progress: Progress) -> None:
    assert params.fail_link is not None
    leaf, spine, at = params.fail_link
    clients = {src: ArkClient(apis[src]) for src in pairs if src in apis}
    try:
        time.sleep(max(0.0, t0 + at - time.time()))
        # Agents' counters are cumulative (a refresh may have run at start-up): report the change's share.
        before = {src: c.status()["paths"] for src, c in clients.items()}
        change["failing_at_s"] = time.time() - t0
        set_link(st, leaf, spine, False)
        change["failed_at_s"] = time.time() - t0  # link down and routes converged
        if clients:
            _await_agents(st, pairs, clients, before, t0, change)
        else:  # ECMP: no agents, the hosts re-probe
            info = probe(st, pairs, params.sample, cluster)
            change.update(refreshed_at_s=time.time() - t0, probes_sent=info["probes_sent"],
                          probe_agreement_fraction=info["probe_agreement_fraction"], repathed_live_flows=0)
    finally:
        for c in clients.values():
            c.close()
    progress(f"link leaf{leaf}-spine{spine} down at {change['failed_at_s']:.2f} s; maps refreshed at "
             f"{change['refreshed_at_s']:.2f} s; {change['repathed_live_flows']} live reservations re-pathed")


def _await_agents(st: State, pairs: Pairs, clients: dict[int, Any], before: dict[int, Any],
                  t0: float, change: dict[str, Any]) -> None:
    """Wait until every source agent refreshed by itself and the maps agree with the kernel.

    Agents notice the re-hash by their periodic checks (probe_check_s). A refresh whose
    probes straddled the change leaves stale ports, which the next check repairs, so
    "refreshed" means the maps agree again. An agent that has not refreshed within
    DETECT_TIMEOUT_S is told to (API op refresh).
    """
    detected: dict[int, float] = {}
    deadline = time.time() + DETECT_TIMEOUT_S
    agree, total = 0, 1
    while time.time() < deadline:
        for src, c in clients.items():
            last = c.status()["paths"]["last_refresh"] if src not in detected else None
            if last is not None and last > t0 + change["failing_at_s"]:
                detected[src] = last - t0
        if len(detected) == len(clients):
            agree, total = check_maps(st, pairs)
            if agree == total:
                break
        time.sleep(0.05)
    told = [src for src in clients if src not in detected]
    for src in told:
        clients[src].refresh([f"gpu{d}" for d in sorted(pairs[src])])
    if told or agree != total:
        agree, total = check_maps(st, pairs)
    after = {src: c.status()["paths"] for src, c in clients.items()}

    def delta(key: str) -> int:
        return sum(after[s][key] - before[s][key] for s in clients)

    change.update(
        refreshed_at_s=time.time() - t0, probes_sent=delta("refresh_probes"), check_probes=delta("check_probes"),
        probe_agreement_fraction=agree / total if total else math.nan, repathed_live_flows=delta("repathed"),
        detected_at_s={f"gpu{k}": round(v, 3) for k, v in sorted(detected.items())},
        told_to_refresh=[f"gpu{k}" for k in told],
    )
