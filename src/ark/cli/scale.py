"""``ark bench scale`` and ``ark bench scaling``: the simulator at 1,024 to 8,192 GPUs.

Each run goes in a fresh process (its peak memory is its own); while it runs, a progress
line on stderr says how far it is (flows finished, simulated time, wall time, memory).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ark.cli.common import FiniteRange, OutFile, out, schemes_opt

_started = [time.perf_counter()]  # when the worker's run began (its first call says so)


def show_progress(finished: int, total: int, now: float) -> None:
    """The progress line of a run (called in the worker; it prints to stderr)."""
    from ark.sim.bench import _peak_rss_mb

    if finished == 0:
        _started[0] = time.perf_counter()
    wall = time.perf_counter() - _started[0]
    end = "\n" if finished == total or not sys.stderr.isatty() else "\r"
    sys.stderr.write(f"  {finished:,}/{total:,} flows finished, {now:.1f} s simulated, {wall:.0f} s wall, "
                     f"peak {_peak_rss_mb():.0f} MB{end}")
    sys.stderr.flush()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise click.BadParameter(f"expected integers >= 1, got {text!r}")
    return vals


def _table(res: list[dict[str, Any]]) -> Table:
    t = Table(title="the scale benchmark, one process per run")
    for c in ("GPUs", "requests", "scheme", "QPS", "load", "cross pod", "wall s", "CPU s", "events", "events/s", "peak MB",
              "mean FCT s", "mismatches", "baseline s"):
        t.add_column(c, justify="right")
    for r in res:
        t.add_row(str(r["gpus"]), str(r["requests"]), r["scheme"], f"{r['qps']:g}", f"{r['offered_load']:.2f}",
                  f"{r['flows_cross_pod'] / r['requests']:.0%}",
                  f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", str(r["events"]), f"{r['events_per_s']:.0f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['fct_mean_s']:.3f}", str(r["path_mismatches"]),
                  f"{r['baseline_s']:.2f}")
    return t


@click.command("scale")
@schemes_opt("ark")
@click.option("--gpus", type=int, default=1024, show_default=True,
              help="GPUs, a multiple of 128 (pods of the scale fabric's shape; 8192: the scale-8k preset).")
@click.option("--requests", type=click.IntRange(min=1), default=100_000, show_default=True, help="Requests per run.")
@click.option("--qps", type=FiniteRange(min=0, min_open=True), default=None,
              show_default="1400 per 1,024 GPUs, offered load about 0.76", help="Arrival rate.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="A progress line on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def bench_scale(schemes: tuple[str, ...] | None, gpus: int, requests: int, qps: float | None, progress: bool,
                as_json: bool) -> None:
    """1,024 GPUs or more (3-tier pods): wall time, events/s and peak memory per scheme."""
    from ark.sim.bench import scale

    res = scale(schemes or ("ark",), requests, qps, gpus, show_progress if progress else None)
    if as_json:
        click.echo(json.dumps(res[0] if len(res) == 1 else res, indent=1))
        return
    out.print(_table(res))
    out.print("targets: 8,192 GPUs x 1,000,000 requests in <= 600 s wall and <= 4096 MB per scheme on 2 cores; "
              "baseline = one paper-fabric run (ECMP, QPS 25) measured just before, to read the figures against "
              "the machine's load")


@click.command("scaling")
@schemes_opt("ark,ecmp")
@click.option("--gpus", "gpus_text", default="256,1024,2048,4096,8192", show_default=True,
              help="Comma-separated GPU counts (multiples of 128), each at --requests' first value.")
@click.option("--requests", "requests_text", default="10000,100000", show_default=True,
              help="Comma-separated request counts, each at --at-gpus.")
@click.option("--at-gpus", type=click.IntRange(min=128), default=1024, show_default=True,
              help="The GPU count of the runs against requests.")
@click.option("--plot", "plot_path", type=OutFile(), default=None, show_default="no figure", help="Write the figure here.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs and exponents as JSON instead of a table.")
def bench_scaling(schemes: tuple[str, ...] | None, gpus_text: str, requests_text: str, at_gpus: int,
                  plot_path: str | None, as_json: bool) -> None:
    """Wall time and peak memory against GPUs and against requests, with the fitted exponents."""
    from ark.sim.bench import scale, scale_config, scaling_exponents

    gpus, requests = _int_list(gpus_text), _int_list(requests_text)
    for g in (*gpus, at_gpus):
        scale_config(1, None, g)  # a GPU count the fabric cannot have stops here, in one line
    points = sorted({(g, requests[0]) for g in gpus} | {(at_gpus, n) for n in requests})
    rows = [r for g, n in points for r in scale(schemes or ("ark", "ecmp"), n, None, g, show_progress)]
    res: dict[str, Any] = {"runs": rows, "exponents": scaling_exponents(rows)}
    if plot_path:
        from ark.cli.plots import scaling

        res["plot"] = str(scaling(rows, Path(plot_path)))
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    out.print(_table(rows))
    for f in res["exponents"]:
        fixed = f"{f['requests']:,} requests" if f["against"] == "gpus" else f"{f['gpus']:,} GPUs"
        out.print(f"{f['scheme']}: wall ~ {f['against']}^{f['wall_exponent']:.2f}, CPU ~ "
                  f"{f['against']}^{f['cpu_exponent']:.2f}, memory ~ {f['against']}^{f['memory_exponent']:.2f} "
                  f"({fixed}, {f['points']} points)")
