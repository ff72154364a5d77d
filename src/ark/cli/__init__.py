"""The ``ark`` command line: the only layer that prints, plots and writes files."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ark.agent.client import ArkClientError
from ark.agent.cluster import ClusterError
from ark.agent.probe import ProbeError
from ark.core.hashing import HASH_MODELS, HashError
from ark.core.pathmap import PathMapError, compute_buckets, parse_port_range
from ark.core.protocol import CoreError
from ark.core.topology import HASH_SELECTIONS, TopologyError
from ark.sim import config as cfgmod
from ark.sim.config import ConfigError, ExperimentConfig
from ark.sim.engine import SCHEMES, SimError
from ark.sim.workload import WorkloadError
from ark.testbed.fabric import TestbedError

USER_ERRORS = (
    ConfigError, PathMapError, HashError, TopologyError, WorkloadError, SimError, CoreError, ClusterError,
    ArkClientError, TestbedError, ProbeError,
)

# Piped output would otherwise wrap at 80 columns and truncate the tables.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


# ---------------------------------------------------------------------------------------
# option parsing helpers (one-line errors naming the option)
# ---------------------------------------------------------------------------------------
def _qps_list(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers > 0, got {text!r}", param_hint="--qps") from None
    if not vals or any(not v > 0 for v in vals):
        raise click.BadParameter(f"expected comma-separated numbers > 0, got {text!r}", param_hint="--qps")
    return vals


def _schemes(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in SCHEMES]
    if bad or not vals:
        raise click.BadParameter(
            f"each must be one of {', '.join(SCHEMES)}; got {text!r}", param_hint="--schemes"
        )
    return vals


def _seeds(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        if "," in text:
            return cfgmod.parse_seeds([int(x) for x in text.split(",") if x.strip()], "--seeds")
        return cfgmod.parse_seeds(int(text), "--seeds")
    except ValueError as e:
        msg = str(e) if isinstance(e, ConfigError) else f"expected a count >= 1 or a list like 0,1,2; got {text!r}"
        raise click.BadParameter(msg.removeprefix("--seeds: "), param_hint="--seeds") from None


def _load_config(path: str | None) -> ExperimentConfig:
    return cfgmod.load(path) if path else cfgmod.default()


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------
def _pct(row: dict[str, Any], key: str) -> str:
    x = row[key]
    return "—" if x is None or row["scheme"] == "ecmp" else f"{-100 * x:+.1f}%"


def _summary_table(rows: Sequence[dict[str, Any]]) -> Table:
    t = Table(title="ARK vs ECMP (mean over seeds; Δ = change versus ECMP, negative is better)")
    for col in ("QPS", "scheme", "mean FCT", "Δ", "P95 FCT", "Δ", "mean TTFT", "Δ", "P95 TTFT", "Δ", "max flows/spine"):
        t.add_column(col, justify="right" if col not in ("scheme",) else "left")
    order = {s: i for i, s in enumerate(SCHEMES)}
    rows = sorted(rows, key=lambda r: (r["qps"], order.get(r["scheme"], 99)))
    last_q = None
    for r in rows:
        if last_q is not None and r["qps"] != last_q:
            t.add_section()
        last_q = r["qps"]
        t.add_row(
            f"{r['qps']:g}", r["scheme"],
            f"{r['fct_mean_s'] * 1e3:.0f} ms", _pct(r, "fct_mean_reduction"),
            f"{r['fct_p95_s'] * 1e3:.0f} ms", _pct(r, "fct_p95_reduction"),
            f"{r['ttft_mean_s'] * 1e3:.0f} ms", _pct(r, "ttft_mean_reduction"),
            f"{r['ttft_p95_s'] * 1e3:.0f} ms", _pct(r, "ttft_p95_reduction"),
            ",".join(map(str, r["max_concurrent_per_spine"])),
        )
    return t


def _run_and_report(cfg: ExperimentConfig, out_dir: str, jobs: int, plots: bool, as_json: bool) -> None:
    from ark.sim.experiment import plan, run_sweep, summarize, write_results

    n = len(plan(cfg))
    with Progress(
        TextColumn("[bold]simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=err, transient=True, disable=as_json,
    ) as prog:
        task = prog.add_task("", total=n)

        def tick(sp: Any) -> None:
            prog.update(task, advance=1, description=f"{sp.scheme} qps={sp.qps:g} seed={sp.seed}")

        sweep = run_sweep(cfg, jobs=jobs, progress=tick)
    files = write_results(out_dir, sweep, cfg)
    summary = summarize(sweep.records)
    if plots:
        from ark.cli import plots as plotmod

        od = Path(out_dir)
        files.append(plotmod.fct_vs_qps(sweep.records, od))
        files.append(plotmod.ttft_vs_qps(sweep.records, od))
        p = plotmod.spine_concurrency(sweep.timelines, sweep.timeline_qps, od)
        if p is not None:
            files.append(p)
    if as_json:
        click.echo(json.dumps({"summary": summary, "files": [str(f) for f in files]}, indent=1))
        return
    out.print(_summary_table(summary))
    mism = sum(r["path_mismatches"] for r in sweep.records)
    races = sum(r["races"] for r in sweep.records)
    out.print(f"path mismatches (reserved spine != switch hash): {mism}; races resolved: {races}")
    out.print("wrote: " + ", ".join(str(f) for f in files))


# ---------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ark-fabric", prog_name="ark")
def cli() -> None:
    """ARK: host-side path reservation for KV-cache flows on ECMP fabrics."""


def _jobs_default() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@cli.command()
@click.option("--qps", "qps", help="Comma-separated loads, e.g. 1,5,10 (default: 1,5,10,15,20,25,30).")
@click.option("--requests", type=click.IntRange(min=1), help="Requests per run (default 1000).")
@click.option("--seeds", help="Seed count N (seeds 0..N-1) or a list like 0,4,7 (default 3).")
@click.option("--schemes", help=f"Comma-separated subset of {','.join(SCHEMES)}.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config (default: the paper's setup).")
@click.option("--out", "out_dir", default="ark-results", show_default=True, help="Output folder.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Worker processes (default: CPU count).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG figures.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
def reproduce(
    qps: str | None, requests: int | None, seeds: str | None, schemes: str | None,
    config_path: str | None, out_dir: str, jobs: int | None, no_plots: bool, as_json: bool,
) -> None:
    """Reproduce the published ECMP-vs-ARK experiment (FCT and TTFT over QPS)."""
    cfg = _load_config(config_path).with_overrides(
        qps=_qps_list(qps), requests=requests, seeds=_seeds(seeds), schemes=_schemes(schemes)
    )
    _run_and_report(cfg, out_dir, jobs or _jobs_default(), not no_plots, as_json)


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), required=True, help="TOML scenario.")
@click.option("--out", "out_dir", default="ark-results", show_default=True, help="Output folder.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Worker processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def simulate(config_path: str, out_dir: str, jobs: int | None, as_json: bool) -> None:
    """Run the scenario of one config file; prints and writes the same metrics."""
    cfg = _load_config(config_path)
    _run_and_report(cfg, out_dir, jobs or _jobs_default(), False, as_json)


@cli.command()
@click.option("--hash", "hash_name", type=click.Choice(list(HASH_MODELS)), required=True, help="Switch hash model.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True, help="Switch hash seed.")
@click.option("--src", required=True, help="Source IPv4 address.")
@click.option("--dst", required=True, help="Destination IPv4 address.")
@click.option("--dport", type=click.IntRange(0, 65535), default=4791, show_default=True)
@click.option("--paths", type=click.IntRange(min=1), required=True, help="Equal-cost next hops K.")
@click.option("--port-range", default="49152-65535", show_default=True, help="Source ports LO-HI.")
@click.option("--selection", type=click.Choice(list(HASH_SELECTIONS)), default="modulo", show_default=True)
@click.option("--proto", type=click.IntRange(0, 255), default=17, show_default=True, help="IP protocol (17 UDP/RoCEv2, 6 TCP).")
@click.option("--json", "as_json", is_flag=True, help="Print every port per path as JSON.")
@click.option("--save", type=click.Path(dir_okay=False), help="Also write the map file an agent loads (cluster pathmap_dir).")
def pathmap(
    hash_name: str, seed: int, src: str, dst: str, dport: int, paths: int, port_range: str,
    selection: str, proto: int, as_json: bool, save: str | None,
) -> None:
    """Which source ports the switch hash sends over each path."""
    try:
        rng = parse_port_range(port_range)
    except PathMapError as e:
        raise click.BadParameter(str(e).removeprefix("port-range: "), param_hint="--port-range") from None
    pm = compute_buckets(hash_name, seed, src, dst, dport, paths, rng, selection, proto)
    if save:
        pm.save(save)
    if as_json:
        click.echo(json.dumps({
            "hash": hash_name, "seed": seed, "paths": paths,
            "ports": {str(k): b.tolist() for k, b in enumerate(pm.buckets)},
        }))
        return
    t = Table(title=f"{hash_name} seed={seed} {src} -> {dst}:{dport} ports {rng[0]}-{rng[1]} ({selection})")
    t.add_column("path", justify="right")
    t.add_column("ports", justify="right")
    t.add_column("share", justify="right")
    t.add_column("first ports")
    total = sum(pm.counts())
    for k, b in enumerate(pm.buckets):
        t.add_row(str(k), str(len(b)), f"{100 * len(b) / total:.1f}%", ",".join(map(str, b[:5].tolist())))
    out.print(t)


@cli.group()
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

    cfg = cfgmod.default().with_overrides(qps=_qps_list(qps), requests=requests, seeds=_seeds(seeds))
    res = bench_rep(cfg, jobs or _jobs_default())
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    out.print(
        f"{res['runs']} runs x {res['requests_per_run']} requests on {res['jobs']} workers: "
        f"{res['wall_s']:.2f} s wall, {res['events']} events, {res['events_per_s']:.0f} events/s "
        f"(target: <= 20 s for the default sweep on 2 cores)"
    )


# ---------------------------------------------------------------------------------------
# agents
# ---------------------------------------------------------------------------------------
def _cluster(path: str) -> Any:
    from ark.agent import cluster as clmod

    return clmod.load(path)


@cli.command()
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False), help="Cluster TOML.")
@click.option("--host", required=True, help="This host's name in the cluster file.")
@click.option("--secret-key", type=click.Path(dir_okay=False), help="CURVE secret key file (default: from the cluster file).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def agent(cluster_path: str, host: str, secret_key: str | None, log_level: str) -> None:
    """Run this host's ARK agent (JSON logs on stderr)."""
    from ark.agent.daemon import run_agent

    run_agent(_cluster(cluster_path), host, secret_key, log_level)


@cli.command()
@click.option("--out", "out_dir", default="keys", show_default=True, help="Folder for the key files.")
@click.option("--name", required=True, help="Key name (usually the host name).")
def keygen(out_dir: str, name: str) -> None:
    """Write a CURVE key pair: NAME.key (public) and NAME.key_secret."""
    import zmq.auth

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pub_file, sec_file = zmq.auth.create_certificates(out_dir, name)
    os.chmod(sec_file, 0o600)
    pub, _ = zmq.auth.load_certificate(pub_file)
    out.print(f"public_key = \"{pub.decode()}\"  (secret: {sec_file})", highlight=False)


def _client_for(cluster_path: str, host: str) -> Any:
    from ark.agent.client import ArkClient

    return ArkClient(_cluster(cluster_path).host(host).api, timeout_s=2.0)


@cli.command()
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False))
@click.option("--host", required=True)
@click.option("--json", "as_json", is_flag=True)
def status(cluster_path: str, host: str, as_json: bool) -> None:
    """This host's view: peers up or down, reserved links, counters."""
    from ark.agent.client import ArkClientError

    with _client_for(cluster_path, host) as c:
        try:
            st = c.status()
        except ArkClientError as e:
            raise click.ClickException(f"agent {host}: {e}") from None
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    out.print(f"[bold]{st['name']}[/] (id {st['host']}, incarnation {st['incarnation']}): "
              f"{'ready' if st['ready'] else 'resynchronising'}; {st['reservations']} reservations, "
              f"{len(st['reserved_links'])} reserved links, {st['local_flows']} local flows, digest {st['digest']}")
    t = Table(title="peers")
    for col in ("peer", "up", "synced", "last heard (s ago)", "last seq"):
        t.add_column(col)
    for name, p in st["peers"].items():
        t.add_row(name, "up" if p["up"] else "[red]down[/]", str(p["synced"]), str(p["last_heard_s_ago"]), str(p["last_seq"]))
    out.print(t)
    t = Table(title="counters")
    t.add_column("counter")
    t.add_column("value", justify="right")
    for k, v in {**st["core"], **st["node"]}.items():
        t.add_row(k, str(v))
    out.print(t)


@cli.command()
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False))
@click.option("--host", required=True, help="This host.")
@click.option("--peer", required=True, help="Destination host.")
@click.option("--dport", type=click.IntRange(0, 65535), default=None, help="Destination port (default: the cluster's).")
def ports(cluster_path: str, host: str, peer: str, dport: int | None) -> None:
    """A static port list (one source port per path), for MC_MLX5_QP_UDP_SPORTS-style settings."""
    cl = _cluster(cluster_path)
    me, other = cl.host(host), cl.host(peer)
    pm = cl.pathmaps()(me.index, other.index, cl.dport if dport is None else dport)
    click.echo(",".join(str(p) for p in pm.static_ports() if p >= 0))


@cli.command("cluster")
@click.option("--agents", type=click.IntRange(2, 64), default=16, show_default=True)
@click.option("--flows", type=click.IntRange(min=1), default=5000, show_default=True, help="Reserve+release cycles.")
@click.option("--kill", type=click.IntRange(min=0), default=0, show_default=True, help="Agents to SIGKILL halfway and restart.")
@click.option("--lease", "lease_min_s", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Minimum lease (s).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def cluster_cmd(agents: int, flows: int, kill: int, lease_min_s: float, seed: int, as_json: bool) -> None:
    """Start N real agents on loopback, drive reserve/release cycles, report."""
    from ark.agent.loopback import run_cluster

    if kill >= agents:
        raise click.BadParameter(f"must be below --agents ({agents})", param_hint="--kill")
    res = run_cluster(agents, flows, kill, seed=seed, lease_min_s=lease_min_s)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    t = Table(title=f"{agents} agents on loopback, {flows} reserve+release cycles, {kill} killed")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in res.items():
        t.add_row(k, str(v))
    out.print(t)


from ark.cli.testbed import probe_cmd, testbed  # noqa: E402 - registers after the shared helpers

cli.add_command(probe_cmd)
cli.add_command(testbed)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: every user error becomes one line on stderr and a non-zero exit."""
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="ark", standalone_mode=False)
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except click.Abort:
        err.print("aborted", highlight=False)
        return 130
    except click.ClickException as e:
        click.echo(f"ark: error: {e.format_message()}", err=True)
        return e.exit_code if e.exit_code else 2
    except USER_ERRORS as e:
        click.echo(f"ark: error: {e}", err=True)
        return 2
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
