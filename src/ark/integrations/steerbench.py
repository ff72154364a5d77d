"""What the ``connect()`` interposer costs per connection (``ark bench steer``).

Each mode runs in its own process against a local TCP listener that accepts and closes
(so the client side keeps no TIME_WAIT and its ports stay free), and times ``connect()``
alone, from Python, so Python's own share is the same in every mode:

* ``plain``: the interposer is not loaded (the C library's ``connect``);
* ``idle``: loaded, the thread has no rule (every engine thread that is not steered);
* ``other``: loaded, the thread's rule names another peer (the rule is looked at, not used);
* ``steered``: the rule binds each connection to its next port, the first one tried free;
* ``skip``: every other port of the rule is held by another socket: one failed bind per
  connection before the free port.

The steering overhead is a steered mode's median minus ``idle``'s, measured in one process
with the modes taking turns connection by connection. The per-transfer lease
(one agent round trip) is not part of it: it is paid once per transfer, not per connection.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

MODES = ("plain", "idle", "other", "steered", "skip")


def _listener() -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)

    def run() -> None:
        while True:
            c, _ = srv.accept()
            c.close()  # the server closes first: no TIME_WAIT on the client's port

    threading.Thread(target=run, daemon=True).start()
    return int(srv.getsockname()[1])


def _dial(port: int) -> int:
    s = socket.socket()
    t = time.perf_counter_ns()
    s.connect(("127.0.0.1", port))
    dt = time.perf_counter_ns() - t
    s.recv(1)
    s.close()
    return dt


def measure(preloaded: bool, n: int, base: int) -> dict[str, list[int]]:
    """Nanoseconds per ``connect()``, ``n`` connections per mode, in this process.

    Preloaded, the modes take turns connection by connection, so a drift of the machine
    falls on all of them alike; the rules are entered and left outside the timed call.
    """
    from ark.integrations.preload import Rule

    port = _listener()
    for _ in range(50):  # warm up the listener, the allocator and the code paths
        _dial(port)
    if not preloaded:
        return {"plain": [_dial(port) for _ in range(n)]}
    held = []
    for p in range(base + n, base + 3 * n, 2):  # the skip rule: every other port held
        h = socket.socket()
        try:
            h.bind(("0.0.0.0", p))
        except OSError:  # held by someone else already: skipped all the same
            h.close()
            continue
        held.append(h)
    rules = {"other": Rule("127.0.0.2", hint=n), "steered": Rule("127.0.0.1", hint=n),
             "skip": Rule("127.0.0.1", hint=n)}
    rules["steered"].add_ports(list(range(base, base + n)))
    rules["skip"].add_ports(list(range(base + n, base + 3 * n)))
    out: dict[str, list[int]] = {m: [] for m in MODES if m != "plain"}
    for _ in range(n):
        out["idle"].append(_dial(port))
        for mode, rule in rules.items():
            with rule:
                out[mode].append(_dial(port))
    for mode in ("steered", "skip"):
        if rules[mode].stats().steered != n:
            raise RuntimeError(f"{mode}: {rules[mode].stats().steered} of {n} connections steered")
    for r in rules.values():
        r.close()
    for h in held:
        h.close()
    return out


def _summary(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {"median_us": round(statistics.median(s) / 1e3, 2), "p99_us": round(s[int(0.99 * (len(s) - 1))] / 1e3, 2)}


def bench(connections: int = 2000, rounds: int = 3, base: int = 24000) -> dict[str, Any]:
    """``rounds`` of (plain process, preloaded process); per mode the median over rounds.

    The steering overhead is ``steered`` minus ``idle``: the same process, connection by
    connection. ``idle`` minus ``plain`` (two processes) says what loading the library costs
    a thread that steers nothing; on a busy machine it is mostly noise.
    """
    from ark.integrations.preload import preload_env

    if not 1 <= connections <= 2000:
        raise ValueError(f"connections: expected 1..2000; got {connections}")
    if not 1 <= rounds <= 20:
        raise ValueError(f"rounds: expected 1..20; got {rounds}")
    env = preload_env()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for preloaded in (False, True):
            cmd = [sys.executable, "-m", "ark.integrations.steerbench", str(int(preloaded)), str(connections), str(base)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env if preloaded else None,
                                 timeout=300, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"steer bench: {res.stderr.strip().splitlines()[-1:]}")
            for mode, ns in json.loads(res.stdout).items():
                runs[mode].append(_summary(ns))
    modes = {m: {k: round(statistics.median(r[k] for r in rs), 2) for k in ("median_us", "p99_us")}
             for m, rs in runs.items()}
    idle = modes["idle"]["median_us"]
    return {"connections": connections, "rounds": rounds, "modes": modes, "runs": runs,
            "overhead_us": {m: round(modes[m]["median_us"] - idle, 2) for m in ("other", "steered", "skip")},
            "preload_us": round(idle - modes["plain"]["median_us"], 2), "target_us": 100}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]))))
