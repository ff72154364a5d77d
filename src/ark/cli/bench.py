"""``ark bench ...``: benchmarks that print figures (and JSON with --json)."""

from __future__ import annotations

import json

import click
from rich.table import Table

from ark.cli.common import jobs_default, out, qps_list, seeds_option
from ark.core.hashing import HASH_MODELS
from ark.sim import config as cfgmod
from ark.sim.engine import SCHEMES


@click.group()
def bench() -> None:
    """Benchmarks that print figures (and JSON with --json)."""


@bench.command("controller")
@click.option("--hash", "hash_name", type=click.Choice(list(HASH_MODELS)), default="murmur3-hpcc", show_default=True)
@click.option("--json", "as_json", is_flag=True)
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
    t.add_row("reserve decision p50", f"{res['decision_us_p50']:.2f} us", "4.97 us", "<= 10 us")
    t.add_row("reserve decision p99", f"{res['decision_us_p99']:.2f} us", "—", "")
    out.print(t)


@bench.command("reproduce")
@click.option("--qps", "qps", help="Comma-separated loads (default: the paper's 7).")
@click.option("--requests", type=click.IntRange(min=1))
@click.option("--seeds")
@click.option("--jobs", type=click.IntRange(min=1), default=None)
@click.option("--json", "as_json", is_flag=True)
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


@bench.command("scale")
@click.option("--scheme", "schemes", multiple=True, type=click.Choice(list(SCHEMES)),
              help="Repeat for several (default: ark).")
@click.option("--requests", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Arrival rate (default: 1400, offered load about 0.76).")
@click.option("--json", "as_json", is_flag=True)
def bench_scale(schemes: tuple[str, ...], requests: int, qps: float | None, as_json: bool) -> None:
    """1,024 GPUs (the 3-tier `scale` fabric): wall time, events/s and peak memory per scheme."""
    from ark.sim.bench import SCALE_QPS
    from ark.sim.bench import scale as bench_sc

    res = bench_sc(schemes or ("ark",), requests, SCALE_QPS if qps is None else qps)
    if as_json:
        click.echo(json.dumps(res[0] if len(res) == 1 else res, indent=1))
        return
    t = Table(title=f"{res[0]['gpus']} GPUs x {requests} requests at QPS {res[0]['qps']:g} "
                    f"(offered load {res[0]['offered_load']:.2f}), one process per scheme")
    for c in ("scheme", "wall s", "CPU s", "events", "events/s", "peak RSS MB", "mean FCT s", "mismatches",
              "baseline s"):
        t.add_column(c, justify="right")
    for r in res:
        t.add_row(r["scheme"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", str(r["events"]), f"{r['events_per_s']:.0f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['fct_mean_s']:.3f}", str(r["path_mismatches"]),
                  f"{r['baseline_s']:.2f}")
    out.print(t)
    out.print("targets: <= 300 s wall on 2 cores and <= 4096 MB peak per scheme; baseline = one paper-fabric "
              "run (ECMP, QPS 25) measured just before, to read the figures against the machine's load")

@bench.command("idle")
@click.option("--agents", type=click.IntRange(2, 64), default=16, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=1), default=60.0, show_default=True)
@click.option("--heartbeat", type=click.FloatRange(min=0.01), default=0.25, show_default=True, help="heartbeat_s (s).")
@click.option("--json", "as_json", is_flag=True)
def bench_idle(agents: int, seconds: float, heartbeat: float, as_json: bool) -> None:
    """CPU of idle agents on loopback (no flows): what heartbeats and timers cost."""
    from ark.agent.loopback import idle_cpu

    res = idle_cpu(agents, seconds, heartbeat)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    out.print(f"{agents} idle agents, {res['seconds']} s: {res['cpu_s']} CPU-s "
              f"({res['cpu_percent_per_agent']}% of a core per agent); by thread {res['cpu_s_by_thread']}")
