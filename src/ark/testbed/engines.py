"""A testbed run whose KV flows are moved by Mooncake Transfer Engines (``--engine mooncake``).

The runner's side of :mod:`ark.testbed.mooncake`: receivers in the decode hosts (handshake
and data ports drawn from two ports, both probed), senders in the prefill hosts with the
``connect()`` interposer preloaded and one connection per request, the same engine
configuration under ECMP and ARK; at the end every receiver checks the bytes of every flow.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ark.integrations.preload import preload_env
from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError
from ark.testbed.mooncake import EnginePlan, Target, receiver_offsets

if TYPE_CHECKING:
    import subprocess

    from ark.testbed.run import TestbedRun


PAIRS = 16  # port pairs tried from the testbed's destination port up
LEAD_S = 8.0  # senders start this long after they are spawned (engine set-up)


def data_ports(st: State, receivers: list[int]) -> list[int]:
    """Two ports for the receivers' engines (handshake and data: both are probed).

    The first pair from the testbed's destination port up that every receiver can bind:
    a previous run's handshake connections leave TIME_WAIT on its ports for a minute, and
    Mooncake binds its ports without SO_REUSEADDR.
    """
    for k in range(PAIRS):
        lo = st.spec.dport + 2 * k
        if all(_free(st, d, lo) and _free(st, d, lo + 1) for d in receivers):
            return [lo, lo + 1]
    raise TestbedError(f"mooncake: no free port pair in {st.spec.dport}..{st.spec.dport + 2 * PAIRS - 1} "
                       "on every receiver; wait a minute for TIME_WAIT to end")


def _free(st: State, host: int, port: int) -> bool:
    with netns.inside(st.layout.host_ns(host)), socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def start_receivers(tr: TestbedRun, receivers: list[int]) -> list[int]:
    _offsets, size = receiver_offsets(tr.flows)
    lo = tr.dports[0]
    env = {**os.environ, "MC_MIN_RPC_PORT": str(lo), "MC_MAX_RPC_PORT": str(lo + 1)}
    for d in receivers:
        w = tr.work
        tr._spawn(d, [sys.executable, "-m", "ark.testbed.mooncake", "serve", "--bind", tr.st.layout.host_ip(d),
                      "--size", str(size[d]), "--ready", str(w / f"ready-gpu{d}"), "--done", str(w / f"done-gpu{d}"),
                      "--out", str(w / f"verify-gpu{d}")], f"recv-gpu{d}.log", env)
    return receivers


def start_senders(tr: TestbedRun, t0: float) -> list[subprocess.Popen[bytes]]:
    lay, fab = tr.st.layout, tr.st.spec.fabric()
    names = {h.index: h.name for h in fab.hosts}
    targets = {d: msgspec.json.decode((tr.work / f"ready-gpu{d}").read_bytes(), type=Target)
               for d in sorted({f.dst for f in tr.flows})}
    offsets, _size = receiver_offsets(tr.flows)
    env = preload_env()
    env["MC_TCP_ENABLE_CONNECTION_POOL"] = "0"  # one connection per request, under ECMP and ARK alike
    out = []
    for s in tr.senders:
        mine = [f for f in tr.flows if f.src == s]
        plan = EnginePlan(mine, names, {i: lay.host_ip(i) for i in names}, targets,
                          {f.id: offsets[f.id] for f in mine}, tr.params.buffers, tr.params.split_parts)
        pf = tr.work / f"plan-gpu{s}.json"
        pf.write_bytes(msgspec.json.encode(plan))
        argv = [sys.executable, "-m", "ark.testbed.mooncake", "send", "--plan", str(pf), "--src-ip", lay.host_ip(s),
                "--t0", repr(t0), "--out", str(tr.work / f"out-gpu{s}.json")]
        if s in tr.apis and tr.params.scheme != "ecmp":
            argv += ["--api", tr.apis[s]]
        out.append(tr._spawn(s, argv, f"send-gpu{s}.log", env))
    tr.progress(f"{len(tr.flows)} flows from {len(tr.senders)} Mooncake senders, {tr.params.buffers} request(s) each")
    return out


def verify(tr: TestbedRun, receivers: list[int], timeout_s: float = 120.0) -> dict[int, bool]:
    """Every receiver checks the bytes of each flow it got: flow id -> verdict."""
    offsets, _size = receiver_offsets(tr.flows)
    for d in receivers:
        expect = [[f.id, offsets[f.id], f.nbytes] for f in tr.flows if f.dst == d]
        tmp = tr.work / f"done-gpu{d}.tmp"
        tmp.write_text(json.dumps(expect))
        tmp.replace(tr.work / f"done-gpu{d}")
    verdicts: dict[int, bool] = {}
    deadline = time.monotonic() + timeout_s
    for d in receivers:
        f = tr.work / f"verify-gpu{d}"
        while not f.exists():
            if time.monotonic() > deadline:
                raise TestbedError(f"receiver gpu{d} did not verify its bytes; see {tr.work}/recv-gpu{d}.log")
            time.sleep(0.05)
        time.sleep(0.05)  # written in one call; let it close
        verdicts.update({int(k): bool(v) for k, v in json.loads(f.read_text()).items()})
    return verdicts


def add_verdicts(rec: dict[str, Any], verdicts: dict[int, bool]) -> None:
    """Per flow ``verified``; per run the flows and the bytes that arrived intact."""
    total = ok = n_ok = 0
    for fr in rec["flows"]:
        fr["verified"] = verdicts.get(fr["id"], False)
        total += fr["bytes"]
        ok += fr["bytes"] if fr["verified"] else 0
        n_ok += fr["verified"]
    rec["flows_verified"] = n_ok
    rec["bytes_verified_fraction"] = ok / total if total else None
    # How late the latest flow started after its planned time (a late start counts in its FCT).
    # Races lost while sending: the table moved the flow, its connection could not follow.
    rec["repathed_while_sending"] = sum(1 for fr in rec["flows"] if fr.get("repathed"))
    # Leases that reserved nothing (every path busy): their connections were left to ECMP.
    rec["ecmp_fallbacks"] = sum(1 for fr in rec["flows"] if fr.get("ecmp"))
    rec["start_late_max_s"] = max((fr.get("late_s") or 0.0 for fr in rec["flows"]), default=0.0)
