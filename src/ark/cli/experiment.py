"""``ark reproduce`` and ``ark simulate``: sweeps, their tables, files and figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import (
    jobs_default,
    jobs_option,
    load_config,
    out,
    qps_list,
    run_progress,
    schemes_option,
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


def _run_and_report(cfg: ExperimentConfig, out_dir: str, jobs: int, plots: bool, as_json: bool) -> None:
    from ark.sim.experiment import path_kind_summary, plan, run_sweep, summarize, write_results

    with run_progress(len(plan(cfg)), disable=as_json) as tick:
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
    out.print(path_kind_summary(sweep.records))
    out.print("wrote: " + ", ".join(str(f) for f in files))


# ---------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------
@click.command()
@click.option("--qps", "qps", help="Comma-separated loads, e.g. 1,5,10 (default: 1,5,10,15,20,25,30).")
@click.option("--requests", type=click.IntRange(min=1), help="Requests per run (default 1000).")
@click.option("--seeds", help="Seed count N (seeds 0..N-1) or a list like 0,4,7 (default 3).")
@click.option("--schemes", help=f"Comma-separated subset of {','.join(SCHEMES)}.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config (default: the paper's setup).")
@click.option("--out", "out_dir", default="ark-results", show_default=True, help="Output folder.")
@jobs_option()
@click.option("--no-plots", is_flag=True, help="Skip the PNG figures.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
def reproduce(
    qps: str | None, requests: int | None, seeds: str | None, schemes: str | None,
    config_path: str | None, out_dir: str, jobs: int | None, no_plots: bool, as_json: bool,
) -> None:
    """Reproduce the published ECMP-vs-ARK experiment (FCT and TTFT over QPS)."""
    cfg = load_config(config_path).with_overrides(
        qps=qps_list(qps), requests=requests, seeds=seeds_option(seeds), schemes=schemes_option(schemes)
    )
    _run_and_report(cfg, out_dir, jobs or jobs_default(), not no_plots, as_json)


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), required=True, help="TOML scenario.")
@click.option("--out", "out_dir", default="ark-results", show_default=True, help="Output folder.")
@jobs_option()
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def simulate(config_path: str, out_dir: str, jobs: int | None, as_json: bool) -> None:
    """Run the scenario of one config file; prints and writes the same metrics."""
    cfg = load_config(config_path)
    _run_and_report(cfg, out_dir, jobs or jobs_default(), False, as_json)

