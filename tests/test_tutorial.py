"""docs/tutorial.md runs: every ``sh`` block in order, in a fresh folder, and every line of the
``text`` block after one is in that command's output (whitespace collapsed), so the
tutorial cannot drift from what the code prints."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ark.testbed import netns

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, list[str]]]:
    """(command block, lines its output must hold), in the tutorial's order."""
    out: list[tuple[str, list[str]]] = []
    for m in FENCE.finditer(TUTORIAL.read_text()):
        kind, body = m.group(1), m.group(2)
        if kind == "sh":
            out.append((body, []))
        elif kind == "text":
            assert out, "a text block before any command"
            out[-1][1].extend(line for line in body.splitlines() if line.strip())
    return out


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _run(block: str, cwd: Path, expect: list[str]) -> None:
    if os.geteuid() == 0:
        block = re.sub(r"(^|\n|&& )sudo (env PATH=\"\$PATH\" )?", r"\1", block)  # root needs no sudo (CI has none)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "COLUMNS": "200",
           "NO_COLOR": "1"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    assert res.returncode == 0, f"{block}\nexit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    got = _squash(res.stdout + res.stderr)
    for line in expect:
        assert _squash(line).strip() in got, f"{block}\nexpected in its output: {line}\n--- output ---\n{res.stdout[-4000:]}"


def test_the_tutorial_has_commands_and_checked_output() -> None:
    bs = blocks()
    assert len(bs) >= 7 and sum(bool(e) for _, e in bs) >= 4


def test_the_tutorial_steps_without_root_run_as_written(tmp_path) -> None:
    for block, expect in blocks():
        if "sudo " not in block:
            _run(block, tmp_path, expect)


@pytest.mark.slow  # about 90 s: the whole tour, testbed runs included
@pytest.mark.root
@pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")
def test_the_whole_tutorial_runs_as_written(tmp_path) -> None:
    if any(p.name.startswith("ark-") for p in Path("/run/netns").glob("ark-*")):
        pytest.skip("a testbed with the default prefix 'ark' is up on this machine: the tutorial would meet it")
    mooncake = importlib.util.find_spec("mooncake") is not None
    try:
        for block, expect in blocks():
            if "--engine mooncake" in block and not mooncake:
                continue  # the mooncake extra is not installed
            _run(block, tmp_path, expect)
    finally:
        subprocess.run([str(Path(sys.executable).parent / "ark"), "testbed", "down"], capture_output=True,
                       check=False, timeout=120)
