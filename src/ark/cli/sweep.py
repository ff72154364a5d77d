"""``ark sweep``: a grid of configs x schemes x QPS x seeds, on a process pool or a Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ark.cli.common import OutFolder, err, jobs_default, jobs_option, load_config, out
from ark.cli.experiment import start_note


@click.command()
@click.option("--config", "config_paths", multiple=True, type=click.Path(dir_okay=False),
              show_default="the paper's setup, named 'default'", help="TOML config; repeat for a grid over configs.")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-sweep", show_default=True,
              help="Output folder: OUT/<config>/results.json|csv, and one file per finished run under OUT/runs/.")
@jobs_option("Local worker processes")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None, metavar="[ADDRESS]",
              show_default="local processes",
              help="Run on an existing Ray cluster (ADDRESS, or 'auto' when given bare) instead of local processes.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def sweep(config_paths: tuple[str, ...], out_dir: str, jobs: int | None, ray_address: str | None,
          as_json: bool) -> None:
    """Run a grid (config x scheme x QPS x seed); started again, it runs only what is missing."""
    from ark.sim.experiment import plan
    from ark.sim.sweep import sweep as run_grid

    configs = [(Path(p).stem, load_config(p)) for p in config_paths] or [("default", load_config(None))]
    if ray_address is None:  # local workers: each config's runs must fit this machine
        for _, c in configs:
            start_note(c, jobs or jobs_default(), option="workload.requests")
    total = sum(len(plan(c)) for _, c in configs)
    with Progress(TextColumn("[bold]sweeping"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=True, disable=as_json) as prog:
        bar = prog.add_task("", total=total)

        def tick(t: tuple) -> None:
            sp = t[2]
            prog.update(bar, advance=1, description=f"{t[0]} {sp.scheme} qps={sp.qps:g} seed={sp.seed}")

        rep = run_grid(configs, out_dir, jobs=jobs or jobs_default(), ray_address=ray_address, progress=tick)
    files = [str(f) for f in rep.files]
    summary = {"runs": rep.runs, "ran": rep.ran, "reused": rep.reused, "executor": rep.executor, "files": files}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    out.print(f"{rep.runs} runs ({rep.ran} run now on the {rep.executor}, {rep.reused} found finished); "
              "wrote: " + ", ".join(files))
