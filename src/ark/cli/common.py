"""What every command shares: consoles, option parsing with one-line errors, configs."""

from __future__ import annotations

import math
import os
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
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


class InOrder(click.Group):
    """A command group that lists its commands (help, reference) in ``order``, then the rest in
    the order they were added: the order a user meets them, not the alphabet's."""

    def __init__(self, *args: Any, order: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order = tuple(order)

    def list_commands(self, ctx: click.Context) -> list[str]:
        first = [c for c in self.order if c in self.commands]
        return first + [c for c in self.commands if c not in first]


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


def schemes_option(text: str | None, choices: Sequence[str] = SCHEMES,
                   option: str = "--schemes") -> tuple[str, ...] | None:
    """``ecmp,ark``: schemes of ``choices``, each once, in the order given; None when not given."""
    if text is None:
        return None
    vals = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))  # a scheme named twice runs once
    bad = [v for v in vals if v not in choices]
    if bad or not vals:
        raise click.BadParameter(
            f"each must be one of {', '.join(choices)}; got {text!r}", param_hint=option
        )
    return vals


def schemes_opt(shown_default: str, choices: Sequence[str] = SCHEMES) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--schemes a,b`` (or the option repeated; ``--scheme`` is the same option), the same
    for every command that runs several schemes; the command gets a tuple, or None."""
    def parse(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...] | None:
        return schemes_option(",".join(value), choices) if value else None

    return click.option("--schemes", "--scheme", "schemes", multiple=True, callback=parse, metavar="A,B,...",
                        show_default=shown_default,
                        help=f"Comma-separated (or repeat the option), each one of {', '.join(choices)}.")


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
                        show_default=f"the CPU count, at most {JOBS_MAX}", help=f"{what}.")


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


# ---------------------------------------------------------------------------------------
# paths and sizes, checked before any work
# ---------------------------------------------------------------------------------------
def _os_reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def writable_folder(path: str, option: str) -> Path:
    """``path`` as a folder this process can write in (created if missing), or one line naming ``option``."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise click.BadParameter(f"{path} is a file, not a folder", param_hint=option)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise click.BadParameter(f"cannot write in {path}: {_os_reason(e)}", param_hint=option) from None
    return p


def writable_file(path: str, option: str) -> Path:
    """``path`` as a file this process can create or replace, or one line naming ``option``."""
    p = Path(path)
    if p.is_dir():
        raise click.BadParameter(f"{path} is a folder, not a file", param_hint=option)
    parent = p.parent
    if not parent.is_dir():
        raise click.BadParameter(f"{parent} is not an existing folder", param_hint=option)
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
        if p.exists() and not os.access(p, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise click.BadParameter(f"cannot write {path}: {_os_reason(e)}", param_hint=option) from None
    return p


class OutFolder(click.ParamType):
    """A folder to write results in, checked (and created) when the command line is read."""

    name = "folder"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return str(writable_folder(str(value), param.opts[0] if param is not None else "--out"))


class OutFile(click.ParamType):
    """A file to write, checked when the command line is read."""

    name = "file"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return str(writable_file(str(value), param.opts[0] if param is not None else "--out"))


# CPU seconds per request of one run, measured on the paper's fabric (2-core VM, QPS 25,
# 20,000 requests; the rest at 3,000 and doubled for margin); bigger fabrics cost more.
CPU_S_PER_REQUEST = {"ecmp": 0.25e-3, "ark-split": 1.7e-3, "plb": 1.3e-3, "hedera": 0.31e-3, "ark": 0.62e-3,
                     "ark-balance": 0.9e-3, "spray": 0.35e-3, "letflow": 0.5e-3, "conga": 0.5e-3,
                     "ecmp-split": 1.1e-3, "oracle-path": 0.4e-3}
# Peak memory of one run: a base plus this per request (measured 1.5-3.1 KiB on the paper's
# fabric, 5.3 KiB with the 1,024-GPU fabric's path maps).
RUN_BASE_BYTES = 100 << 20
BYTES_PER_REQUEST = 5 << 10
KEPT_BYTES_PER_REQUEST = 100  # a run's flows kept by the parent (ark compare: sizes, starts, FCTs)
ESTIMATE_ABOVE_S = 60.0


def available_memory() -> int:
    """Bytes of memory this machine has free for new work (MemAvailable; else physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_sweep_size(cfg: ExperimentConfig, jobs: int, keep_flows: bool = False,
                     schemes: Sequence[str] | None = None, option: str = "--requests") -> str | None:
    """Refuse (one line naming the option) a sweep whose runs cannot fit in this machine's
    memory; return a one-line estimate of its memory and time when it is large, else None.
    ``schemes``: the scheme of every run, when the sweep's runs are not ``plan(cfg)``'s;
    ``option``: what sets the request count (a command's option, or a config key)."""
    from ark.sim.experiment import RunSpec, plan

    runs = plan(cfg) if schemes is None else [RunSpec(s, 0.0, 0) for s in schemes]
    n = cfg.workload.requests
    workers = max(1, min(jobs, len(runs)))
    per_run = RUN_BASE_BYTES + n * BYTES_PER_REQUEST
    kept = len(runs) * n * KEPT_BYTES_PER_REQUEST if keep_flows else 0
    free = available_memory()
    if per_run + kept > free:
        most = max(1, (free - RUN_BASE_BYTES) // (BYTES_PER_REQUEST + (len(runs) * KEPT_BYTES_PER_REQUEST
                                                                         if keep_flows else 0)))
        raise click.BadParameter(
            f"{n:,} requests per run need about {_gib(per_run + kept)} of memory ({BYTES_PER_REQUEST >> 10} KiB "
            f"each, estimated), more than the {_gib(free)} this machine has free: at most about {most:,} fit",
            param_hint=option)
    if workers * per_run + kept > free:
        fit = max(1, (free - kept) // per_run)
        raise click.BadParameter(
            f"{workers} workers of {_gib(per_run)} each (estimated) need more than the {_gib(free)} this machine "
            f"has free: use --jobs {fit}", param_hint="--jobs")
    cpu_s = sum(n * CPU_S_PER_REQUEST.get(sp.scheme, 1e-3) for sp in runs)
    wall_s = cpu_s / workers
    if wall_s < ESTIMATE_ABOVE_S:
        return None
    return (f"estimate: {len(runs)} runs of {n:,} requests on {workers} worker{'s' if workers > 1 else ''}: about {_gib(workers * per_run + kept)} "
            f"of memory and {_duration(wall_s)} (the paper's fabric on a 2-core VM; larger fabrics take longer)")


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"
