"""``ark bench control-plane``: the cost model fed with measured agent costs, a table and a figure."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import out
from ark.sim.control_cost import AgentCost, ArbiterCost, ControlPlaneError, fabric_for, measure, table

TARGET_PERCENT = 5.0  # of one core per agent
# Arbiter mode's targets at the largest any-to-any size.
ARBITER_AGENT_MSGS_PER_S = 100.0  # control messages per agent, both ways
ARBITER_AGENT_PERCENT = 1.0  # of one core per agent
ARBITER_PERCENT = 100.0  # the arbiter: one core


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers; got {text!r}", param_hint="--hosts") from None
    for n in sizes:
        try:
            fabric_for(n)
        except ControlPlaneError as e:
            raise click.BadParameter(str(e), param_hint="--hosts") from None
    if not sizes:
        raise click.BadParameter("expected at least one size", param_hint="--hosts")
    return sizes


def _cost(measure_now: bool, cost_json: str | None) -> tuple[AgentCost, str, dict[str, Any] | None]:
    if cost_json:
        try:
            terms = json.loads(Path(cost_json).read_text())
            return AgentCost(**{k: float(terms[k]) for k in AgentCost.__dataclass_fields__}), cost_json, None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise click.BadParameter(f"{cost_json}: needs a JSON object with {', '.join(AgentCost.__dataclass_fields__)}"
                                     f" ({type(e).__name__}: {e})", param_hint="--cost") from None
    if not measure_now:
        return AgentCost(), "built-in figures (ark.sim.control_cost.AgentCost)", None
    from ark.agent.bench import control_costs

    measured = control_costs()
    terms = {k: measured[k] for k in AgentCost.__dataclass_fields__}
    return AgentCost(**terms), "measured in this run", measured["measured"]


def _arbiter_cost(cost_json: str | None) -> tuple[ArbiterCost, str]:
    fields = ArbiterCost.__dataclass_fields__
    if not cost_json:
        return ArbiterCost(), "built-in provisional figures (ark.sim.control_cost.ArbiterCost)"
    try:
        terms = json.loads(Path(cost_json).read_text())
        return ArbiterCost(**{k: float(terms[k]) for k in fields}), cost_json
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.BadParameter(f"{cost_json}: needs a JSON object with {', '.join(fields)}"
                                 f" ({type(e).__name__}: {e})", param_hint="--arbiter-cost") from None


def _arbiter_targets(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Arbiter mode at the largest any-to-any size against its targets: per agent <= 100
    control messages/s and <= 1% of a core, the arbiter <= one core."""
    anys = [r for r in rows if r["placement"] == "any" and r["mode"] == "arbiter"]
    if not anys:
        return None
    r = max(anys, key=lambda x: x["hosts"])
    met = (r["agent_msgs_per_s_max"] <= ARBITER_AGENT_MSGS_PER_S and r["cpu_percent_max"] <= ARBITER_AGENT_PERCENT
           and r["arbiter_cpu_percent"] <= ARBITER_PERCENT)
    return {"hosts": r["hosts"], "agent_msgs_per_s_max": r["agent_msgs_per_s_max"],
            "agent_msgs_per_s_target": ARBITER_AGENT_MSGS_PER_S, "agent_cpu_percent_max": r["cpu_percent_max"],
            "agent_cpu_percent_target": ARBITER_AGENT_PERCENT, "arbiter_cpu_percent": r["arbiter_cpu_percent"],
            "arbiter_cpu_percent_target": ARBITER_PERCENT, "arbiter_msgs_per_s": r["arbiter_msgs_per_s"],
            "met": met}


def _budget(rows: list[dict[str, Any]], cost: AgentCost, heartbeat_s: float) -> dict[str, Any] | None:
    """At the largest any-to-any size: what each term costs, and the per-message cost that
    would fit the busiest agent in 5% of a core once heartbeats and fan-out cost nothing."""
    anys = [r for r in rows if r["placement"] == "any" and r["mode"] == "scoped"]
    if not anys:
        return None
    r = max(anys, key=lambda x: x["hosts"])
    recv, peers = r["received_per_s_max"], r["peers_max"]
    sent = recv / max(1, peers)  # a sender's own rate: what each of its peers sends, on average
    terms = {"receive_percent": recv * cost.per_message_us / 1e4,
             "fan_out_percent": sent * peers * cost.per_copy_us / 1e4,
             "heartbeats_percent": peers / heartbeat_s * cost.per_peer_heartbeat_us / 1e4,
             "base_percent": cost.base_percent}
    room = TARGET_PERCENT - cost.base_percent
    return {"hosts": r["hosts"], "target_percent": TARGET_PERCENT, **{k: round(v, 2) for k, v in terms.items()},
            "per_message_us_needed": round(room * 1e4 / recv, 2) if recv > 0 else None,
            "messages_per_s": recv}


def run_bench(hosts_csv: str, placements: tuple[str, ...], flows: int, heartbeat_s: float, measure_now: bool,
              cost_json: str | None, plot_path: str | None, arbiter_cost_json: str | None = None) -> dict[str, Any]:
    sizes = _sizes(hosts_csv)
    arbiter_cost, arbiter_source = _arbiter_cost(arbiter_cost_json)
    cost, source, calibration = _cost(measure_now, cost_json)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for placement in placements or ("paired", "cross-pod", "any"):
            if placement == "cross-pod" and n < 256:
                continue  # one pod: nothing to cross
            rows += table(measure(n, placement, flows=flows, cost=cost, heartbeat_s=heartbeat_s,
                                  arbiter_cost=arbiter_cost))
    cut = {}
    for n in sizes:
        pair = {r["mode"]: r for r in rows if r["hosts"] == n and r["placement"] == "paired"}
        if "full" in pair and "scoped" in pair and pair["scoped"]["cpu_percent_max"] > 0:
            cut[str(n)] = round(pair["full"]["cpu_percent_max"] / pair["scoped"]["cpu_percent_max"], 1)
    res: dict[str, Any] = {"cost": cost.__dict__, "cost_source": source, "heartbeat_s": heartbeat_s,
                           "cpus": os.cpu_count(), "rows": rows, "paired_cpu_cut": cut,
                           "any_to_any_budget": _budget(rows, cost, heartbeat_s), "calibration": calibration,
                           "arbiter_cost": arbiter_cost.__dict__, "arbiter_cost_source": arbiter_source,
                           "arbiter_targets": _arbiter_targets(rows)}
    if plot_path:
        from ark.cli.plots import control_plane

        res["plot"] = str(control_plane(rows, Path(plot_path)))
    return res


def print_table(res: dict[str, Any]) -> None:
    c = res["cost"]
    t = Table(title=(f"control plane per agent (cost: {c['per_message_us']} us/message, {c['per_copy_us']} us/copy, "
                     f"{c['per_peer_heartbeat_us']} us/peer heartbeat, base {c['base_percent']}%; {res['cost_source']})"))
    a = res["arbiter_cost"]
    t.caption = (f"arbiter: {a['per_request_us']} us/request, {a['per_keepalive_us']} us/keepalive, "
                 f"{a['per_replica_copy_us']} us/standby copy, base {a['base_percent']}%; {res['arbiter_cost_source']}."
                 " Arbiter rows: msgs/s = replies, hello/s = keepalive replies, propagation = round trip")
    cols = ("hosts", "placement", "mode", "agents", "peers", "msgs/s (max)", "hello/s", "KB/s", "CPU % mean",
            "CPU % max", "races/1k", "propagation ms", "arbiter msgs/s", "arbiter CPU %")
    for col in cols:
        t.add_column(col, justify="left" if col in ("placement", "mode") else "right")
    for r in res["rows"]:
        prop = "saturated" if r["propagation_ms"] is None else f"{r['propagation_ms']:.3f}"
        t.add_row(str(r["hosts"]), r["placement"], r["mode"], str(r["agents"]), str(r["peers_max"]),
                  f"{r['received_per_s_max']:.0f}", f"{r['heartbeats_per_s_max']:.0f}", f"{r['bytes_per_s_max'] / 1e3:.1f}",
                  f"{r['cpu_percent_mean']:.2f}", f"{r['cpu_percent_max']:.2f}", f"{r['races_per_1000']:.2f}", prop,
                  "-" if r.get("arbiter_msgs_per_s") is None else f"{r['arbiter_msgs_per_s']:.0f}",
                  "-" if r.get("arbiter_cpu_percent") is None else f"{r['arbiter_cpu_percent']:.2f}")
    out.print(t)
    out.print("paired placement, busiest agent's CPU full / scoped: "
              + ", ".join(f"{n} hosts {x}x" for n, x in res["paired_cpu_cut"].items()))
    b = res["any_to_any_budget"]
    if b:
        out.print(f"any-to-any at {b['hosts']} hosts: receive {b['receive_percent']}%, fan-out {b['fan_out_percent']}%, "
                  f"heartbeats {b['heartbeats_percent']}%, base {b['base_percent']}% of a core; 5% needs <= "
                  f"{b['per_message_us_needed']} us per received message with heartbeats and fan-out free")
    g = res.get("arbiter_targets")
    if g:
        out.print(f"arbiter mode, any-to-any at {g['hosts']} hosts (per agent <= 100 control messages/s and <= 1% of a "
                  f"core; arbiter <= 1 core): per agent {g['agent_msgs_per_s_max']} msgs/s and "
                  f"{g['agent_cpu_percent_max']}% of a core; arbiter {g['arbiter_cpu_percent'] / 100:.3f} cores "
                  f"({g['arbiter_msgs_per_s']} msgs/s): {'met' if g['met'] else 'not met'}")
    if "plot" in res:
        out.print(f"figure: {res['plot']}")
