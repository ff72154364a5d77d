"""The installed Mooncake engine under concurrent writes with one connection per request
(how steering runs it): no sender thread may stall. 0.3.13 and 0.3.13.post1 hang this way
(a data race on a session's progress timer corrupts the heap; every sender thread then
waits forever), after 50 to 300 s of this load on this project's 2-core machine; the
extras leave them out. Slow: two minutes of writes, a regression check for the pinned
release and a likely (not certain) catch of a release with that bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")
pytestmark = pytest.mark.slow

RECEIVER = """
import json, sys, time
import numpy as np
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.2", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(int(sys.argv[2]), dtype=np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"rpc": e.get_rpc_port(), "addr": buf.ctypes.data}, f)
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""

SENDER = """
import json, os, sys, threading, time
import numpy as np
from mooncake.engine import TransferEngine
info, threads, seconds, stall_s = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
n, chunks = 4 << 20, 8
src = np.ones(n * threads, dtype=np.uint8)
assert e.register_memory(src.ctypes.data, src.nbytes) == 0
target = f"127.0.0.2:{info['rpc']}"
done, fails, last = [0] * threads, [0] * threads, [time.monotonic()] * threads
stop = time.monotonic() + seconds
def work(i):
    m = n // chunks
    while time.monotonic() < stop:
        rc = e.batch_transfer_sync_write(target, [src.ctypes.data + i * n + k * m for k in range(chunks)],
                                         [info["addr"] + i * n + k * m for k in range(chunks)], [m] * chunks)
        done[i] += 1; fails[i] += rc != 0; last[i] = time.monotonic()
workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
for w in workers:
    w.start()
stalled = []
while any(w.is_alive() for w in workers) and not stalled:
    time.sleep(1)
    now = time.monotonic()
    stalled = [i for i, w in enumerate(workers) if w.is_alive() and now - last[i] > stall_s]
print(json.dumps({"writes": sum(done), "failed": sum(fails), "stalled": stalled}), flush=True)
os._exit(0)
"""


def test_concurrent_unpooled_writes_never_stall(tmp_path: Path) -> None:
    threads, seconds, stall_s = 8, 120.0, 30.0
    env = {**os.environ, "MC_TCP_ENABLE_CONNECTION_POOL": "0"}
    ready = tmp_path / "ready.json"
    recv = subprocess.Popen([sys.executable, "-c", RECEIVER, str(ready), str(threads * (4 << 20))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert recv.poll() is None and time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.05)
        res = subprocess.run([sys.executable, "-c", SENDER, ready.read_text(), str(threads), str(seconds), str(stall_s)],
                             env=env, capture_output=True, text=True, timeout=seconds + 3 * stall_s + 60, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["stalled"] == [], f"sender threads {out['stalled']} stalled for {stall_s:.0f} s: {out}"
        assert out["failed"] == 0 and out["writes"] > 0, out
    finally:
        recv.kill()
        recv.wait()
