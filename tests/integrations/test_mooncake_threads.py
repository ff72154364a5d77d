"""The installed Mooncake engine under concurrent writes with one connection per request
(how steering runs it): no sender thread may stall (``scripts/mooncake-load.py``, two
minutes, 8 threads). 0.3.13 and 0.3.13.post1 hang this way (a data race on a session's
progress timer corrupts the heap; every sender thread then waits forever): on this
project's 2-core machine, under this load, after 50 s and after 300 s, so a two-minute run
would have caught one of those two. Slow: a regression check for the release the extras
install, and a chance, not a certainty, of catching a release with that bug."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mooncake-load.py"


def test_concurrent_unpooled_writes_never_stall() -> None:
    seconds, stall_s = 120, 30
    res = subprocess.run([sys.executable, str(SCRIPT), "--threads", "8", "--seconds", str(seconds),
                          "--stall-s", str(stall_s)], capture_output=True, text=True,
                         timeout=seconds + 2 * stall_s + 120, check=False)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["stalled"] == [], f"sender threads {out['stalled']} stalled for {stall_s} s: {out}"
    assert res.returncode == 0 and out["failed"] == 0 and out["writes"] > 0, (out, res.stderr[-2000:])
