"""``ark polarisation``: reachable paths per hash and seeding, and ECMP vs ARK when polarised."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from ark.cli.common import OutFolder, jobs_default, jobs_option, out, qps_list


@click.command()
@click.option("--pairs", type=click.IntRange(min=1), default=32, show_default=True,
              help="Cross-pod host pairs whose path maps are counted (on the 1,024-GPU scale fabric).")
@click.option("--qps", "qps", show_default="20,40,60,80", help="Loads of the FCT comparison.")
@click.option("--requests", type=click.IntRange(min=1), default=1000, show_default=True, help="Requests per run.")
@click.option("--seeds", type=click.IntRange(min=1), default=2, show_default=True, help="Seeds per point (0..N-1).")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-polarisation", show_default=True,
              help="Folder for polarisation.json and polarisation.png (created).")
@jobs_option()
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def polarisation(pairs: int, qps: str | None, requests: int, seeds: int, out_dir: str, jobs: int | None,
                 as_json: bool) -> None:
    """Hash polarisation on a 3-tier Clos: reachable paths, and what ARK can still do."""
    from ark.cli import plots
    from ark.core.clos import CLOS_PRESETS
    from ark.sim import polarisation as pol

    table = pol.reachability_table(dict(CLOS_PRESETS["scale"]), pairs)
    sims = pol.ark_under_polarisation(requests, seeds, qps_list(qps) or pol.SIM_QPS, jobs or jobs_default())
    od = Path(out_dir)
    od.mkdir(parents=True, exist_ok=True)
    (od / "polarisation.json").write_text(json.dumps({"reachability": table, "fct": sims}, indent=1) + "\n")
    fig = plots.polarisation(sims, od)
    if as_json:
        click.echo(json.dumps({"reachability": table, "fct": sims, "files": [str(od / "polarisation.json"), str(fig)]}))
        return
    t = Table(title=f"paths between pods that some source port reaches (scale fabric, {pairs} host pairs)")
    for c in ("leaf hash", "aggregation hash", "seeding", "reachable (mean)", "min"):
        t.add_column(c, justify="right" if c in ("reachable (mean)", "min") else "left")
    for r in table:
        t.add_row(r["hash"], r["agg_hash"], r["seeding"], f"{r['mean']:.0%} of {r['paths']}", f"{r['min']:.0%}")
    out.print(t)
    t = Table(title="ECMP vs ARK, polarised (one murmur3 seed everywhere) and with a seed per switch")
    for c in ("QPS", "load", "fabric", "scheme", "mean FCT ms", "P95 FCT ms", "mismatches"):
        t.add_column(c, justify="right")
    for r in sims:
        t.add_row(f"{r['qps']:g}", f"{r['offered_load']:.2f}", r["fabric"], r["scheme"], f"{r['fct_mean_s'] * 1e3:.0f}",
                  f"{r['fct_p95_s'] * 1e3:.0f}", str(r["path_mismatches"]))
    out.print(t)
    out.print(f"wrote: {od / 'polarisation.json'}, {fig}")
