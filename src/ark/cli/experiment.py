"""``ark reproduce`` and ``ark simulate``: sweeps, their tables, files and figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import (
    OutFolder,
    check_sweep_size,
    err,
    jobs_default,
    jobs_option,
    load_config,
    out,
    qps_list,
    run_progress,
    schemes_opt,
    seeds_option,
)
from ark.sim.config import ExperimentConfig
from ark.sim.engine import SCHEMES


def _delta(row: dict[str, Any], key: str) -> str:
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
            f"{r['fct_mean_s'] * 1e3:.0f} ms", _delta(r, "fct_mean_reduction"),
            f"{r['fct_p95_s'] * 1e3:.0f} ms", _delta(r, "fct_p95_reduction"),
            f"{r['ttft_mean_s'] * 1e3:.0f} ms", _delta(r, "ttft_mean_reduction"),
            f"{r['ttft_p95_s'] * 1e3:.0f} ms", _delta(r, "ttft_p95_reduction"),
            ",".join(map(str, r["max_concurrent_per_spine"])),
        )
    return t


def start_note(cfg: ExperimentConfig, jobs: int, keep_flows: bool = False, option: str = "--requests") -> None:
    """Refuse a sweep that cannot fit (one line), or say what a large one will cost, before it starts."""
    note = check_sweep_size(cfg, jobs, keep_flows, option=option)
    if note:
        err.print(f"ark: {note}", highlight=False, soft_wrap=True)


def steady_and_verdict(records: Sequence[dict[str, Any]], as_json: bool) -> None:
    """The steady-state warning (stderr, one line) and, unless JSON, the go/no-go lines."""
    from ark.sim.report import go_line, go_no_go
    from ark.sim.steady import check, warning

    warn = warning(check(records))
    if warn:
        err.print(f"ark: warning: {warn}", highlight=False, soft_wrap=True)
    if not as_json:
        for d in go_no_go(records):
            out.print(f"go/no-go at {go_line(d)}", highlight=False, soft_wrap=True)


def _run_and_report(cfg: ExperimentConfig, out_dir: str, jobs: int, plots: bool, as_json: bool,
                    fig_dir: str | None = None) -> None:
    from ark.sim.experiment import path_kind_summary, plan, run_sweep, summarize, write_results
    from ark.sim.report import results_markdown

    start_note(cfg, jobs)
    with run_progress(len(plan(cfg)), disable=as_json) as tick:
        sweep = run_sweep(cfg, jobs=jobs, progress=tick)
    files = write_results(out_dir, sweep, cfg)
    summary = summarize(sweep.records)
    md = Path(out_dir) / "results.md"
    md.write_text(results_markdown(cfg, sweep.records, summary))
    files.append(md)
    if plots:
        from ark.cli import plots as plotmod

        od = Path(fig_dir or out_dir)
        files.append(plotmod.fct_vs_qps(sweep.records, od))
        files.append(plotmod.ttft_vs_qps(sweep.records, od))
        p = plotmod.spine_concurrency(sweep.timelines, sweep.timeline_qps, od, cfg.seeds[0], cfg.seeds)
        if p is not None:
            files.append(p)
    if as_json:
        steady_and_verdict(sweep.records, True)
        click.echo(json.dumps({"summary": summary, "files": [str(f) for f in files]}, indent=1))
        return
    out.print(_summary_table(summary))
    mism = sum(r["path_mismatches"] for r in sweep.records)
    races = sum(r["races"] for r in sweep.records)
    out.print(f"path mismatches (reserved spine != switch hash): {mism}; races resolved: {races}")
    out.print(path_kind_summary(sweep.records))
    steady_and_verdict(sweep.records, False)
    out.print("wrote: " + ", ".join(str(f) for f in files))


# ---------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------
@click.command()
@click.option("--qps", "qps", show_default="the config's: 1,5,10,15,20,25,30",
              help="Comma-separated loads (requests per second), e.g. 1,5,10.")
@click.option("--requests", type=click.IntRange(min=1), show_default="the config's: 1000",
              help="Requests per run (a run too short to be steady is named, with a count that would do).")
@click.option("--seeds", show_default="the config's: 3", help="Seed count N (seeds 0..N-1) or a list like 0,4,7.")
@schemes_opt("the config's: ecmp,ark,ark-balance,spray")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), show_default="the paper's setup",
              help="TOML config.")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-results", show_default=True,
              help="Output folder (created).")
@jobs_option()
@click.option("--no-plots", is_flag=True, help="Skip the PNG figures.")
@click.option("--figures", "fig_dir", type=OutFolder(), show_default="--out", help="Write the figures here.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
def reproduce(
    qps: str | None, requests: int | None, seeds: str | None, schemes: tuple[str, ...] | None,
    config_path: str | None, out_dir: str, jobs: int | None, no_plots: bool, fig_dir: str | None, as_json: bool,
) -> None:
    """Reproduce the published ECMP-vs-ARK experiment (FCT and TTFT over QPS)."""
    cfg = load_config(config_path).with_overrides(
        qps=qps_list(qps), requests=requests, seeds=seeds_option(seeds), schemes=schemes
    )
    if no_plots and fig_dir:
        raise click.BadParameter("there are none to write with --no-plots", param_hint="--figures")
    _run_and_report(cfg, out_dir, jobs or jobs_default(), not no_plots, as_json, fig_dir)


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), required=True, help="TOML scenario.")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-results", show_default=True,
              help="Output folder (created).")
@jobs_option()
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def simulate(config_path: str, out_dir: str, jobs: int | None, as_json: bool) -> None:
    """Run the scenario of one config file; prints and writes the same metrics."""
    cfg = load_config(config_path)
    _run_and_report(cfg, out_dir, jobs or jobs_default(), False, as_json)

