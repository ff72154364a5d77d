"""``ark bench ...``: benchmarks that print figures (and JSON with --json)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from ark.cli.common import (
    FiniteRange,
    InOrder,
    OutFile,
    jobs_default,
    jobs_option,
    out,
    qps_list,
    seeds_option,
)
from ark.core.hashing import HASH_MODELS
from ark.sim import config as cfgmod


@click.group(cls=InOrder)
def bench() -> None:
    """Benchmarks that print figures (and JSON with --json)."""


@bench.command("controller")
@click.option("--hash", "hash_name", type=click.Choice(list(HASH_MODELS)), default="murmur3-hpcc", show_default=True,
              help="Switch hash model whose costs to measure.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_controller(hash_name: str, as_json: bool) -> None:
    """Precompute, hashing, path selection and reserve-decision costs vs the paper."""
    from ark.sim.bench import controller

    res = controller(hash_name)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    p = res["paper"]
    t = Table(title=f"controller costs (CPython, one thread, hash {hash_name})")
    for c in ("measure", "ARK (here)", "paper", "target"):
        t.add_column(c, justify="right" if c != "measure" else "left")
    t.add_row("precompute 65,536 ports / peer", f"{res['precompute_ms_per_peer']:.2f} ms", f"{p['precompute_ms_per_peer']:.0f} ms", "<= 5 ms")
    t.add_row("precompute 16,384 ports / peer", f"{res['precompute_ms_per_peer_16384']:.2f} ms", "—", "")
    t.add_row("hash per port (vectorised)", f"{res['hash_ns_per_port']:.1f} ns", f"{p['hash_ns_per_port']:.0f} ns", "")
    t.add_row("hash one key (scalar)", f"{res['hash_one_us']:.2f} us", "4.10 us", "")
    t.add_row("path selection K=4", f"{res['select_us_k4']:.2f} us", f"{p['select_us_k4']} us", "")
    t.add_row("path selection K=1000", f"{res['select_us_k1000']:.2f} us", f"{p['select_us_k1000']:.0f} us", "<= 5 us")
    t.add_row("reserve decision p50", f"{res['decision_us_p50']:.2f} us", "4.97 us", "<= 5 us")
    t.add_row("reserve decision p99", f"{res['decision_us_p99']:.2f} us", "—", "")
    t.add_row("with a lease (as an agent) p50 / p99",
              f"{res['decision_lease_us_p50']:.2f} / {res['decision_lease_us_p99']:.2f} us", "—", "")
    out.print(t)


@bench.command("reproduce")
@click.option("--qps", "qps", show_default="the paper's 7", help="Comma-separated loads.")
@click.option("--requests", type=click.IntRange(min=1), show_default="1000", help="Requests per run.")
@click.option("--seeds", show_default="3", help="Seed count N or a list like 0,4,7.")
@jobs_option()
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_reproduce(qps: str | None, requests: int | None, seeds: str | None, jobs: int | None, as_json: bool) -> None:
    """Wall time and simulator events/s of the default `ark reproduce` sweep (no files)."""
    from ark.sim.bench import reproduce as bench_rep

    cfg = cfgmod.default().with_overrides(qps=qps_list(qps), requests=requests, seeds=seeds_option(seeds))
    res = bench_rep(cfg, jobs or jobs_default())
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    out.print(
        f"{res['runs']} runs x {res['requests_per_run']} requests on {res['jobs']} workers: "
        f"{res['wall_s']:.2f} s wall, {res['events']} events, {res['events_per_s']:.0f} events/s "
        f"(target: <= 20 s for the default sweep on 2 cores)"
    )


@bench.command("compare")
@jobs_option()
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_compare(jobs: int | None, as_json: bool) -> None:
    """Wall time of `ark compare` on the default config (no files), against `ark reproduce`
    measured right after it on the same machine."""
    from ark.sim.bench import compare as bench_cmp

    r = bench_cmp(cfgmod.default(), jobs or jobs_default())
    _print_json_or_line(
        r, as_json,
        f"ark compare: {r['runs']} runs ({len(r['schemes'])} schemes) x {r['requests_per_run']} requests on "
        f"{r['jobs']} workers ({r['cpus']} CPUs, load average {r['load_average_before']} before, "
        f"{r['load_average_after']} after): {r['wall_s']:.1f} s wall (target <= {r['target_wall_s']:g} s), "
        f"{r['events']} events, {r['events_per_s']:.0f} events/s; ark reproduce's {r['reproduce_runs']} runs "
        f"right after: {r['reproduce_wall_s']:.1f} s (ratio {r['ratio_to_reproduce']:.2f}); events by scheme: "
        + ", ".join(f"{k} {v}" for k, v in r["events_by_scheme"].items()))


@bench.command("idle")
@click.option("--agents", type=click.IntRange(2, 64), default=16, show_default=True, help="Agent processes started.")
@click.option("--seconds", type=FiniteRange(min=1), default=60.0, show_default=True, help="How long to measure.")
@click.option("--heartbeat", type=FiniteRange(min=0.01), default=0.25, show_default=True, help="heartbeat_s (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_idle(agents: int, seconds: float, heartbeat: float, as_json: bool) -> None:
    """CPU of idle agents on loopback (no flows): what heartbeats and timers cost."""
    from ark.agent.bench import idle_cpu

    res = idle_cpu(agents, seconds, heartbeat)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    out.print(f"{agents} idle agents, {res['seconds']} s: {res['cpu_s']} CPU-s "
              f"({res['cpu_percent_per_agent']}% of a core per agent); by thread {res['cpu_s_by_thread']}")


def _print_json_or_line(res: dict[str, object], as_json: bool, line: str) -> None:
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        out.print(line, highlight=False)


@bench.command("flood")
@click.option("--rate", type=FiniteRange(min=1), default=10_000, show_default=True, help="Hostile messages/s from one peer.")
@click.option("--seconds", type=FiniteRange(min=1), default=10.0, show_default=True, help="How long to measure.")
@click.option("--peer-rate", type=FiniteRange(min=10), default=2000.0, show_default=True, help="The agents' peer_rate.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_flood(rate: float, seconds: float, peer_rate: float, as_json: bool) -> None:
    """A listed peer floods an agent with hostile messages; local API latency meanwhile."""
    from ark.agent.bench import flood

    r = flood(rate, seconds, peer_rate)
    _print_json_or_line(r, as_json, f"{r['sent']} hostile messages in {seconds:g} s: local API p50 "
                        f"{r['api_ms_p50']} ms, p99 {r['api_ms_p99']} ms over {r['api_requests']} requests "
                        f"({r['api_errors']} errors); agent RSS {r['rss_mb_before']} -> {r['rss_mb_after']} MiB, "
                        f"{r['agent_cpu_s']} CPU-s, alive {r['alive']}")


@bench.command("churn")
@click.option("--seconds", type=FiniteRange(min=1), default=60.0, show_default=True, help="How long to measure.")
@click.option("--max-flows-per-host", type=click.IntRange(16, 1 << 20), default=4096, show_default=True,
              help="The cluster's max_flows_per_host.")
@click.option("--retention", type=FiniteRange(min=1, max=3600), default=5.0, show_default=True, help="retention_s (s).")
@click.option("--peer-rate", type=FiniteRange(min=10, max=1e7), default=2000.0, show_default=True,
              help="The agents' peer_rate.")
@click.option("--parts", type=click.IntRange(1, 16), show_default="none (one path per lease)",
              help="Each cycle a multi-path lease of this many parts.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_churn(seconds: float, max_flows_per_host: int, retention: float, peer_rate: float, parts: int | None,
                as_json: bool) -> None:
    """One engine reserving and releasing back to back on a real 2-agent cluster: sustained
    cycles/s, refusals and plain-ECMP leases (by reason)."""
    from ark.agent.bench import churn

    r = churn(seconds, max_flows_per_host, retention, peer_rate, parts)
    _print_json_or_line(r, as_json, f"{r['cycles']} reserve+release cycles in {r['seconds']} s: {r['cycles_per_s']} "
                        f"cycles/s (slowest second {r['cycles_per_s_min']}), cycle p50 {r['cycle_ms_p50']} ms, "
                        f"p99 {r['cycle_ms_p99']} ms, {r['agent_cpu_us_per_cycle']} us of agent CPU per cycle; "
                        f"{r['refusals']} refused {r['refusal_reasons']}, {r['ecmp']} plain ECMP {r['ecmp_reasons']}; "
                        f"peer: {r['peer_overflow']} dropped over the owner's share, {r['peer_rate_limited']} "
                        f"rate limited, {r['peer_gaps']} gaps, {r['peer_sync_applied']} syncs")


@bench.command("hostile")
@click.option("--messages", type=click.IntRange(min=6), default=1_000_000, show_default=True, help="Hostile messages sent.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_hostile(messages: int, as_json: bool) -> None:
    """A listed peer sends hostile messages of every kind as fast as it can: agent memory."""
    from ark.agent.bench import hostile_memory

    r = hostile_memory(messages)
    _print_json_or_line(r, as_json, f"{r['received']} of {r['messages']} hostile messages taken in {r['seconds']} s: "
                        f"RSS {r['rss_mb_before']} -> peak {r['rss_mb_peak']} MiB (+{r['growth_mb']}); "
                        f"{r['invalid']} counted invalid, {r['reservations']} reservations, ready {r['ready']}")


@bench.command("unauth")
@click.option("--announce-mb", type=click.IntRange(min=1), default=200, show_default=True, help="MB of oversized handshake frames sent.")
@click.option("--connections", type=click.IntRange(min=0), default=3, show_default=True, help="Connections that send them.")
@click.option("--idle", type=click.IntRange(min=0), default=1100, show_default=True, help="Idle connections opened then.")
@click.option("--fd-limit", type=click.IntRange(min=64), default=1024, show_default=True, help="The agent's file descriptor limit.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_unauth(announce_mb: int, connections: int, idle: int, fd_limit: int, as_json: bool) -> None:
    """Strangers without keys: huge handshake frames, then idle connections under a descriptor limit."""
    from ark.agent.bench import unauthenticated

    r = unauthenticated(announce_mb, connections, idle, fd_limit)
    _print_json_or_line(r, as_json, f"RSS {r['rss_mb_before']} -> {r['rss_mb_after_announce']} (announces) -> "
                        f"{r['rss_mb_after_idle']} MiB ({r['idle_connections']} idle connections, "
                        f"{r['connections_shed']} shed); local API answered in {r['api_ms']} ms; alive {r['alive']}")


@bench.command("agent")
@click.option("--messages", type=click.IntRange(min=100), default=40_000, show_default=True, help="Messages the peer sends.")
@click.option("--rate", type=FiniteRange(min=10), default=5000.0, show_default=True, help="Messages/s the peer sends.")
@click.option("--burst", type=click.IntRange(min=1), default=100, show_default=True,
              help="Messages sent back to back between pauses (1: each one wakes the agent).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_agent(messages: int, rate: float, burst: int, as_json: bool) -> None:
    """CPU an agent spends per message it receives (valid reserve/release from one peer)."""
    from ark.agent.bench import per_message

    r = per_message(messages, rate, burst)
    _print_json_or_line(r, as_json, f"{r['received']} messages at {rate:g}/s in bursts of {burst}: "
                        f"{r['cpu_us_per_message']} us of agent CPU per received message, "
                        f"{r['net_cpu_us_per_message']} us net of idle ({r['cpu_s_by_thread']}); "
                        f"{r['invalid']} invalid, {r['overflow']} over the owner's cap")


@bench.command("transport")
@click.option("--messages", type=click.IntRange(min=100), default=15_000, show_default=True, help="Messages the peer sends.")
@click.option("--rate", type=FiniteRange(min=10), default=1500.0, show_default=True, help="Messages/s the peer sends.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_transport(messages: int, rate: float, as_json: bool) -> None:
    """ZeroMQ with CURVE, one message per wakeup, no work: the floor under every agent figure."""
    from ark.agent.bench import transport_floor

    r = transport_floor(messages, rate)
    _print_json_or_line(r, as_json, f"{r['messages']} messages at {rate:g}/s: {r['cpu_us_per_message']} us of "
                        f"receiver CPU per message (poll and receive only)")


@bench.command("arbiter")
@click.option("--rates", default="2000,5000,10000,15000,20000,30000,40000", show_default=True,
              help="Offered decisions/s, comma-separated (the sweep stops at the first not sustained).")
@click.option("--seconds", type=FiniteRange(min=0.5, max=600), default=3.0, show_default=True, help="Per rate.")
@click.option("--hosts", type=click.IntRange(min=4, max=512), default=64, show_default=True, help="Hosts the load comes from.")
@click.option("--policy", type=click.Choice(["ark", "ark-balance", "ark-split"]), default="ark", show_default=True,
              help="The arbiter's placement policy.")
@click.option("--takeover", "takeover_trials", type=click.IntRange(min=0, max=100), default=0, show_default=True,
              help="Instead: SIGKILL a primary under a standby this many times; how long no arbiter answers.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_arbiter(rates: str, seconds: float, hosts: int, policy: str, takeover_trials: int, as_json: bool) -> None:
    """One real arbiter process under an open-loop load over ZeroMQ with CURVE: decisions/s, grant latency, CPU."""
    from ark.agent.arbiter_bench import arbiter_bench, takeover

    if takeover_trials:
        t = takeover(takeover_trials)
        _print_json_or_line(t, as_json, f"primary SIGKILLed {t['trials']} times (takeover_s {t['takeover_s']}): no "
                            f"arbiter answered for {', '.join(f'{g:.3f}' for g in t['no_arbiter_s'])} s")
        return

    try:
        offered = tuple(float(x) for x in rates.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers; got {rates!r}", param_hint="--rates") from None
    if not offered or any(not 1 <= r <= 1e6 for r in offered):
        raise click.BadParameter(f"expected rates in 1..1000000; got {rates!r}", param_hint="--rates")
    r = arbiter_bench(offered, seconds, hosts=hosts, policy=policy)
    if as_json:
        out.print_json(data=r)
        return
    table = Table(title=f"arbiter ({policy}, {hosts} hosts; this machine: {r['machine']['transport_us_per_message']} us "
                    f"per CURVE message, {r['machine']['cpus']} CPUs)")
    for col in ("offered/s", "completed/s", "grant P50 ms", "grant P99 ms", "arbiter us/decision", "arbiter cores",
                "generator cores", "sustained"):
        table.add_column(col, justify="right")
    rows = [*r["steps"], *([r["at_80_percent"]] if r["at_80_percent"] else [])]
    for s in rows:
        table.add_row(f"{s['offered_per_s']:.0f}", f"{s['completed_per_s']:.0f}", str(s["grant_p50_ms"]),
                  str(s["grant_p99_ms"]), str(s["arbiter_cpu_us_per_decision"]), str(s["arbiter_cores"]),
                  str(s["generator_cores"]), "yes" if s["sustained"] else "no")
    out.print(table)
    out.print(f"sustained {r['sustained_per_s']:.0f} decisions/s; knee at {r['knee_offered_per_s']} offered/s; "
              f"the last row is 80% of the sustained rate")


@bench.command("lease")
@click.option("--samples", type=click.IntRange(50, 100_000), default=2000, show_default=True,
              help="Timed cycles per build (each: reserve, renew, release, a four-part reserve).")
@click.option("--old", "old", type=click.Path(exists=True, file_okay=False), show_default="none",
              help="An older checkout (e.g. a git worktree of an old commit): its agents, run from its src/, "
                   "measured in the same run, turn about with this build's.")
@click.option("--arbiter/--no-arbiter", default=True, show_default=True,
              help="Also measure this build in arbiter mode (every lease through an arbiter process).")
@click.option("--cpu-cycles", type=click.IntRange(100, 1_000_000), default=2000, show_default=True,
              help="Reserve+release cycles per build for the agent's CPU figure.")
@click.option("--decisions", type=click.IntRange(1000, 1_000_000), default=20_000, show_default=True,
              help="Decisions per run of the core's decision benchmark (three runs per build).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_lease(samples: int, old: str | None, arbiter: bool, cpu_cycles: int, decisions: int, as_json: bool) -> None:
    """A lease's round trip through the local API (reserve, renew, release, a four-part
    reserve; P50/P99) beside the local transport's floor measured in the same run, and the
    agent's CPU and the core's decision time; optionally an older build's and arbiter mode's."""
    from pathlib import Path

    from ark.agent.lease_bench import lease_bench

    if old is not None and not (Path(old) / "src" / "ark" / "__init__.py").is_file():
        raise click.BadParameter(f"expected a checkout of ARK (with src/ark/); got {old!r}", param_hint="--old")
    r = lease_bench(samples, old, arbiter, cpu_cycles, decisions)
    if as_json:
        click.echo(json.dumps(r, indent=1))
        return
    _lease_table(r)


def _lease_table(r: dict[str, Any]) -> None:
    fl = r["floor"]
    names = list(r["builds"])
    t = Table(title=f"a lease through the local API, us (P50 / P99), {r['samples']} cycles per build; floor: "
                    f"a msgpack echo over the same ipc transport, {fl['p50_us']} / {fl['p99_us']} us")
    t.add_column("operation")
    for n in names:
        t.add_column(n, justify="right")
        t.add_column(f"{n} x floor", justify="right")
    for op in ("reserve", "renew", "release", "reserve4"):
        row = [op if op != "reserve4" else f"reserve, {r['parts']} parts"]
        for n in names:
            s, x = r["builds"][n]["ops"][op], r["builds"][n]["x_floor"][op]
            row += ["—", "—"] if s["p50_us"] is None else [f"{s['p50_us']:.0f} / {s['p99_us']:.0f}",
                                                          f"{x['p50_us']} / {x['p99_us']}"]
        t.add_row(*row)
    for key, label in (("agent_cpu_us_per_reserve_release", "agent CPU per reserve+release, us"),
                       ("decision_us_p50", "core decision P50, us")):
        vals = [r["builds"][n][key] for n in names]
        t.add_row(label, *[x for v in vals for x in ("—" if v is None else str(v), "")])
    out.print(t)
    met = ", ".join(f"{k} {v['value']} (<= {v['target']}: {'met' if v['met'] else 'NOT met'})"
                    for k, v in r["targets"].items())
    out.print(f"targets: {met}", highlight=False)
    out.print(f"load average {r['load_average_before']} before, {r['load_average_after']} after, "
              f"on {r['cpus']} CPUs", highlight=False)


@bench.command("control-plane")
@click.option("--hosts", "hosts_csv", default="16,256,1024,4096", show_default=True,
              help="Comma-separated cluster sizes: 16 or multiples of 128.")
@click.option("--placement", "placements", multiple=True, show_default="all three", type=click.Choice(["paired", "cross-pod", "any"]),
              help="Who sends to whom (repeat; default: all three).")
@click.option("--flows", type=click.IntRange(100, 10**6), default=2000, show_default=True,
              help="Simulated flows per size and placement.")
@click.option("--heartbeat", type=FiniteRange(min=0.01), default=0.25, show_default=True, help="heartbeat_s (s).")
@click.option("--measure/--no-measure", default=True, show_default=True,
              help="Measure the agent's costs first (about a minute); else use --cost or the built-in figures.")
@click.option("--cost", "cost_json", type=click.Path(exists=True, dir_okay=False), show_default="none",
              help="A JSON file of AgentCost terms (the 'cost' object of an earlier --json run).")
@click.option("--arbiter-cost", "arbiter_cost_json", type=click.Path(exists=True, dir_okay=False), show_default="none",
              help="A JSON file of ArbiterCost terms (per_request_us, per_keepalive_us, per_replica_copy_us, "
                   "base_percent); default: the built-in provisional figures.")
@click.option("--plot", "plot_path", type=OutFile(), show_default="none", help="Write the figure here (PNG).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_control_plane(hosts_csv: str, placements: tuple[str, ...], flows: int, heartbeat: float, measure: bool,
                        cost_json: str | None, arbiter_cost_json: str | None, plot_path: str | None,
                        as_json: bool) -> None:
    """Control messages, bytes and CPU per agent from 16 to 4,096 hosts: full broadcast,
    scoped dissemination and one arbiter, at the published per-GPU load."""
    from ark.cli.control_plane import run_bench

    res = run_bench(hosts_csv, placements, flows, heartbeat, measure, cost_json, plot_path, arbiter_cost_json)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    from ark.cli.control_plane import print_table

    print_table(res)


@bench.command("steer")
@click.option("--connections", type=click.IntRange(1, 2000), default=2000, show_default=True, help="Connections per mode and round.")
@click.option("--rounds", type=click.IntRange(1, 20), default=3, show_default=True, help="Rounds; figures are their medians.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_steer(connections: int, rounds: int, as_json: bool) -> None:
    """Per-connection cost of the connect() interposer that steers transfer engines."""
    from ark.integrations.steerbench import bench as steer_bench

    res = steer_bench(connections, rounds)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    t = Table(title=f"connect() on loopback, {connections} connections x {rounds} rounds per mode (medians of rounds)")
    for c in ("mode", "median", "p99", "overhead vs idle"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    for mode, m in res["modes"].items():
        over = res["overhead_us"].get(mode)
        t.add_row(mode, f"{m['median_us']:.2f} us", f"{m['p99_us']:.2f} us", "—" if over is None else f"{over:+.2f} us")
    out.print(t)
    out.print(f"loaded but steering nothing (idle - plain, two processes): {res['preload_us']:+.2f} us; "
              f"target: <= {res['target_us']} us per steered connection")


@bench.command("verbs")
@click.option("--calls", type=click.IntRange(1, 4000), default=2000, show_default=True, help="QP connects per mode and round.")
@click.option("--rounds", type=click.IntRange(1, 20), default=3, show_default=True, help="Rounds; figures are their medians.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_verbs(calls: int, rounds: int, as_json: bool) -> None:
    """Per-QP cost of the verbs interposer (ibv_modify_qp INIT -> RTR, against a stand-in libibverbs)."""
    from ark.integrations.verbsbench import bench as verbs_bench

    res = verbs_bench(calls, rounds)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    t = Table(title=f"ibv_modify_qp INIT -> RTR, {calls} calls x {rounds} rounds per mode (medians of rounds), "
                    "stand-in libibverbs")
    for c in ("mode", "median", "p99", "overhead vs idle"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    for mode, m in res["modes"].items():
        over = res["overhead_us"].get(mode)
        t.add_row(mode, f"{m['median_us']:.3f} us", f"{m['p99_us']:.3f} us", "—" if over is None else f"{over:+.3f} us")
    out.print(t)
    out.print(f"loaded but steering nothing (idle - plain, two processes): {res['preload_us']:+.3f} us; "
              f"target: < {res['target_us']} us per steered QP. The stand-in only records; a real "
              "ibv_modify_qp adds the driver's system call, the same with or without ARK.")


def _add_scale_commands() -> None:
    from ark.cli.scale import bench_scale, bench_scaling

    bench.add_command(bench_scale)
    bench.add_command(bench_scaling)


_add_scale_commands()
