"""KV-transfer endpoints for the namespace testbed: real TCP flows, one per KV transfer.

``python -m ark.testbed.transfer serve`` runs in a decode host: it accepts flows, reads the 8-byte
size header and that many bytes, then closes first (so TIME_WAIT sits at the receiver and
the sender can reuse its source port at once). ``python -m ark.testbed.transfer send`` runs in a
prefill host: it starts each planned flow at its time; under ARK the flow first takes a
lease from the local agent and binds the lease's source port before connect(), under ECMP
it binds the port the plan drew for it from the run's seed (so that a seed fixes ECMP's
paths too; none planned: the kernel's ephemeral port). A flow's FCT runs from its planned
start (so it includes the reservation) to the receiver's close, and is recorded in parts:
``late_s`` (the sender's thread woke after the planned start), ``lease_s`` (asking the
agent), ``connect_s`` (from the lease to an established connection: the first byte can
go) and ``transfer_s`` (from there to the receiver's close).

Under ``ark-split`` (``SendPlan.parts`` set) a flow takes a multi-path lease and opens one
connection per part, each from its part's port; the connections take the flow's bytes a
slice at a time from one shared counter, so a part on a faster path carries more and the
parts finish together (the header then says "until EOF").

A re-path (the agent moved the reservation to a new port after the fabric re-hashed) is
followed between chunks: the connection ends early and the rest of the bytes go on a
new connection from the new port, as a KV engine moving a QP's UDP source port would.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ark.core.flows import FlowSpec

_HEADER = struct.Struct("!Q")
UNTIL_EOF = 2**64 - 1  # a header saying: read until the sender shuts its side
_SLICE = 1 << 17  # what a split flow's connection takes from the shared counter at a time


class SendPlan(msgspec.Struct):
    """One sender's flows and the addresses they go to."""

    flows: list[FlowSpec]
    names: dict[int, str]  # host index -> cluster name (what the agent is asked for)
    ips: dict[int, str]  # host index -> data address
    dport: int
    ports: dict[int, int] = {}  # ECMP: flow id -> the source port the run's seed drew
    parts: int | None = None  # ark-split: parts of each flow's lease (0: the agent's choice)

    def dst(self, f: FlowSpec) -> tuple[str, int]:
        return self.ips[f.dst], self.dport
_CHUNK = memoryview(bytes(1 << 20))


def _read_exact(conn: socket.socket, n: int, buf: bytearray) -> int:
    got = 0
    view = memoryview(buf)
    while got < n:
        k = conn.recv_into(view, min(len(buf), n - got))
        if k == 0:
            break
        got += k
    return got


def _serve_one(conn: socket.socket) -> None:
    buf = bytearray(1 << 20)
    try:
        head = bytearray(_HEADER.size)
        if _read_exact(conn, _HEADER.size, head) == _HEADER.size:
            (n,) = _HEADER.unpack(head)
            if n == UNTIL_EOF:
                while conn.recv_into(buf):
                    pass
            else:
                _read_exact(conn, n, buf)
    except OSError:
        pass
    finally:
        conn.close()


def serve(bind_ip: str, port: int, ready: str | None = None) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind_ip, port))
    srv.listen(256)
    if ready:
        with open(ready, "w") as f:
            f.write("ready\n")
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


_CHECK_S = 0.05  # how often a running ARK flow asks its agent whether it was re-pathed


def _connect(src_ip: str, sport: int, dst: tuple[str, int], patience_s: float = 2.0) -> socket.socket:
    """Connect from ``sport``; wait out a short-lived holder of the same 4-tuple.

    A path probe (ark probe) briefly owns the 4-tuple of the port it probes; connect()
    then fails with EADDRNOTAVAIL until the probe socket closes (well under a second).
    """
    deadline = time.monotonic() + patience_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((src_ip, sport))
            s.connect(dst)
            return s
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRNOTAVAIL or sport == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _segment(src_ip: str, sport: int, dst: tuple[str, int], nbytes: int,
             moved: Callable[[], bool]) -> tuple[int, int, float]:
    """Send up to ``nbytes`` on one connection from ``sport``; stop early if ``moved()``.

    Returns (the source port used, bytes delivered, when the connection was established).
    Stopping early shuts the write side: the receiver reads to EOF, so every byte sent so
    far still arrives.
    """
    s = _connect(src_ip, sport, dst)
    connected = time.time()
    try:
        port = s.getsockname()[1]
        s.sendall(_HEADER.pack(nbytes))
        sent, next_check = 0, time.monotonic() + _CHECK_S
        while sent < nbytes:
            k = min(nbytes - sent, 1 << 17)
            s.sendall(_CHUNK[:k])
            sent += k
            if sent < nbytes and time.monotonic() >= next_check:
                next_check = time.monotonic() + _CHECK_S
                if moved():
                    s.shutdown(socket.SHUT_WR)
                    break
        # Done when the receiver closes: every byte has arrived.
        while s.recv(64):
            pass
        return port, sent, connected
    finally:
        s.close()


def _segments(src_ip: str, dst: tuple[str, int], nbytes: int, t0: float, port: int, path: int | None,
              reserved: bool, current: Callable[[], tuple[int, int, bool]] | None) -> list[dict[str, Any]]:
    """Send the flow's bytes, on a new connection each time ``current()`` names a new port."""
    left, segs = nbytes, []
    while left > 0:
        latest = (port, path, reserved)

        def moved(now_port: int = port) -> bool:
            nonlocal latest
            if current is None:
                return False
            latest = current()
            return latest[0] != now_port

        t = time.time()
        used, sent, connected = _segment(src_ip, port, dst, left, moved)
        segs.append({"sport": used, "path": path, "reserved": reserved, "start_s": t - t0, "t0": t,
                     "connected": connected, "bytes": sent, "t1": time.time()})
        left -= sent
        port, path, reserved = latest
    return segs


def _split_segments(src_ip: str, dst: tuple[str, int], nbytes: int, t0: float, parts: Sequence[Any]) -> list[dict[str, Any]]:
    """One connection per part of a multi-path lease, all taking slices of ``nbytes`` from
    one counter until none is left; a segment per connection, in part order."""
    left = [nbytes]
    lock = threading.Lock()
    segs: list[dict[str, Any] | None] = [None] * len(parts)
    errors: list[BaseException] = []

    def take() -> int:
        with lock:
            k = min(_SLICE, left[0])
            left[0] -= k
            return k

    def one(i: int, lease: Any) -> None:
        t = time.time()
        try:
            s = _connect(src_ip, lease.src_port, dst)
        except OSError as e:
            errors.append(e)
            return
        connected, sent = time.time(), 0
        try:
            s.sendall(_HEADER.pack(UNTIL_EOF))
            while k := take():
                s.sendall(_CHUNK[:k])
                sent += k
            s.shutdown(socket.SHUT_WR)
            while s.recv(64):  # done when the receiver closes: every byte has arrived
                pass
        except OSError as e:
            errors.append(e)
        finally:
            s.close()
        segs[i] = {"sport": lease.src_port, "path": lease.path, "reserved": lease.reserved, "part": i,
                   "start_s": t - t0, "t0": t, "connected": connected, "bytes": sent, "t1": time.time()}

    threads = [threading.Thread(target=one, args=(i, le)) for i, le in enumerate(parts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors or left[0]:
        raise errors[0] if errors else OSError(f"{left[0]} bytes unsent: every part's connection failed")
    out = [sg for sg in segs if sg is not None]
    out.sort(key=lambda sg: sg["connected"])  # the first to connect is when the first byte could go
    return out


def _flow(f: FlowSpec, plan: SendPlan, src_ip: str, t0: float, api: str | None, out: list[dict[str, Any]]) -> None:
    from ark.agent.client import ArkClient, ArkClientError, HeldSplit

    planned = t0 + f.start_s
    delay = planned - time.time()
    if delay > 0:
        time.sleep(delay)
    rec: dict[str, Any] = {"id": f.id, "src": plan.names[f.src], "dst": plan.names[f.dst], "bytes": f.nbytes,
                           "planned_s": f.start_s, "sport": None, "path": None, "reserved": False,
                           "lease_flow": None, "segments": [], "error": None}
    client = ArkClient(api, timeout_s=5.0) if api else None
    dst = plan.dst(f)
    t = time.time()
    rec.update(late_s=max(0.0, t - planned), lease_s=0.0)
    try:
        if client is None:  # ECMP: the planned port (or an ephemeral one), never moved
            segs = _segments(src_ip, dst, f.nbytes, t0, plan.ports.get(f.id, 0), None, False, None)
        elif plan.parts is not None:
            with client.lease(plan.names[f.dst], f.nbytes, plan.dport, parts=plan.parts) as held:
                took = time.time() - t
                assert isinstance(held, HeldSplit)
                first = next((le for le in held.parts if le.reserved), held.parts[0])
                rec.update(reserve_s=took, lease_s=took, path=first.path, reserved=first.reserved,
                           lease_flow=list(first.flow_id), parts=len(held.parts))
                segs = _split_segments(src_ip, dst, f.nbytes, t0, held.parts)
        else:
            with client.lease(plan.names[f.dst], f.nbytes, plan.dport) as ls:
                took = time.time() - t
                rec.update(reserve_s=took, lease_s=took, path=ls.path, reserved=ls.reserved, lease_flow=list(ls.flow_id))

                def current() -> tuple[int, int, bool]:
                    c = client.current(ls.flow_id)
                    return c.src_port, c.path, c.reserved

                segs = _segments(src_ip, dst, f.nbytes, t0, ls.src_port, ls.path, ls.reserved, current)
        done = time.time()
        rec.update(segments=segs, sport=segs[0]["sport"] if segs else None, fct_s=done - planned)
        if segs:
            lease_at = t + rec["lease_s"]
            rec.update(connect_s=max(0.0, segs[0]["connected"] - lease_at), transfer_s=done - segs[0]["connected"])
    except (OSError, ArkClientError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if client is not None:
            client.close()
    out.append(rec)


def run_flows(flow: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """One thread per flow, ``flow(*a, out)`` appending its record; the records by flow id."""
    out: list[dict[str, Any]] = []
    threads = [threading.Thread(target=flow, args=(*a, out)) for a in args]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(out, key=lambda r: r["id"])


def send(plan: SendPlan, src_ip: str, t0: float, api: str | None) -> list[dict[str, Any]]:
    return run_flows(_flow, [(f, plan, src_ip, t0, api) for f in plan.flows])


def add_send_parser(sub: Any, plan_help: str) -> None:
    """The ``send`` subcommand of a testbed sender (plan, source address, start, agent, output)."""
    c = sub.add_parser("send")
    c.add_argument("--plan", required=True, help=plan_help)
    c.add_argument("--src-ip", required=True)
    c.add_argument("--t0", type=float, required=True, help="wall-clock time of plan offset 0")
    c.add_argument("--api", help="agent API endpoint (ARK); absent: ECMP")
    c.add_argument("--out", required=True)


def run_send(a: argparse.Namespace, plan_type: type[Any], sender: Callable[..., list[dict[str, Any]]]) -> int:
    """Decode the plan file, send, write the flow records."""
    with open(a.plan, "rb") as fp:
        plan = msgspec.json.decode(fp.read(), type=plan_type)
    res = sender(plan, a.src_ip, a.t0, a.api)
    with open(a.out, "w") as fp:
        json.dump(res, fp)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.testbed.transfer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--ready")
    add_send_parser(sub, "JSON SendPlan: flows and addresses")
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.bind, a.port, a.ready)
        return 0
    return run_send(a, SendPlan, send)


if __name__ == "__main__":
    sys.exit(main())
