"""``ark race-window``: races, moved flows and ARK's gain against the control plane's delay,
jitter, clock skew and path, and against the request round trip to one arbiter."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from ark.cli.common import (
    FiniteRange,
    OutFolder,
    apply_sets,
    check_sweep_size,
    err,
    jobs_default,
    jobs_option,
    load_config,
    number_list,
    out,
    run_progress,
    schemes_opt,
    seeds_option,
)
from ark.sim.engine import ARK_SCHEMES

DEFAULT_SCHEMES = ("ark", "ark-split")


def _sweep(text: str | None, name: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """A sweep's points (an empty list skips that sweep); the delays must be > 0 and given,
    the others >= 0 (an arbiter round trip of 0 is the one-decider bound)."""
    delays = name == "--delays"  # the zero-delay reference is run anyway
    vals = number_list(text, name, positive=delays, nonempty=delays)
    return default if vals is None else vals


# What the sweep sets itself, and the option that sets it instead of --set.
_POINTS = "--delays, --jitters, --skews, --queues or --arbiter-rtt"
_SWEPT = {"network.control_delay_us": _POINTS, "network.control_jitter_us": _POINTS, "network.clock_skew_us": _POINTS,
          "network.control_path": _POINTS, "network.data_queue_kb": _POINTS, "network.control": _POINTS,
          "network.arbiter_rtt_us": _POINTS, "workload.qps": "--qps",
          "workload.requests": "--requests", "experiment.seeds": "--seeds", "experiment.schemes": "--schemes"}


def _delay(us: float) -> str:
    return f"{us / 1e3:,.1f} ms" if us >= 1000 else f"{us:,.1f} us"


def _check_set(key: str) -> None:
    if key in _SWEPT:
        raise click.BadParameter(f"{key}: the race window sets it (use {_SWEPT[key]})", param_hint="--set")


@click.command("race-window")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              show_default="prefill on leaves 0-2, decode on leaf 3", help="TOML config.")
@click.option("--set", "sets", multiple=True, metavar="TABLE.KEY=VALUE", show_default="none", help="Override one config value (repeat).")
@click.option("--delays", show_default="1,10,...,1000000", help="One-way control delays to sweep, us.")
@click.option("--jitters", show_default="100,1000,10000; empty: none", help="Jitters at a 20 us delay, us.")
@click.option("--skews", show_default="10,100,1000,10000; empty: none", help="Clock skews at a 20 us delay, us.")
@click.option("--queues", show_default="100,1000,10000",
              help="In-band control: standing queue per congested hop, kB (empty: none).")
@click.option("--arbiter-rtt", "rtts", show_default="0,50,200,1000,5000",
              help="One arbiter deciding for every host: request round trips to sweep, us (empty: none).")
@schemes_opt("ark,ark-split", ARK_SCHEMES)
@click.option("--qps", type=FiniteRange(min=0, min_open=True), default=25.0, show_default=True, help="Requests per second.")
@click.option("--requests", type=click.IntRange(min=1), default=1000, show_default=True, help="Requests per run.")
@click.option("--seeds", default="3", show_default=True, help="Seed count N or a list like 0,4,7.")
@click.option("--out", "out_dir", type=OutFolder(), default="ark-race-window", show_default=True,
              help="Output folder (created).")
@jobs_option()
@click.option("--figures", "fig_dir", type=OutFolder(), show_default="--out", help="Write the figure here.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def race_window(config_path: str | None, sets: tuple[str, ...], delays: str | None, jitters: str | None, skews: str | None,
                queues: str | None, rtts: str | None, schemes: tuple[str, ...] | None, qps: float, requests: int, seeds: str, out_dir: str,
                jobs: int | None, fig_dir: str | None, as_json: bool) -> None:
    """The race window: races per 1,000 flows, flows moved and the FCT cost against a zero-delay
    control plane, sweeping delay (1 us - 1 s), jitter, clock skew and in-band control, and
    the request round trip to one arbiter (no races)."""
    from ark.cli import plots
    from ark.sim import racewindow as rw

    names = schemes or DEFAULT_SCHEMES
    for item in sets:
        _check_set(item.partition("=")[0].strip())
    base = apply_sets(load_config(config_path) if config_path else rw.race_config(), sets)
    sd = seeds_option(seeds)
    assert sd is not None  # --seeds has a default
    cfg = rw.race_config(requests, sd, qps, base=base)
    pts = rw.race_points(_sweep(delays, "--delays", rw.DELAYS_US), _sweep(jitters, "--jitters", rw.JITTERS_US),
                         _sweep(skews, "--skews", rw.SKEWS_US), _sweep(queues, "--queues", rw.QUEUES_KB),
                         _sweep(rtts, "--arbiter-rtt", rw.ARBITER_RTTS_US))
    runs = [s for _ in cfg.seeds for s in ("ecmp", *[n for _ in pts for n in names])]
    note = check_sweep_size(cfg, jobs or jobs_default(), schemes=runs)
    if note:
        err.print(f"ark: {note}", highlight=False, soft_wrap=True)
    with run_progress(len(runs), disable=as_json) as tick:
        rows = rw.run_race_window(cfg, pts, names, jobs or jobs_default(), tick)
    od = Path(out_dir)
    od.mkdir(parents=True, exist_ok=True)
    halving = {s: rw.halving_delay(rows, s) for s in names}
    payload = json.dumps({"rows": rows, "halving_delay_us": halving}, indent=1)
    (od / "race_window.json").write_text(payload + "\n")
    (od / "race_window.md").write_text(rw.markdown(rows, names, cfg))
    fd = Path(fig_dir or od)
    fd.mkdir(parents=True, exist_ok=True)
    fig = plots.race_window(rows, names, fd, rw.placement(cfg))
    if as_json:
        click.echo(payload)
        return
    t = Table(title="race window (races and moved flows per 1,000 flows)")
    for c in ("sweep", "delay us", "jitter us", "skew us", "queue kB", "arbiter RTT us", "scheme", "races", "moved",
              "mean FCT", "vs zero delay", "gain vs ECMP"):
        t.add_column(c, justify="left" if c in ("sweep", "scheme") else "right")
    for r in rows:
        if r["scheme"] != "ecmp":
            arb = r["control"] == "arbiter"
            t.add_row(r["sweep"], "—" if arb else f"{r['delay_us']:g}", f"{r['jitter_us']:g}", f"{r['skew_us']:g}",
                      f"{r['queue_kb']:g}" if r["control_path"] == "data-fabric" else "—",
                      f"{r['rtt_us']:g}" if arb else "—", r["scheme"],
                      f"{r['races_per_1000']:.1f}", f"{r['moved_per_1000']:.1f}", f"{r['fct_mean_s'] * 1e3:.0f} ms",
                      f"{100 * r['fct_change']:+.1f}%", f"{100 * r['gain_vs_ecmp']:+.1f}%")
    out.print(t)
    for s, h in halving.items():
        out.print(f"{s}: gain over ECMP halves at " + ("(beyond the sweep, or no gain at zero delay)" if h is None else _delay(h)))
    out.print(f"wrote: {od / 'race_window.json'}, {od / 'race_window.md'}, {fig}")
