"""``ark testbed ...``: the namespace fabric (up, down, status, link, probe, run, roce-check)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import FiniteRange, InOrder, OutFile, err, out, schemes_opt, seeds_option

TB_HELP_DIR = "State folder of the testbed (its namespaces, links and agents)."
TB_DIR_DEFAULT = "/run/ark-testbed, or $ARK_TESTBED_DIR"


def _spec(config_path: str | None, **kw: Any) -> Any:
    from ark.sim import config as cfgmod
    from ark.testbed.fabric import TestbedSpec

    if config_path is None:
        return TestbedSpec(**kw)
    return TestbedSpec.from_fabric_config(cfgmod.load(config_path).fabric, **kw)


def _state(prefix: str, base: str | None) -> Any:
    from ark.testbed.fabric import State, state_dir

    return State.load(state_dir(prefix, base))


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


@click.group(cls=InOrder, order=("up", "probe", "run", "link", "status", "roce-check", "down"))
def testbed() -> None:
    """A real spine-leaf or 3-tier Clos fabric in network namespaces (root): up, run, down."""


@testbed.command("up")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), show_default="the paper's", help="Experiment TOML whose [fabric] to build.")
@click.option("--scale", type=float, default=1e-3, show_default=True, help="Rate and flow-size factor (100 Gbit/s -> 100 Mbit/s).")
@click.option("--hash-policy", type=click.Choice(["headers", "l4"]), default="headers", show_default=True,
              help="headers: 5-tuple from packet headers (policy 3); l4: kernel policy 1.")
@click.option("--queue-ms", type=float, default=20.0, show_default=True, help="Per-link queue, in ms at the scaled rate.")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of every namespace.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def tb_up(config_path: str | None, scale: float, hash_policy: str, queue_ms: float, prefix: str,
          state_dir: str | None, as_json: bool) -> None:
    """Build the fabric: namespaces, veths, multipath routes, rate limits, management bridge."""
    from ark.testbed import fabric as tb

    st = tb.up(_spec(config_path, scale=scale, hash_policy=hash_policy, queue_ms=queue_ms, prefix=prefix), state_dir)
    info = tb.status(prefix, state_dir)
    if as_json:
        click.echo(json.dumps(info))
    else:
        s = st.spec
        shape = (f"{s.pods} pods x {s.leaves // s.pods} leaves x {s.gpus_per_leaf} hosts, {s.aggs_per_pod} aggregation "
                 f"switches per pod, {s.spines} cores" if s.three_tier
                 else f"{s.leaves} leaves x {s.spines} spines x {s.gpus_per_leaf} hosts")
        out.print(f"testbed {prefix!r} up in {st.built_s:.2f} s: {len(st.namespaces)} namespaces, {shape}, links "
                  f"{s.link_gbps * s.scale * 1e3:g} Mbit/s, hash policy {s.hash_policy}; state in {st.dir}")


@testbed.command("down")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
def tb_down(prefix: str, state_dir: str | None) -> None:
    """Remove everything `up` created (also after a crash; idempotent)."""
    from ark.testbed import fabric as tb

    removed = tb.down(prefix, state_dir)
    out.print(f"removed {len(removed)} namespaces" if removed else "nothing to remove")


@testbed.command("status")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
def tb_status(prefix: str, state_dir: str | None) -> None:
    """What the state file lists, and what of it is missing."""
    from ark.testbed import fabric as tb

    click.echo(json.dumps(tb.status(prefix, state_dir), indent=1))


@testbed.command("link")
@click.argument("leaf", type=click.IntRange(min=0))
@click.argument("spine", type=click.IntRange(min=0))
@click.argument("state", type=click.Choice(["up", "down"]))
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
def tb_link(leaf: int, spine: int, state: str, prefix: str, state_dir: str | None) -> None:
    """Take the LEAF-SPINE link down or bring it back (the kernel re-hashes)."""
    from ark.testbed import fabric as tb

    tb.set_link(_state(prefix, state_dir), leaf, spine, state == "up")
    out.print(f"leaf{leaf}-spine{spine} {state}")


@testbed.command("probe")
@click.option("--sample", type=click.IntRange(min=0), default=128, show_default=True,
              help="Source ports probed per peer (0: all).")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def tb_probe(sample: int, prefix: str, state_dir: str | None, as_json: bool) -> None:
    """Every prefill host probes every decode host; maps are checked against the kernel."""
    from ark.testbed.probing import probe

    st = _state(prefix, state_dir)
    fab = st.spec.fabric()
    pairs = {s: {d for d in fab.role_hosts("decode") if fab.n_paths(s, d) > 1} for s in fab.role_hosts("prefill")}
    res = probe(st, {s: ds for s, ds in pairs.items() if ds}, sample)
    res.pop("per_host")
    if as_json:
        click.echo(json.dumps(_clean(res)))
    else:
        out.print(f"{res['probes_sent']} probes, {res['probe_wall_s']} s wall ({res['probe_host_s']} s summed over hosts); "
                  f"{res['probed_ports']} mapped ports agree with the kernel: {res['probe_agreement_fraction']:.4%}")


@testbed.command("roce-check")
@click.option("--per-spine", type=click.IntRange(1, 64), default=2, show_default=True, help="Leased ports (QPs) per spine.")
@click.option("--iters", type=click.IntRange(1, 10**6), default=200, show_default=True, help="RDMA writes per QP.")
@click.option("--size", type=click.IntRange(1, 1 << 30), default=4096, show_default=True, help="Bytes per write.")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def tb_roce_check(per_spine: int, iters: int, size: int, prefix: str, state_dir: str | None, as_json: bool) -> None:
    """RoCEv2 on the wire: Soft-RoCE writes under the verbs interposer, each QP's port and
    spine checked at the spines (2-tier testbed, Linux >= 5.17 with rdma_rxe; otherwise it
    says why in one line and exits 0)."""
    from ark.integrations import rocewire

    why = rocewire.why_not()
    if why:
        click.echo(f"roce-wire-check: skipped: {why}")
        return
    from ark.integrations.verbs import VerbsError
    from ark.testbed.roce import WireCheck, WireCheckError, report_lines, run

    try:
        result = run(_state(prefix, state_dir), WireCheck(per_spine, iters, size))
    except (WireCheckError, VerbsError) as e:
        raise click.ClickException(f"roce-check: {e}") from None
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        for line in report_lines(result):
            click.echo(line)
    if not result["pass"]:
        raise SystemExit(1)


@testbed.command("run")
@click.option("--requests", type=click.IntRange(min=1), default=150, show_default=True, help="Requests per run.")
@click.option("--qps", type=FiniteRange(min=0, min_open=True), default=20.0, show_default=True,
              help="Requests per second.")
@schemes_opt("ecmp,ark", ("ecmp", "ark", "ark-balance", "ark-split"))
@click.option("--seeds", default="10", show_default=True,
              help="Seed count N (seeds 0..N-1) or a list like 0,4,7; ten give intervals that mostly cover (docs/testbed.md).")
@click.option("--sample", type=click.IntRange(min=0), default=128, show_default=True, help="Probed ports per peer.")
@click.option("--fail-link", show_default="none", help="LEAF:SPINE@SECONDS: take that link down mid-run; hosts re-probe, agents reload.")
@click.option("--engine", type=click.Choice(["builtin", "mooncake", "vllm"]), default="builtin", show_default=True,
              help="Who moves the bytes: the testbed's TCP senders, Mooncake Transfer Engines (the mooncake extra), "
                   "or vLLM prefill/decode instances with the builtin flows as background (the vllm extra).")
@click.option("--instances", type=click.IntRange(1, 8), default=2, show_default=True,
              help="vllm: prefill instances on the first leaf and as many decode instances on the last.")
@click.option("--vllm-requests", type=click.IntRange(1, 10_000), default=12, show_default=True,
              help="vllm: requests per run through the P/D router, spread over the background's span (12 of "
                   "200-1000 tokens load the prefill hosts' NICs to about half with their KV caches).")
@click.option("--vllm-poll-s", type=FiniteRange(0.0, 0.1), default=0.0, show_default=True,
              help="vllm: seconds between status checks of a prefill instance's push (0: Mooncake's synchronous "
                   "write, which keeps a core busy while a push is in flight).")
@click.option("--buffers", type=click.IntRange(1, 256), default=1, show_default=True,
              help="mooncake: requests per KV flow (the engine opens one connection per request).")
@click.option("--parts", type=click.IntRange(0, 16), default=0, show_default=True,
              help="ark-split: parts of each flow's multi-path lease (0: the agent's choice, one per path here).")
@click.option("--ecmp-agents/--no-ecmp-agents", default=True, show_default=True,
              help="Start the agents in ECMP runs too, unused, so that every scheme pays their CPU on this shared "
                   "machine (off: ECMP runs without agents, an unfair control).")
@click.option("--control", type=click.Choice(["broadcast", "arbiter"]), default="broadcast", show_default=True,
              help="arbiter: the agents keep no replica and ask a primary and a standby arbiter (run in the first "
                   "and the last host's namespace).")
@click.option("--out", "out_file", type=OutFile(), show_default="none",
              help="Also write every record (flows included) as JSON.")
@click.option("--prefix", default="ark", show_default=True, help="Name prefix of the testbed's namespaces.")
@click.option("--state-dir", show_default=TB_DIR_DEFAULT, help=TB_HELP_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print the record (a list when several runs) as JSON.")
def tb_run(requests: int, qps: float, schemes: tuple[str, ...] | None, seeds: str, sample: int, fail_link: str | None,
           engine: str, instances: int, vllm_requests: int, vllm_poll_s: float, buffers: int, parts: int, ecmp_agents: bool, control: str,
           out_file: str | None, prefix: str, state_dir: str | None, as_json: bool) -> None:
    """Real KV flows over the fabric: FCT per scheme, and whether ARK flows crossed their reserved spines."""
    from ark.testbed import run as tr

    seed_list = seeds_option(seeds) or (0,)
    failure = _fail_link(fail_link) if fail_link else None
    st = _state(prefix, state_dir)
    progress = (lambda m: err.print(f"[dim]{m}[/]", highlight=False)) if not as_json else (lambda m: None)
    runs = [tr.RunParams(scheme=scheme, requests=requests, qps=qps, seed=seed, sample=sample, fail_link=failure,
                         engine=engine, buffers=buffers, parts=parts, ecmp_agents=ecmp_agents, control=control)
            for seed, scheme in tr.interleaved(seed_list, schemes or ("ecmp", "ark"))]
    for p in runs:
        p.check(st)
    if engine == "vllm":
        _vllm_runs(st, runs, instances, vllm_requests, vllm_poll_s, out_file, as_json, progress)
        return
    records = [tr.run(st, p, progress=progress) for p in runs]
    from ark.testbed.summary import summarize

    summary = summarize(records)
    if out_file:
        Path(out_file).write_text(json.dumps(_clean({"runs": records, **summary}), indent=1))
    if as_json:
        click.echo(json.dumps(_clean(records[0] if len(records) == 1 else {"runs": records, **summary})))
        return
    who = "" if engine == "builtin" else f", Mooncake engines ({buffers} request(s) per flow)"
    who += ", agents asking arbiters" if control == "arbiter" else ""
    t = Table(title=f"testbed: {requests} requests at QPS {qps:g} (offered load {records[0]['offered_load']:.2f}), "
                    f"links {records[0]['link_mbps']:g} Mbit/s{who}")
    cols = ["scheme", "seed", "mean FCT s", "P95 FCT s", "sim mean s", "CPU busy", "errors", "flows/spine",
            "path match", "probes", "probe agree"] + (["cross pod"] if st.spec.three_tier else [])
    for col in cols + (["bytes verified"] if engine == "mooncake" else []):
        t.add_column(col, justify="right")
    for r in records:
        pm = r["path_match_fraction"]
        busy = f"{r['cpu_busy_fraction']:.0%}" + (" SATURATED" if r["cpu_saturated"] else "")
        no_agents = r["scheme"] == "ecmp" and not r["ecmp_agents"]
        row = [r["scheme"] + (" (no agents)" if no_agents else ""), str(r["seed"]), f"{r['fct_mean_s']:.4f}",
               f"{r['fct_p95_s']:.4f}", f"{r['sim']['fct_mean_s']:.4f}", busy, str(r["errors"]),
               str(r["flows_per_spine"]), "-" if pm is None else f"{pm:.2%} of {r['path_checked']}",
               str(r["probes_sent"]), f"{r['probe_agreement_fraction']:.4%}"]
        if st.spec.three_tier:
            row.append(f"{r['flows_cross_pod'] / max(1, r['requests']):.0%}")
        if engine == "mooncake":
            row.append(f"{r['bytes_verified_fraction']:.2%} ({r['flows_verified']} flows)")
        t.add_row(*row)
    out.print(t)
    _print_summary(summary)
    for r in records:
        ch = r.get("fabric_change")
        if ch and "error" in ch:
            err.print(f"{r['scheme']} seed {r['seed']}: the fabric change failed: {ch['error']}", highlight=False)
        elif ch:
            how = (f"{len(ch['detected_at_s'])} agents detected the re-hash themselves"
                   + (f", {len(ch['told_to_refresh'])} were told" if ch.get("told_to_refresh") else "")
                   if "detected_at_s" in ch else "hosts re-probed")
            out.print(f"{r['scheme']} seed {r['seed']}: link leaf{ch['link'][0]}-spine{ch['link'][1]} down at "
                      f"{ch['failed_at_s']:.2f} s, maps refreshed at {ch['refreshed_at_s']:.2f} s ({how}; "
                      f"{ch['probes_sent']} probes, agreement {ch['probe_agreement_fraction']:.4%}); "
                      f"{ch['repathed_live_flows']} live reservations re-pathed; flows started after the refresh "
                      f"matching their reserved spine: {ch['path_match_after_refresh']:.2%} of {ch['flows_after_refresh']}")


def _vllm_runs(st: Any, runs: list[Any], instances: int, n_requests: int, poll_s: float, out_file: str | None,
               as_json: bool, progress: Any) -> None:
    """``--engine vllm``: one fleet of instances for every run, then the TTFT comparison."""
    from ark.sim.compare import paired_cells
    from ark.sim.stats import paired_rows
    from ark.testbed import vllm as tv
    from ark.testbed.plan import cluster_file

    try:
        from ark.integrations.vllm_model import make_model
    except ImportError as e:
        raise click.ClickException(f"engine vllm: {e}") from None
    model = st.dir / "vllm-model"
    if not (model / "config.json").exists():
        make_model(model)
    prefill, decode = tv.fleet_hosts(st, instances)
    fleet = tv.Fleet(st, model, prefill, decode, cluster_file(st, "ark", runs[0].lease_min_s, runs[0].sample, 0.0),
                     st.dir / "vllm", poll_s=poll_s)
    try:
        fleet.start(progress)
        records = [tv.run(st, p, fleet, n_requests, progress) for p in runs]
    finally:
        fleet.stop()
    rows = paired_rows(records, "ttft_mean_s")
    if out_file:
        Path(out_file).write_text(json.dumps(_clean({"runs": records, "paired_ttft": rows}), indent=1))
    if as_json:
        click.echo(json.dumps(_clean({"runs": records, "paired_ttft": rows})))
        return
    t = Table(title=f"vLLM P/D on the testbed: {n_requests} requests per run, {instances} prefill and {instances} "
                    f"decode instances, background {runs[0].requests} flows at QPS {runs[0].qps:g}")
    for col in ("scheme", "seed", "TTFT mean/P50/P95 s", "TPOT mean s", "mismatches", "errors", "pushes",
                "push mean s", "push path match", "background FCT s", "CPU busy"):
        t.add_column(col, justify="right")
    for r in records:
        pm = r["push_path_match_fraction"]
        t.add_row(r["scheme"], str(r["seed"]), f"{r['ttft_mean_s']:.3f}/{r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f}",
                  f"{r['tpot_mean_s']:.4f}", str(r["output_mismatches"]), str(r["vllm_errors"]), str(r["push_count"]),
                  f"{r['push_mean_s']:.3f}", "-" if pm is None else f"{pm:.0%} of {r['push_path_checked']}",
                  f"{r['fct_mean_s']:.3f}", f"{r['cpu_busy_fraction']:.0%}")
    out.print(t)
    if rows:
        t = Table(title="mean TTFT against ECMP, paired by seed, 95% bootstrap intervals")
        for col in ("scheme", "seeds", "mean diff ms", "ratio", "verdict"):
            t.add_column(col, justify="right")
        for row in rows:
            d, ratio = paired_cells(row)
            t.add_row(row["scheme"], str(row["n"]), d, ratio, row["verdict"])
        out.print(t)


def _print_summary(summary: dict[str, Any]) -> None:
    """The paired comparison (measured beside simulated) and where the FCT goes."""
    from ark.sim.compare import paired_cells
    from ark.testbed.summary import PARTS

    rows = summary["paired"]
    if rows:
        t = Table(title="against ECMP, paired by seed: mean FCT difference and ratio, 95% bootstrap intervals")
        for col in ("scheme", "seeds", "per-seed change", "mean diff ms", "ratio", "verdict", "simulator"):
            t.add_column(col, justify="right")
        for row in rows:
            d, ratio = paired_cells(row)
            per_seed = ", ".join(f"{x:+.1%}" for x in row["rel_by_seed"])
            t.add_row(row["scheme"], str(row["n"]), per_seed, d, ratio, row["verdict"], row["sim_verdict"])
        out.print(t)
    t = Table(title="where the mean FCT goes, s (thread wake-up late, lease, lease to connected, transfer)")
    for col in ("scheme", *PARTS):
        t.add_column(col, justify="right")
    for scheme, parts in summary["parts"].items():
        t.add_row(scheme, *(f"{parts[k]:.4f}" for k in PARTS))
    out.print(t)
    for r in summary["saturated"]:
        err.print(f"{r['scheme']} seed {r['seed']}: the cores were {r['cpu_busy_fraction']:.0%} busy: this run "
                  "measured the machine more than the fabric", highlight=False)


def _fail_link(text: str) -> tuple[int, int, float]:
    """``L:S@T``, parsed as the simulator's ``--fail-link``; a namespace link is up or down."""
    from ark.sim.failure import FailureError, parse_link_change

    try:
        d = parse_link_change(text)
    except FailureError as e:
        raise click.BadParameter(str(e).removeprefix("--fail-link: "), param_hint="--fail-link") from None
    if d["fraction"] != 0.0:
        raise click.BadParameter(f"a testbed link goes down, it cannot degrade: expected LEAF:SPINE@SECONDS; "
                                 f"got {text!r}", param_hint="--fail-link")
    if not math.isfinite(d["at_s"]) or d["at_s"] < 0:
        raise click.BadParameter(f"SECONDS must be a finite number >= 0; got {text!r}", param_hint="--fail-link")
    return int(d["leaf"]), int(d["spine"]), float(d["at_s"])


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return _finite(obj)
