"""Sweeps over a grid of (config x scheme x QPS x seed): on a local process pool or on an
existing Ray cluster, resumable after an interruption.

Every finished run is written at once to its own file, ``OUT/runs/<config>/<scheme>_<qps>_<seed>.json``
(atomically: a run is either wholly there or not at all), stamped with a digest of its
config. A sweep started again over the same folder skips every run whose file is there with
the same digest and runs the rest. The result files of each config
(``OUT/<config>/results.json`` and ``results.csv``, as ``ark reproduce`` writes them) are
then assembled from the run files in plan order, so they are the same bytes whichever
executor ran the runs, in whatever order, over however many attempts.

Ray is optional (``pip install 'ark-fabric[ray]'``): ``address`` is a running cluster's
address (``auto``: the one ``RAY_ADDRESS`` or a local ``ray start --head`` names). Its
workers need this package installed, as the local process pool does.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ark.sim.config import ExperimentConfig
from ark.sim.experiment import RunOutput, RunSpec, Sweep, plan, run_one, write_results

Task = tuple[str, ExperimentConfig, RunSpec]


class SweepError(ValueError):
    """A sweep that cannot run as asked (duplicate config names, Ray missing, ...)."""


@dataclass
class SweepReport:
    runs: int  # in the grid
    ran: int  # by this invocation
    reused: int  # finished earlier, found in the run files
    executor: str
    files: list[Path]


def config_digest(cfg: ExperimentConfig) -> str:
    return hashlib.sha256(msgspec.json.encode(cfg)).hexdigest()[:16]


def run_file(out: Path, name: str, spec: RunSpec) -> Path:
    return out / "runs" / name / f"{spec.scheme}_{spec.qps:g}_{spec.seed}.json"


def _load_run(path: Path, digest: str) -> RunOutput | None:
    """The run stored at ``path`` if it is complete and of this config, else None."""
    try:
        raw = json.loads(path.read_text())
        if raw["digest"] != digest:
            return None
        tl = raw["timeline"]
        return RunOutput(raw["record"], None if tl is None else [(float(t), tuple(c)) for t, c in tl])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_run(path: Path, digest: str, out: RunOutput) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tl = None if out.timeline is None else [[t, list(c)] for t, c in out.timeline]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"digest": digest, "record": out.record, "timeline": tl}))
    tmp.replace(path)


def _task(task: Task) -> RunOutput:
    return run_one(task[1], task[2])


def _on_pool(tasks: Sequence[Task], jobs: int) -> Iterator[tuple[Task, RunOutput]]:
    if jobs <= 1:
        for t in tasks:
            yield t, _task(t)
        return
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(_task, t): t for t in tasks}
        for fut in as_completed(futs):
            yield futs[fut], fut.result()


def _on_ray(tasks: Sequence[Task], address: str) -> Iterator[tuple[Task, RunOutput]]:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray: Ray is not installed; pip install 'ark-fabric[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    remote = ray.remote(_task)
    pending = {remote.remote(t): t for t in tasks}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            yield pending.pop(ref), ray.get(ref)


def sweep(
    configs: Sequence[tuple[str, ExperimentConfig]],
    out_dir: str | Path,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
    progress: Callable[[Task], None] | None = None,
) -> SweepReport:
    """Run every (config, scheme, QPS, seed) not already in ``out_dir``; write the results."""
    names = [n for n, _ in configs]
    if len(set(names)) != len(names):
        raise SweepError(f"config: two configs share a name: {', '.join(names)}")
    out = Path(out_dir)
    digests = {n: config_digest(c) for n, c in configs}
    grid: list[Task] = [(n, c, sp) for n, c in configs for sp in plan(c)]
    done: dict[tuple[str, RunSpec], RunOutput] = {}
    for n, _c, sp in grid:
        got = _load_run(run_file(out, n, sp), digests[n])
        if got is not None:
            done[(n, sp)] = got
    todo = [t for t in grid if (t[0], t[2]) not in done]
    reused = len(done)
    # Heaviest (highest QPS) first so the pool's tail is short.
    todo.sort(key=lambda t: -t[2].qps)
    runner = _on_pool(todo, jobs) if ray_address is None else _on_ray(todo, ray_address)
    for task, result in runner:
        _store_run(run_file(out, task[0], task[2]), digests[task[0]], result)
        done[(task[0], task[2])] = result
        if progress is not None:
            progress(task)
    files: list[Path] = []
    for n, c in configs:
        files += _assemble(out / n, [(sp, done[(n, sp)]) for sp in plan(c)], c)
    return SweepReport(len(grid), len(todo), reused, "process pool" if ray_address is None else "ray", files)


def _assemble(out: Path, runs: list[tuple[RunSpec, RunOutput]], cfg: ExperimentConfig) -> list[Path]:
    """One config's result files, from its runs in plan order."""
    timelines: dict[str, list[tuple[float, tuple[int, ...]]]] = {}
    tq: float | None = None
    for sp, o in runs:
        if o.timeline is not None:
            timelines[sp.scheme] = o.timeline
            tq = sp.qps
    records: list[dict[str, Any]] = [o.record for _, o in runs]
    return write_results(out, Sweep(records, timelines, tq), cfg)
