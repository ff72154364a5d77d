#!/usr/bin/env python3
"""Mooncake alone under concurrent writes with one connection per request (how ARK's
steering runs it; no ARK, no interposer): does any sender thread stall?

    .venv/bin/python scripts/mooncake-load.py [--threads 8] [--chunks 8] [--chunk-bytes N]
                                              [--seconds 120] [--stall-s 30]

A receiver engine on 127.0.0.2 (its own process) and a sender engine on 127.0.0.1; each
sender thread writes batches of ``--chunks`` requests of ``--chunk-bytes`` (default 4 MiB
per batch) with ``batch_transfer_sync_write`` until ``--seconds`` have passed. Prints one
JSON line (Mooncake's version, writes, failed writes, the threads that made no progress
for ``--stall-s``) and exits 1 when a thread stalled or a write failed, else 0. Mooncake
0.3.13 and 0.3.13.post1 stall this way (docs/engines/mooncake.md);
tests/integrations/test_mooncake_threads.py runs it for two minutes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def receive(ready: str, nbytes: int) -> None:
    import numpy as np
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.2", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(nbytes, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    Path(ready + ".tmp").write_text(json.dumps({"rpc": e.get_rpc_port(), "addr": buf.ctypes.data}))
    os.replace(ready + ".tmp", ready)
    time.sleep(24 * 3600)  # until the sender kills it


def send(info: dict[str, int], a: argparse.Namespace) -> dict[str, object]:
    import numpy as np
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    per = a.chunks * a.chunk_bytes
    src = np.ones(per * a.threads, dtype=np.uint8)
    assert e.register_memory(src.ctypes.data, src.nbytes) == 0
    target = f"127.0.0.2:{info['rpc']}"
    done, failed, last = [0] * a.threads, [0] * a.threads, [time.monotonic()] * a.threads
    stop = time.monotonic() + a.seconds

    def work(i: int) -> None:
        base, peer = src.ctypes.data + i * per, info["addr"] + i * per
        offsets = [k * a.chunk_bytes for k in range(a.chunks)]
        while time.monotonic() < stop:
            rc = e.batch_transfer_sync_write(target, [base + o for o in offsets], [peer + o for o in offsets],
                                             [a.chunk_bytes] * a.chunks)
            done[i] += 1
            failed[i] += rc != 0
            last[i] = time.monotonic()

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(a.threads)]
    for w in workers:
        w.start()
    stalled: list[int] = []
    while any(w.is_alive() for w in workers) and not stalled:
        time.sleep(1)
        now = time.monotonic()
        stalled = [i for i, w in enumerate(workers) if w.is_alive() and now - last[i] > a.stall_s]
    return {"writes": sum(done), "failed": sum(failed), "stalled": stalled}


def _version() -> str | None:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=8, choices=range(1, 257), metavar="1..256")
    p.add_argument("--chunks", type=int, default=8, choices=range(1, 1025), metavar="1..1024")
    p.add_argument("--chunk-bytes", type=int, default=512 << 10)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--receive", nargs=2, metavar=("READY", "BYTES"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.receive:
        receive(a.receive[0], int(a.receive[1]))
        return 0
    for name in ("chunk_bytes", "seconds", "stall_s"):
        v = getattr(a, name)
        if not 0 < v <= (1 << 30 if name == "chunk_bytes" else 86400):
            p.error(f"--{name.replace('_', '-')}: out of range; got {v}")
    os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] = "0"  # one connection per request, from the sending thread
    with tempfile.TemporaryDirectory() as tmp:
        ready = os.path.join(tmp, "ready.json")
        nbytes = a.threads * a.chunks * a.chunk_bytes
        recv = subprocess.Popen([sys.executable, __file__, "--receive", ready, str(nbytes)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(ready):
                if recv.poll() is not None or time.monotonic() > deadline:
                    print(json.dumps({"error": "the receiver did not start"}), flush=True)
                    return 1
                time.sleep(0.05)
            out = {"mooncake": _version(), **send(json.loads(Path(ready).read_text()), a)}
        finally:
            recv.kill()
            recv.wait()
    print(json.dumps(out), flush=True)
    # Stalled sender threads never return: leave without joining them.
    os._exit(1 if out["stalled"] or out["failed"] else 0)


if __name__ == "__main__":
    sys.exit(main())
