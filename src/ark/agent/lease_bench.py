"""``ark bench lease``: what a lease costs an engine, beside what the local transport costs.

Real agent processes on loopback (two per build: the engine's and its peer), one client in
this process. Every cycle times, step by step, a reserve, a renew and a release of one
flow and a four-part reserve (its release untimed): each step first as one round trip to
an echo server (a ZeroMQ ROUTER in a process of its own on the same ``ipc://`` transport
that decodes the client's msgpack request and answers it, doing nothing else), then on
each build in turn, every call after the same short quiet. That echo is the floor: no
agent can answer faster over this transport. The builds take turns within each step, so
that the machine's load falls on all of them, and on the floor, alike.

A build is this code, an older checkout's (its ``src/`` run by its own agents, with
``PYTHONPATH``), or this code in arbiter mode (every lease through an arbiter process).
Beside the latencies: the agent's CPU per reserve+release (blocks of cycles taking turns
between builds, the agent process's CPU from ``/proc``) and the core's decision time
(:func:`ark.sim.bench._decisions`, run by each build's own code in a subprocess).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from ark.agent.bench import thread_cpu_s
from ark.agent.client import ArkClient, ArkClientError
from ark.agent.loopback import AgentProcs, write_cluster

NBYTES = 10**8  # one flow of the lease cycles (its lease is the policy's minimum)
PARTS = 4
OPS = ("reserve", "renew", "release", "reserve4")
# The targets, as ratios: one-agent reserve, renew and release p50 / p99 over the
# floor's, a four-part reserve's p50 over a one-part one's.
TARGET_P50_X_FLOOR, TARGET_P99_X_FLOOR, TARGET_PARTS_X_ONE = 1.3, 2.0, 1.5
_DECISION = ("import numpy as np\nfrom ark.core.lease import LeasePolicy\nfrom ark.sim.bench import _decisions\n"
             "print(float(np.percentile(_decisions(LeasePolicy(), {n}), 50)))")


def _echo(endpoint: str) -> None:
    """The floor's server: decode each request, answer it, nothing else (until an empty one)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(1000):
                continue
            rid, empty, body = s.recv_multipart()
            req = msgpack.unpackb(body, raw=False)
            s.send_multipart([rid, empty, msgpack.packb({"ok": True, "echo": req}, use_bin_type=True)])
            if req.get("op") == "stop":
                return
    finally:
        ctx.destroy(0)


@dataclass
class _Build:
    name: str
    procs: AgentProcs
    src: str
    dst: str
    parts: bool = True  # the build has multi-path leases
    flow: tuple[int, int] | None = None  # the flow of the cycle under way
    lat: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: int = 0
    cpu_s: float = 0.0
    cpu_cycles: int = 0


def _cluster(wd: Path, src_path: str | None, arbiter: bool) -> tuple[Path, list[str]]:
    """Keys and a cluster file for two agents, written by the build's own code."""
    (wd / "api").mkdir(parents=True)
    if src_path is None:
        return write_cluster(wd, 2, peer_rate=1e6, lease_min_s=5.0, arbiters=int(arbiter),
                             control="arbiter" if arbiter else "broadcast")
    code = ("import sys; from pathlib import Path; from ark.agent.loopback import write_cluster\n"
            "p, names = write_cluster(Path(sys.argv[1]), 2, peer_rate=1e6, lease_min_s=5.0)\n"
            "print(p); print(*names)")
    res = subprocess.run([sys.executable, "-c", code, str(wd)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": src_path}, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"old build at {src_path}: could not write its cluster file: "
                           f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
    path, names = res.stdout.strip().splitlines()[-2:]
    return Path(path), names.split()


@contextlib.contextmanager
def _builds(root: Path, old: str | None, arbiter: bool) -> Iterator[list[_Build]]:
    specs: list[tuple[str, str | None, bool]] = [("new", None, False)]
    if old is not None:
        specs.append(("old", str(Path(old) / "src"), False))
    if arbiter:
        specs.append(("arbiter", None, True))
    builds: list[_Build] = []
    try:
        for name, src_path, arb in specs:
            wd = root / name
            cfile, names = _cluster(wd, src_path, arb)
            procs = AgentProcs(cfile, names, wd, pythonpath=src_path)
            builds.append(_Build(name, procs, names[0], names[1]))
            for n in (["arb0"] if arb else []) + names:
                procs.start(n)
        for b in builds:
            b.procs.wait_ready(b.procs.names, 60.0)
        yield builds
    finally:
        for b in builds:
            b.procs.stop_all()


def _step(c: ArkClient, b: _Build, step: int) -> None:
    """One step of a build's cycle, timed: 0 reserve, 1 renew, 2 release (of one flow),
    3 a four-part reserve (its release untimed), where the build has multi-path leases."""
    t = time.perf_counter
    try:
        if step == 3 and not b.parts:
            return
        t0 = t()
        if step == 0:
            b.flow = c.reserve(b.dst, NBYTES, wait_ready_s=0).flow_id
        elif step == 1 and b.flow is not None:
            c.renew(b.flow)
        elif step == 2 and b.flow is not None:
            c.release(b.flow)
            b.flow = None
        elif step == 3:
            parts = c.reserve_split(b.dst, PARTS * NBYTES, parts=PARTS, wait_ready_s=0)
            b.lat["reserve4"].append(t() - t0)
            c.release_split([p.flow_id for p in parts])
            return
        else:
            return
        b.lat[OPS[step]].append(t() - t0)
    except ArkClientError as e:
        if step == 3 and "parts" in str(e):  # a build without multi-path leases
            b.parts = False
        else:
            b.errors += 1


def _cycle(ec: ArkClient, clients: dict[str, ArkClient], builds: list[_Build], i: int, floor: list[float],
           pause_s: float) -> None:
    """One cycle: each step in turn, on the floor's echo and then on every build (their
    order rotating from cycle to cycle), each after ``pause_s`` of quiet, so that every
    operation, the echo's too, meets a process that was waiting for it: an engine's lease
    comes to an agent that was idle, not to one still busy with the last."""
    order = builds[i % len(builds):] + builds[:i % len(builds)]
    for step in range(len(OPS)):
        time.sleep(pause_s)
        t0 = time.perf_counter()
        ec.call({"op": "reserve", "dst": "gpu1", "nbytes": NBYTES, "dport": 4791})
        floor.append(time.perf_counter() - t0)
        for b in order:
            time.sleep(pause_s)
            _step(clients[b.name], b, step)


def _cpu_block(c: ArkClient, b: _Build, cycles: int) -> None:
    """``cycles`` reserve+release cycles back to back; the engine's agent's CPU over them."""
    pid = b.procs.procs[b.src].pid
    cpu0 = sum(thread_cpu_s([pid]).values())
    for _ in range(cycles):
        try:
            c.release(c.reserve(b.dst, NBYTES, wait_ready_s=0).flow_id)
        except ArkClientError:
            b.errors += 1
    b.cpu_s += sum(thread_cpu_s([pid]).values()) - cpu0
    b.cpu_cycles += cycles


def _decision_us(src_path: str | None, n: int) -> float | None:
    """The core's decision p50 (us), measured by the build's own code."""
    env = {**os.environ, "PYTHONPATH": src_path or str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-c", _DECISION.format(n=n)], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    return float(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None


def _stats(xs: list[float]) -> dict[str, float | int | None]:
    us = np.asarray(xs) * 1e6
    if not us.size:
        return {"n": 0, "p50_us": None, "p99_us": None}
    return {"n": int(us.size), "p50_us": round(float(np.percentile(us, 50)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1)}


def lease_bench(samples: int = 2000, old: str | None = None, arbiter: bool = True, cpu_cycles: int = 2000,
                decisions: int = 20000, pause_s: float = 0.0005) -> dict[str, Any]:
    """The figures (see the module docstring): ``samples`` cycles per build, ``old`` the
    root of an older checkout (None: none), ``arbiter`` also this code in arbiter mode."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ark-lease-bench-") as tmp:
        root = Path(tmp)
        echo_ep = f"ipc://{root}/echo.sock"
        echo = subprocess.Popen([sys.executable, "-c", "import sys; from ark.agent.lease_bench import _echo; "
                                 "_echo(sys.argv[1])", echo_ep], stdin=subprocess.DEVNULL)
        floor: list[float] = []
        try:
            with _builds(root, old, arbiter) as builds, ArkClient(echo_ep, timeout_s=10.0) as ec:
                clients = {b.name: ArkClient(b.procs.api(b.src), timeout_s=10.0) for b in builds}
                _wait_echo(ec)
                for i in range(50):  # warm up: connections, buckets, the first sync
                    _cycle(ec, clients, builds, i, [], 0.0)
                for b in builds:
                    b.lat, b.errors = {op: [] for op in OPS}, 0
                for i in range(samples):
                    _cycle(ec, clients, builds, i, floor, pause_s)
                blocks = 4
                for _ in range(blocks):
                    for b in builds:
                        if b.name != "arbiter":
                            _cpu_block(clients[b.name], b, cpu_cycles // blocks)
                for c in clients.values():
                    c.close()
                with contextlib.suppress(ArkClientError):
                    ec.call({"op": "stop"})
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                echo.wait(5)
            if echo.poll() is None:
                echo.kill()
                echo.wait()
    dec: dict[str, list[float | None]] = {"new": [], "old": []}
    for _ in range(3):  # taking turns, as the latencies do
        dec["new"].append(_decision_us(None, decisions))
        if old is not None:
            dec["old"].append(_decision_us(str(Path(old) / "src"), decisions))
    return _report(builds, floor, dec, load_before, os.getloadavg(), samples, old)


def _wait_echo(ec: ArkClient, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ec.call({"op": "ping"})
            return
        except ArkClientError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _report(builds: list[_Build], floor: list[float], dec: dict[str, list[float | None]],
            load_before: tuple[float, float, float], load_after: tuple[float, float, float], samples: int,
            old: str | None) -> dict[str, Any]:
    fl = _stats(floor)
    out: dict[str, Any] = {"samples": samples, "nbytes": NBYTES, "parts": PARTS, "cpus": os.cpu_count(),
                           "load_average_before": [round(x, 2) for x in load_before],
                           "load_average_after": [round(x, 2) for x in load_after], "old": old,
                           "floor": fl, "builds": {}}
    for b in builds:
        ops = {op: _stats(v) for op, v in b.lat.items()}
        d = [x for x in dec.get(b.name, []) if x is not None]
        out["builds"][b.name] = {
            "ops": ops, "errors": b.errors,
            "agent_cpu_us_per_reserve_release": round(b.cpu_s / b.cpu_cycles * 1e6, 1) if b.cpu_cycles else None,
            "decision_us_p50": round(float(np.median(d)), 3) if d else None,
            "x_floor": {op: {q: _ratio(s[q], fl[q]) for q in ("p50_us", "p99_us")} for op, s in ops.items()},
        }
    out["targets"] = _targets(out)
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _targets(r: dict[str, Any]) -> dict[str, Any]:
    """Each target of the lease path, and whether this run met it."""
    new = r["builds"]["new"]
    t: dict[str, Any] = {}
    for op in ("reserve", "renew", "release"):
        x = new["x_floor"][op]
        t[f"{op}_p50_x_floor"] = {"value": x["p50_us"], "target": TARGET_P50_X_FLOOR,
                                  "met": x["p50_us"] is not None and x["p50_us"] <= TARGET_P50_X_FLOOR}
        t[f"{op}_p99_x_floor"] = {"value": x["p99_us"], "target": TARGET_P99_X_FLOOR,
                                  "met": x["p99_us"] is not None and x["p99_us"] <= TARGET_P99_X_FLOOR}
    parts = _ratio(new["ops"]["reserve4"]["p50_us"], new["ops"]["reserve"]["p50_us"])
    t["reserve4_p50_x_reserve"] = {"value": parts, "target": TARGET_PARTS_X_ONE,
                                   "met": parts is not None and parts <= TARGET_PARTS_X_ONE}
    old = r["builds"].get("old")
    if old is not None:
        for key in ("agent_cpu_us_per_reserve_release", "decision_us_p50"):
            v = _ratio(new[key], old[key])
            t[f"{key}_x_old"] = {"value": v, "target": 1.0, "met": v is not None and v <= 1.0}
    return t
