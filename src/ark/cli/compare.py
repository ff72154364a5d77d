"""``ark compare``: every scheme on the same workloads, the decision table, the figures."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import (
    OutFolder,
    jobs_default,
    jobs_option,
    load_config,
    out,
    qps_list,
    run_progress,
    schemes_opt,
    seeds_option,
)
from ark.cli.experiment import start_note, steady_and_verdict
from ark.sim.failure import parse_link_change


def _pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{100 * x:+.1f}%"


def _ratio(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.3f}"  # nan: spray was not run


def _ms(x: float) -> str:
    return "—" if math.isnan(x) else f"{x * 1e3:.0f} ms"  # nan: no flow in that group


def fct_rich(rows: Sequence[dict[str, Any]], schemes: Sequence[str]) -> Table:
    t = Table(title="mean FCT per scheme (mean over seeds); x = ratio to the ideal spray, Δ = change versus ECMP")
    for c in ("QPS", "scheme", "mean FCT", "x spray", "Δ ECMP", "P95 FCT", "P99 FCT"):
        t.add_column(c, justify="left" if c == "scheme" else "right")
    order = {s: i for i, s in enumerate(schemes)}
    last = None
    for r in sorted(rows, key=lambda r: (r["qps"], order.get(r["scheme"], 99))):
        if last is not None and r["qps"] != last:
            t.add_section()
        last = r["qps"]
        t.add_row(f"{r['qps']:g}", r["scheme"], _ms(r["fct_mean_s"]), _ratio(r["x_spray"]),
                  "—" if r["scheme"] == "ecmp" else _pct(r["vs_ecmp"]), _ms(r["fct_p95_s"]),
                  _ms(r["fct_p99_s"]))
    return t


def decision_rich(dec: Sequence[dict[str, Any]]) -> Table:
    t = Table(title="which scheme at which load (spray and oracle-path are bounds, not deployable)")
    for c in ("QPS", "best", "as good (within 5%)", "best ARK", "x spray", "Δ ECMP", "best other", "x spray"):
        t.add_column(c, justify="right" if c in ("QPS", "x spray", "Δ ECMP") else "left")
    for d in dec:
        t.add_row(f"{d['qps']:g}", d["best"], ", ".join(d["as_good"]), d["best_ark"] or "—",
                  _ratio(d["best_ark_x_spray"]), _pct(d["best_ark_vs_ecmp"]), d["best_other"] or "—",
                  _ratio(d["best_other_x_spray"]))
    return t


def failure_rich(rows: Sequence[dict[str, Any]], label: str) -> Table:
    t = Table(title=f"link change: {label} (flows by start time)")
    for c in ("QPS", "scheme", "before", "during", "after", "stale", "re-reserved", "mismatches after rebuild"):
        t.add_column(c, justify="left" if c == "scheme" else "right")
    for r in rows:
        t.add_row(f"{r['qps']:g}", r["scheme"], *(_ms(r[f"fct_{p}_s"]) for p in ("before", "during", "after")),
                  str(r["stale"]), str(r["rebuild_repathed"]), str(r["mismatches_after_rebuild"]))
    return t


def paired_rich(rows: Sequence[dict[str, Any]]) -> Table:
    from ark.sim.compare import paired_cells

    t = Table(title=f"mean FCT against ECMP and spray, paired over seeds ({rows[0]['level']:.0%} bootstrap "
                    "intervals; too narrow with few seeds: see docs/simulator.md)")
    for c in ("QPS", "scheme", "against", "seeds", "Δ mean (ms) [CI]", "ratio [CI]", "verdict"):
        t.add_column(c, justify="right" if c in ("QPS", "seeds") else "left")
    last = None
    for r in rows:
        if last is not None and (r["baseline"], r["qps"]) != last:
            t.add_section()
        last = (r["baseline"], r["qps"])
        t.add_row(f"{r['qps']:g}", r["scheme"], r["baseline"], str(r["n"]), *paired_cells(r), r["verdict"])
    return t


def _plots(comp: Any, od: Path) -> list[Path]:
    from ark.cli import plots
    from ark.sim.compare import detail_qps, slowdown

    cfg = comp.cfg
    nic = cfg.fabric.build().hosts[0].nic_bps * cfg.fabric.build().efficiency / 8
    files = [plots.compare_fct(comp.records, od), plots.fct_cdf(comp.sweep.flows, od)]
    sl = plots.slowdown(slowdown(comp.sweep, nic, detail_qps(cfg)), od, plots.seeds_text(comp.records))
    return files + ([sl] if sl is not None else [])


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), show_default="the paper's setup",
              help="TOML config.")
@click.option("--set", "sets", multiple=True, metavar="TABLE.KEY=VALUE", show_default="none",
              help="Override one config value, e.g. serving.kv_transfer=per-layer or params.split.parts=2 (repeat).")
@schemes_opt("every scheme the fabric can run")
@click.option("--fail-link", "fail_link", metavar="L:S@T[:FRACTION]", show_default="none",
              help="Link leaf L - spine S fails at T seconds (or drops to FRACTION of its rate).")
@click.option("--qps", "qps", show_default="the config's", help="Comma-separated loads (requests per second).")
@click.option("--requests", type=click.IntRange(min=1), show_default="the config's",
              help="Requests per run (a run too short to be steady is named, with a count that would do).")
@click.option("--seeds", show_default="the config's", help="Seed count N (seeds 0..N-1) or a list like 0,4,7.")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-compare", show_default=True,
              help="Output folder (created).")
@jobs_option()
@click.option("--no-plots", is_flag=True, help="Skip the PNG figures.")
@click.option("--figures", "fig_dir", type=OutFolder(), show_default="--out", help="Write the figures here.")
@click.option("--json", "as_json", is_flag=True, help="Print the tables as JSON.")
def compare(config_path: str | None, sets: tuple[str, ...], schemes: tuple[str, ...] | None, fail_link: str | None,
            qps: str | None, requests: int | None, seeds: str | None, out_dir: str, jobs: int | None, no_plots: bool,
            fig_dir: str | None, as_json: bool) -> None:
    """Every baseline, ARK policy and the ideal spray on the same workloads: FCT tables,
    CDFs, slowdown against size and the "which scheme at which load" summary (results.md)."""
    from ark.sim.compare import compare_config, run_compare, write_compare

    if no_plots and fig_dir:
        raise click.BadParameter("there are none to write with --no-plots", param_hint="--figures")
    from ark.sim.experiment import plan

    cfg = load_config(config_path, sets).with_overrides(
        qps=qps_list(qps), requests=requests, seeds=seeds_option(seeds),
        failure=parse_link_change(fail_link) if fail_link else None)
    cfg = compare_config(cfg, schemes)
    start_note(cfg, jobs or jobs_default(), keep_flows=True)
    with run_progress(len(plan(cfg)), disable=as_json) as tick:
        comp = run_compare(cfg, jobs or jobs_default(), tick)
    files = write_compare(out_dir, comp)
    if not no_plots:
        fd = Path(fig_dir or out_dir)
        fd.mkdir(parents=True, exist_ok=True)
        files += _plots(comp, fd)
    rows, dec, fail, pairs = comp.summary, comp.decisions, comp.failure, comp.paired
    if as_json:
        steady_and_verdict(comp.records, True)
        click.echo(json.dumps({"summary": rows, "decisions": dec, "failure": fail, "paired": pairs,
                               "files": [str(f) for f in files]}, indent=1))
        return
    out.print(fct_rich(rows, cfg.schemes))
    out.print(decision_rich(dec))
    if cfg.failure is not None and fail:
        order = {s: i for i, s in enumerate(cfg.schemes)}
        out.print(failure_rich(sorted(fail, key=lambda r: (r["qps"], order[r["scheme"]])), cfg.failure.label()))
    if pairs and max(r["n"] for r in pairs) >= 2:
        out.print(paired_rich(pairs))
    elif pairs:
        out.print("paired over seeds: one seed, no interval (--seeds N; about 10 or more for a useful one)")
    steady_and_verdict(comp.records, False)
    out.print("wrote: " + ", ".join(str(f) for f in files))
