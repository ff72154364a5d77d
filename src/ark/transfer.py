"""KV-transfer endpoints for the namespace testbed: real TCP flows, one per KV transfer.

``python -m ark.transfer serve`` runs in a decode host: it accepts flows, reads the 8-byte
size header and that many bytes, then closes first (so TIME_WAIT sits at the receiver and
the sender can reuse its source port at once). ``python -m ark.transfer send`` runs in a
prefill host: it starts each planned flow at its time; under ARK the flow first takes a
lease from the local agent and binds the lease's source port before connect(), under ECMP
it lets the kernel pick an ephemeral port. A flow's FCT runs from its planned start (so
it includes the reservation) to the receiver's close.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

_HEADER = struct.Struct("!Q")
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


def _send(conn: socket.socket, nbytes: int) -> None:
    conn.sendall(_HEADER.pack(nbytes))
    left = nbytes
    while left > 0:
        k = min(left, len(_CHUNK))
        conn.sendall(_CHUNK[:k])
        left -= k
    # Wait for the receiver's close: the flow is done when every byte has arrived.
    while conn.recv(64):
        pass


def _flow(f: dict[str, Any], src_ip: str, t0: float, api: str | None, out: list[dict[str, Any]]) -> None:
    from ark.client import ArkClient, ArkClientError

    planned = t0 + f["start_s"]
    delay = planned - time.time()
    if delay > 0:
        time.sleep(delay)
    rec: dict[str, Any] = {"id": f["id"], "src": f["src"], "dst": f["dst"], "bytes": f["bytes"],
                           "planned_s": f["start_s"], "sport": None, "path": None, "reserved": False,
                           "shared": False, "lease_flow": None, "error": None}
    client = ArkClient(api, timeout_s=5.0) if api else None

    @contextlib.contextmanager
    def lease() -> Iterator[int]:
        if client is None:
            yield 0
            return
        t = time.time()
        with client.lease(f["dst"], f["bytes"], f["dport"]) as ls:
            rec.update(reserve_s=time.time() - t, path=ls.path, reserved=ls.reserved,
                       lease_flow=list(ls.flow_id))
            yield ls.src_port

    try:
        with lease() as sport:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((src_ip, sport))
                rec["sport"] = s.getsockname()[1]
                s.connect((f["dst_ip"], f["dport"]))
                _send(s, f["bytes"])
            finally:
                s.close()
        rec["fct_s"] = time.time() - planned
    except (OSError, ArkClientError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if client is not None:
            client.close()
    out.append(rec)


def send(plan: Sequence[dict[str, Any]], src_ip: str, t0: float, api: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    threads = [threading.Thread(target=_flow, args=(f, src_ip, t0, api, out)) for f in plan]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(out, key=lambda r: r["id"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.transfer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--ready")
    c = sub.add_parser("send")
    c.add_argument("--plan", required=True, help="JSON list of flows")
    c.add_argument("--src-ip", required=True)
    c.add_argument("--t0", type=float, required=True, help="wall-clock time of plan offset 0")
    c.add_argument("--api", help="agent API endpoint (ARK); absent: ECMP")
    c.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.bind, a.port, a.ready)
        return 0
    with open(a.plan) as fp:
        plan = json.load(fp)
    res = send(plan, a.src_ip, a.t0, a.api)
    with open(a.out, "w") as fp:
        json.dump(res, fp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
