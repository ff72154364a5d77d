"""What every command shares: consoles, option parsing with one-line errors, configs."""

from __future__ import annotations

import math
import os
import sys
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ark.sim import config as cfgmod
from ark.sim.config import ConfigError, ExperimentConfig
from ark.sim.engine import SCHEMES

# Piped output would otherwise wrap at 80 columns and truncate the tables.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` that also refuses nan and inf (which compare false to every bound)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def number_list(text: str | None, name: str, *, positive: bool = True,
                nonempty: bool = True) -> tuple[float, ...] | None:
    """``1,2.5,10``: finite numbers > 0 (or >= 0); None when the option was not given."""
    if text is None:
        return None
    what = f"comma-separated finite numbers {'> 0' if positive else '>= 0'}"
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected {what}, got {text!r}", param_hint=name) from None
    if (nonempty and not vals) or any(not math.isfinite(v) or not (v > 0 if positive else v >= 0) for v in vals):
        raise click.BadParameter(f"expected {what}, got {text!r}", param_hint=name)
    return vals


def qps_list(text: str | None) -> tuple[float, ...] | None:
    return number_list(text, "--qps")


def schemes_option(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    vals = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))  # a scheme named twice runs once
    bad = [v for v in vals if v not in SCHEMES]
    if bad or not vals:
        raise click.BadParameter(
            f"each must be one of {', '.join(SCHEMES)}; got {text!r}", param_hint="--schemes"
        )
    return vals


def seeds_option(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        if "," in text:
            return cfgmod.parse_seeds([int(x) for x in text.split(",") if x.strip()], "--seeds")
        return cfgmod.parse_seeds(int(text), "--seeds")
    except ValueError as e:
        msg = str(e) if isinstance(e, ConfigError) else f"expected a count >= 1 or a list like 0,1,2; got {text!r}"
        raise click.BadParameter(msg.removeprefix("--seeds: "), param_hint="--seeds") from None


def load_config(path: str | None, sets: tuple[str, ...] = ()) -> ExperimentConfig:
    """A config file (or the default) with ``--set TABLE.KEY=VALUE`` applied, each VALUE a
    TOML value (``--set serving.kv_transfer='"per-layer"'`` or, for a bare word,
    ``--set serving.kv_transfer=per-layer``), checked like a file."""
    return apply_sets(cfgmod.load(path) if path else cfgmod.default(), sets)


def apply_sets(cfg: ExperimentConfig, sets: tuple[str, ...]) -> ExperimentConfig:
    """``cfg`` with each ``TABLE.KEY=VALUE`` of ``--set`` applied (see :func:`load_config`)."""
    if not sets:
        return cfg
    d = msgspec.to_builtins(cfg)
    for item in sets:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise click.BadParameter(f"expected TABLE.KEY=VALUE, got {item!r}", param_hint="--set")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word: a string
        node = d
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise click.BadParameter(f"{key}: {p} is not a table", param_hint="--set")
            node = child
        node[parts[-1]] = value
    return cfgmod.from_dict(d)


# ---------------------------------------------------------------------------------------
# worker processes and progress
# ---------------------------------------------------------------------------------------
JOBS_MAX = 8  # sweeps of small runs gain little beyond this


def jobs_default() -> int:
    return max(1, min(os.cpu_count() or 1, JOBS_MAX))


def jobs_option(what: str = "Worker processes") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--jobs N`` (default: :func:`jobs_default`), the same for every command that sweeps."""
    return click.option("--jobs", type=click.IntRange(min=1), default=None,
                        help=f"{what} (default: the CPU count, at most {JOBS_MAX}).")


@contextmanager
def run_progress(total: int, disable: bool = False) -> Iterator[Callable[[Any], None]]:
    """A progress bar on stderr over ``total`` simulator runs; yields the per-run tick."""
    with Progress(
        TextColumn("[bold]simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=err, transient=True, disable=disable,
    ) as prog:
        task = prog.add_task("", total=total)

        def tick(sp: Any) -> None:
            prog.update(task, advance=1, description=f"{sp.scheme} qps={sp.qps:g} seed={sp.seed}")

        yield tick
