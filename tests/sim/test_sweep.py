"""Sweeps over a grid: the same bytes whatever runs them, and resumable after an interruption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ark.sim.config import from_dict
from ark.sim.experiment import plan
from ark.sim.sweep import SweepError, run_file, sweep

SMALL = {"workload": {"requests": 40, "qps": [5, 25]}, "experiment": {"schemes": ["ecmp", "ark"], "seeds": [0, 1]}}
CONFIGS = [
    ("paper", from_dict(SMALL)),
    ("clos", from_dict({**SMALL, "fabric": {"preset": "clos3-small"}})),
]


def _bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/results.*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("ref")
    rep = sweep(CONFIGS, out, jobs=1)
    assert (rep.runs, rep.ran, rep.reused) == (16, 16, 0)
    return _bytes(out)


def test_process_pool_gives_the_same_bytes_and_a_second_start_runs_nothing(tmp_path: Path, reference) -> None:
    sweep(CONFIGS, tmp_path, jobs=2)
    assert _bytes(tmp_path) == reference and len(reference) == 4
    again = sweep(CONFIGS, tmp_path, jobs=2)
    assert (again.ran, again.reused) == (0, 16) and _bytes(tmp_path) == reference


class _Stop(Exception):
    pass


def test_an_interrupted_sweep_resumes_without_redoing_finished_runs(tmp_path: Path, reference) -> None:
    seen: list[object] = []

    def stop_after_five(task: object) -> None:
        seen.append(task)
        if len(seen) == 5:
            raise _Stop

    with pytest.raises(_Stop):
        sweep(CONFIGS, tmp_path, jobs=1, progress=stop_after_five)
    finished = sorted(tmp_path.glob("runs/*/*.json"))
    assert len(finished) == 5
    stamps = {p: p.stat().st_mtime_ns for p in finished}
    # A half-written run (a crash mid-write leaves only a temporary file) and a damaged one are not finished.
    name, cfg = CONFIGS[1]
    run_file(tmp_path, name, plan(cfg)[-1]).write_text("{not json")
    rep = sweep(CONFIGS, tmp_path, jobs=2)
    assert (rep.ran, rep.reused) == (11, 5)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert _bytes(tmp_path) == reference


def test_a_changed_config_is_run_again(tmp_path: Path) -> None:
    sweep(CONFIGS[:1], tmp_path, jobs=1)
    changed = [("paper", from_dict({**SMALL, "network": {"control_delay_us": 500}}))]
    assert sweep(changed, tmp_path, jobs=1).ran == 8
    with pytest.raises(SweepError, match="two configs share a name"):
        sweep([CONFIGS[0], CONFIGS[0]], tmp_path)


def test_the_cli_resumes_after_being_killed(tmp_path: Path, reference) -> None:
    cfgs = []
    for name, raw in (("paper", SMALL), ("clos", {**SMALL, "fabric": {"preset": "clos3-small"}})):
        p = tmp_path / f"{name}.toml"
        import tomli_w

        p.write_text(tomli_w.dumps(raw))
        cfgs += ["--config", str(p)]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ark", "sweep", *cfgs, "--out", str(out), "--jobs", "1", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(out.glob("runs/*/*.json"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_with = len(list(out.glob("runs/*/*.json")))
    assert 3 <= killed_with < 16
    done = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert done["ran"] == 16 - killed_with and done["reused"] == killed_with
    assert _bytes(out) == reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # about 40 s: starts a Ray head
def test_ray_on_a_local_head_gives_the_process_pool_bytes(tmp_path: Path, reference) -> None:
    pytest.importorskip("ray")
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    if not Path(ray_bin).exists():
        pytest.skip("the ray command is not installed")
    port = _free_port()
    temp = Path("/tmp") / f"arkray{os.getpid()}"  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        rep = sweep(CONFIGS, tmp_path, ray_address=f"127.0.0.1:{port}")
        assert rep.executor == "ray" and rep.ran == 16
        assert _bytes(tmp_path) == reference
    finally:
        import ray

        ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(SweepError, match="Ray is not installed"):
        sweep(CONFIGS[:1], tmp_path, ray_address="auto")
