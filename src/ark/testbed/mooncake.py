"""Mooncake Transfer Engine endpoints for the namespace testbed: KV flows moved by real engines.

``python -m ark.testbed.mooncake serve`` runs in a decode host: a ``TransferEngine`` (TCP,
``P2PHANDSHAKE``, no metadata server) with one registered receive buffer; every flow to this
host writes its own region of it. When told (the ``--done`` file), it checks every region
against the bytes the sender wrote (a pattern seeded by the flow id) and writes the verdicts.

``python -m ark.testbed.mooncake send`` runs in a prefill host with the ``connect()``
interposer preloaded: each planned flow, at its time, splits its bytes into ``buffers``
requests (as a connector sends a KV cache block range by block range) and submits them with
``transfer_submit_write``, then polls ``transfer_check_status``. The engine opens one
connection per request (``MC_TCP_ENABLE_CONNECTION_POOL=0``). Under ARK the flow runs inside
:meth:`SteeredTransferEngine.steer`: a lease, and every connection on a port of its path;
under ECMP the engine is the plain ``TransferEngine`` and its connections are only recorded.
(The synchronous calls spin a core each while they wait; a dozen waits at once would starve
the 2-core testbed, so flows poll with short sleeps instead.)

A receiver's data port is the one the agents' maps must cover: Mooncake draws its handshake
and data ports from ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT``; the testbed gives it two ports, so
the data port is the one its handshake did not take, and both are probed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from ark.core.flows import FlowSpec
from ark.testbed.transfer import add_send_parser, run_flows, run_send

POLL_S = 0.005  # how often a flow asks the engine whether its requests are done


class Target(msgspec.Struct):
    """A receiver, as its ready file describes it."""

    rpc_port: int
    data_port: int
    addr: int  # base address of its registered receive buffer


class EnginePlan(msgspec.Struct):
    """One sender's flows, where each goes and at what offset of the receiver's buffer."""

    flows: list[FlowSpec]
    names: dict[int, str]  # host index -> cluster name
    ips: dict[int, str]  # host index -> data address
    targets: dict[int, Target]  # receiver host index -> its engine
    offsets: dict[int, int]  # flow id -> offset in its receiver's buffer
    buffers: int  # requests (connections) per flow
    parts: int | None = None  # ark-split: parts of each flow's multi-path lease (0: the agent's choice)


def pattern(flow_id: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes flow ``flow_id`` carries (both ends compute them)."""
    return np.frombuffer(np.random.default_rng(flow_id).bytes(nbytes), dtype=np.uint8)


def split(nbytes: int, parts: int) -> list[int]:
    """``nbytes`` in ``parts`` nearly equal requests (no empty one)."""
    parts = max(1, min(parts, nbytes))
    q, r = divmod(nbytes, parts)
    return [q + (i < r) for i in range(parts)]


def receiver_offsets(flows: Sequence[FlowSpec]) -> tuple[dict[int, int], dict[int, int]]:
    """(flow id -> offset in its receiver's buffer, receiver -> buffer size)."""
    offsets: dict[int, int] = {}
    size: dict[int, int] = {}
    for f in flows:
        offsets[f.id] = size.get(f.dst, 0)
        size[f.dst] = offsets[f.id] + f.nbytes
    return offsets, size


# ---------------------------------------------------------------------------- receiver
def serve(bind_ip: str, size: int, ready: str, done: str, out: str) -> None:
    from mooncake.engine import TransferEngine

    lo = int(os.environ["MC_MIN_RPC_PORT"])
    eng = TransferEngine()
    if eng.initialize(bind_ip, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    rpc = eng.get_rpc_port()
    if rpc not in (lo, lo + 1):
        raise RuntimeError(f"mooncake: handshake port {rpc} outside {lo}..{lo + 1}")
    buf = np.zeros(max(1, size), dtype=np.uint8)
    if eng.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    with open(ready + ".tmp", "w") as f:
        json.dump({"rpc_port": rpc, "data_port": 2 * lo + 1 - rpc, "addr": buf.ctypes.data}, f)
    os.replace(ready + ".tmp", ready)
    while not os.path.exists(done):
        time.sleep(0.05)
    with open(done) as f:
        expect = json.load(f)  # [[flow id, offset, bytes], ...]
    verdicts = {str(fid): bool(np.array_equal(buf[off:off + n], pattern(fid, n))) for fid, off, n in expect}
    with open(out, "w") as f:
        json.dump(verdicts, f)


# ---------------------------------------------------------------------------- sender
def _wait(eng: Any, ids: list[int], deadline: float) -> str | None:
    """Poll the submitted requests until each is done; an error text, or None."""
    pending = list(ids)
    while pending:
        left = []
        for bid in pending:
            st = eng.transfer_check_status(bid)
            if st < 0:
                return f"request failed (status {st})"
            if st == 0:
                left.append(bid)
        pending = left
        if pending:
            if time.monotonic() > deadline:
                return "timed out"
            time.sleep(POLL_S)
    return None


def _submit(eng: Any, plan: EnginePlan, f: FlowSpec, src_addr: int) -> tuple[list[int], list[int], str | None]:
    tgt = plan.targets[f.dst]
    target = f"{plan.ips[f.dst]}:{tgt.rpc_port}"
    sizes, pos = split(f.nbytes, plan.buffers), 0
    ids: list[int] = []
    for n in sizes:
        bid = eng.transfer_submit_write(target, src_addr + pos, tgt.addr + plan.offsets[f.id] + pos, n)
        if bid == 0:
            return sizes, ids, "submit failed"
        ids.append(bid)
        pos += n
    return sizes, ids, _wait(eng, ids, time.monotonic() + 120)


def _flow(eng: Any, plan: EnginePlan, f: FlowSpec, src_addr: int, t0: float, out: list[dict[str, Any]]) -> None:
    from ark.integrations.mooncake import SteeredTransferEngine
    from ark.integrations.preload import Rule

    planned = t0 + f.start_s
    if planned > time.time():
        time.sleep(planned - time.time())
    rec: dict[str, Any] = {"id": f.id, "src": plan.names[f.src], "dst": plan.names[f.dst], "bytes": f.nbytes,
                           "planned_s": f.start_s, "path": None, "reserved": False, "lease_flow": None,
                           "segments": [], "error": None, "sport": None}
    target = f"{plan.ips[f.dst]}:{plan.targets[f.dst].rpc_port}"
    t = time.time()
    rec["late_s"] = max(0.0, t - planned)
    try:
        if isinstance(eng, SteeredTransferEngine):
            with eng.steer(target, f.nbytes, plan.buffers) as tr:
                sizes, _ids, err = _submit(eng, plan, f, src_addr)
                t1 = time.time()  # every byte is in: the lease's release is bookkeeping
            conns, port_paths, parts = tr.connections, tr.port_paths, tr.connection_parts()
            rec.update(reserve_s=tr.reserve_s, steer_error=tr.error, repathed=tr.repathed,
                       ecmp=tr.ecmp, parts=len(tr.leases))
            lease = next((le for le in tr.leases if le.reserved), tr.lease)
            if lease is not None:  # a lease that reserved nothing steers nothing: no path to check
                rec.update(path=None if tr.ecmp else lease.path, reserved=lease.reserved, lease_flow=list(lease.flow_id))
        else:
            with Rule(plan.ips[f.dst], skip_port=plan.targets[f.dst].rpc_port, steer=False) as rule:
                sizes, _ids, err = _submit(eng, plan, f, src_addr)
                t1 = time.time()
            conns, port_paths, parts = rule.connections(), {}, []
            rule.close()
        rec["segments"] = [{"sport": c.sport, "dport": c.dport, "steered": c.steered,
                            "path": port_paths.get(c.sport, rec["path"]), "part": part,
                            "reserved": rec["reserved"], "bytes": n, "t0": t, "t1": t1, "start_s": t - t0}
                           for c, n, part in zip(conns, sizes, parts or [None] * len(conns), strict=False)]
        rec.update(error=err, fct_s=t1 - planned, connections=len(conns),
                   sport=conns[0].sport if conns else None)
    except Exception as e:  # a flow's failure is its record's, not the sender's
        rec["error"] = f"{type(e).__name__}: {e}"
    out.append(rec)


def send(plan: EnginePlan, src_ip: str, t0: float, api: str | None) -> list[dict[str, Any]]:
    from ark.integrations.mooncake import SteeredTransferEngine

    if api:
        eng: Any = SteeredTransferEngine(agent=api, hosts={plan.ips[i]: n for i, n in plan.names.items()},
                                         parts=plan.parts)
    else:
        from mooncake.engine import TransferEngine

        eng = TransferEngine()
    if eng.initialize(src_ip, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    total = sum(f.nbytes for f in plan.flows)
    src = np.empty(max(1, total), dtype=np.uint8)
    starts, pos = {}, 0
    for f in plan.flows:
        src[pos:pos + f.nbytes] = pattern(f.id, f.nbytes)
        starts[f.id], pos = pos, pos + f.nbytes
    if eng.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    return run_flows(_flow, [(eng, plan, f, src.ctypes.data + starts[f.id], t0) for f in plan.flows])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.testbed.mooncake")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--size", type=int, required=True)
    s.add_argument("--ready", required=True)
    s.add_argument("--done", required=True, help="appears when every sender is done: [[flow, offset, bytes]...]")
    s.add_argument("--out", required=True)
    add_send_parser(sub, "JSON EnginePlan: flows, receivers and buffer offsets")
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.bind, a.size, a.ready, a.done, a.out)
        return 0
    return run_send(a, EnginePlan, send)


if __name__ == "__main__":
    sys.exit(main())
