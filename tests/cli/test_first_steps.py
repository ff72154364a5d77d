"""A newcomer's first commands: the README's set-up and tour as written, ``ark cluster``'s
verdict, ``ark preload``'s notes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ark.cli.agent import cluster_verdict
from ark.integrations import preload
from ark.testbed import netns

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _blocks(heading: str) -> list[str]:
    """The ``sh`` blocks of one README section."""
    text = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```sh\n(.*?)^```$", text, re.S | re.M)


def _commands(block: str) -> list[str]:
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_set_up_activates_the_environment_the_tour_uses() -> None:
    (first, _tests) = _blocks("Set-up: two commands")
    assert ". .venv/bin/activate" in first and first.strip().endswith("ark reproduce")
    (tour,) = _blocks("A five-minute tour")
    lines = _commands(tour)
    assert all(c.startswith(("ark ", 'sudo env PATH="$PATH" ark ')) for c in lines), lines
    assert any(c.startswith("ark compare") and "spray" in c for c in lines)  # the "x spray" column is filled
    assert all("--scheme " not in c for c in lines)  # one way to give several schemes: --schemes a,b


@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path) -> None:
    """Every line of the tour, in a fresh folder, with the environment's ``bin`` first on PATH
    (what activating it does); the testbed line as root only. No line fails or prints a traceback."""
    (tour,) = _blocks("A five-minute tour")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "COLUMNS": "200"}
    for cmd in _commands(tour):
        if cmd.startswith("sudo "):
            if os.geteuid() != 0 or netns.available() is not None:
                continue
            if any(Path("/run/netns").glob("ark-*")):
                continue  # a testbed with the default prefix is up: the tour would meet it
            cmd = cmd.replace('sudo env PATH="$PATH" ark', "ark")  # root already
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=tmp_path, capture_output=True, text=True,
                             env=env, timeout=1800, check=False)
        assert res.returncode == 0 and "Traceback" not in res.stderr, f"{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        if cmd.startswith("ark compare"):
            assert "go/no-go at QPS" in res.stdout and "x spray" in res.stdout
        if cmd.startswith("ark cluster"):
            assert "verdict: PASS" in res.stdout
        if cmd.startswith("ark preload"):
            assert "engine up" in res.stdout and "ark preload: warning: no agent named" in res.stderr


def test_the_cluster_verdict_passes_a_clean_run_and_names_each_failure() -> None:
    clean = {"agents": 8, "flows_requested": 500, "flows": 500, "client_errors": 0, "races": 172,
             "invalid_messages": 0, "digest_mismatches": 0, "held_leases_lapsed": 0, "leaked": 0, "digests_equal": True}
    line = cluster_verdict(clean)
    assert line.startswith("verdict: PASS: 500 reserve+release cycles through 8 real agents") and "172 races" in line
    bad = cluster_verdict({**clean, "leaked": 2, "digests_equal": False, "flows": 499, "killed": 1,
                           "dead_reservations_cleared_s": None})
    assert bad.startswith("verdict: FAIL: 2 leaked reservations, tables differ at the end, the killed agents' "
                          "reservations were never cleared, 499 of 500 cycles done")


@pytest.mark.skipif(not (os.environ.get("CC") or any(Path(d, "cc").exists() for d in os.environ["PATH"].split(":"))),
                    reason="no C compiler for the interposer")
def test_preload_says_what_it_steers_and_warns_when_no_agent_answers(tmp_path) -> None:
    from ark.agent.loopback import write_cluster

    preload.library()  # build it once, outside the timed runs
    ark = [sys.executable, "-m", "ark", "preload"]
    cmd = ["--", sys.executable, "-c", "print('engine up')"]
    res = subprocess.run([*ark, *cmd], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "engine up"
    assert "ark preload: " in res.stderr and "it steers the TCP connections that ARK's engine adapters" in res.stderr
    assert "warning: no agent named (--cluster FILE --host NAME)" in res.stderr
    cluster, names = write_cluster(tmp_path, 2)
    res = subprocess.run([*ark, "--cluster", str(cluster), "--host", names[0], *cmd], capture_output=True, text=True,
                         timeout=120, check=False)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 0 and len(lines) == 2 and "engine up" in res.stdout
    assert lines[1].startswith("ark preload: warning: no agent answers at ") and "unsteered (plain ECMP)" in lines[1]
    res = subprocess.run([*ark, "--cluster", str(cluster), *cmd], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode != 0 and "give both" in res.stderr
