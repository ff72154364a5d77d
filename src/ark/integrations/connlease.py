"""Connection leases: one path lease per connection, for engines that open a connection per
peer once and keep it (UCX's TCP transport under NIXL), with no code in the engine.

The ``connect()`` interposer, given a rule ``IP[:DPORT]=lease:/PATH`` in ``ARK_STEER_RULES``,
asks this holder over the unix socket ``/PATH`` at each new connection to that destination:
``ask IP DPORT``. The holder asks its agent for a lease towards that peer that stays off the
paths the same peer pair's live connections hold while other paths remain (the agent places
it against every other host's leases as for any flow), answers ``ports P,P,...`` (the lease's
port and spares of the same path, in case some are taken) and hears back ``open SPORT`` or
``fail`` (then the lease is released at once). One line each way, at most 256 bytes, within a
second; anything else is counted and dropped, and the engine's connection goes out on its
own port.

Lifetime. Every ``sweep_s`` the holder reads the host's socket table (``sock_diag``) and,
for each leased connection: gone from the table (closed, reset) -> the lease is released;
bytes moved since the last sweep (``tcpi_bytes_acked`` + ``tcpi_bytes_received``) -> it is
renewed; no byte for ``idle_s`` -> the lease is released and the connection marked idle.
An idle connection keeps its port, so its later bytes ride the same path unreserved: a TCP
connection cannot change path, and the holder does not take a new lease for it (the agent
might choose another path). A lease the agent could not reserve (every path taken) steers
nothing: the connection goes out on its own port, plain ECMP. At most ``max_conns`` leases
are held; past that, asks are refused.

``python -m ark.integrations.connlease --agent ENDPOINT --socket PATH --hosts IP=NAME,...``
runs it beside the engine (same host, same network namespace); ``--state FILE`` writes what
it holds after every sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ark.agent.client import ArkClient, ArkClientError

MAX_LINE = 256
ASK_TIMEOUT_S = 1.0
PENDING_S = 5.0  # an asked lease that no "open" follows within this is released
MAX_SPARES = 8  # spare ports of the same path per answer

TupleKey = tuple[int, str, int]  # (local port, remote address, remote port)


@dataclass
class ConnLease:
    """One connection's lease, as the holder keeps it."""

    flow: tuple[int, int]
    dst: str
    dport: int
    path: int
    sport: int = 0  # the port the connection took (0: not opened yet)
    asked_s: float = 0.0
    active_s: float = 0.0
    moved: int = -1  # bytes acked + received at the last sweep
    state: str = "asked"  # asked -> held -> closed | idle | failed | lost


class ConnLeases:
    """The holder's logic, without its socket: asks, opens, and sweeps against a socket table."""

    def __init__(self, client: ArkClient, hosts: Mapping[str, str], *, nbytes: int = 64 << 20,
                 idle_s: float = 5.0, max_conns: int = 1024) -> None:
        self.client, self.hosts = client, dict(hosts)
        self.nbytes, self.idle_s, self.max_conns = nbytes, idle_s, max_conns
        self.live: dict[tuple[int, int], ConnLease] = {}
        self.ended: list[ConnLease] = []  # the last 1,024 that ended
        self.refused = 0
        self.lock = threading.Lock()

    def ask(self, dst: str, dport: int, now: float) -> tuple[ConnLease, list[int]] | str:
        """A lease for a new connection to ``dst``:``dport`` and its ports, or why not."""
        name = self.hosts.get(dst)
        if name is None:
            self.refused += 1
            return f"dst: {dst} is no host of this cluster"
        with self.lock:
            if len(self.live) >= self.max_conns:
                self.refused += 1
                return f"holder: {self.max_conns} connection leases held"
            taken = tuple(sorted({c.path for c in self.live.values() if c.dst == dst and c.path >= 0}))
            try:
                lease, ports = self.client.reserve_ports(name, self.nbytes, dport=dport, connections=1 + MAX_SPARES,
                                                         avoid=taken)[0]
            except ArkClientError as e:
                self.refused += 1
                return f"agent: {e}"
            if not lease.reserved:
                self._release(lease.flow_id)
                self.refused += 1
                return f"agent: nothing reserved ({lease.fallback or 'every path taken'})"
            c = ConnLease(lease.flow_id, dst, dport, lease.path, asked_s=now, active_s=now)
            self.live[c.flow] = c
            return c, ports

    def opened(self, c: ConnLease, sport: int, now: float) -> None:
        with self.lock:
            c.sport, c.state, c.active_s = sport, "held", now

    def failed(self, c: ConnLease) -> None:
        with self.lock:
            self._end(c, "failed")

    def _release(self, flow: tuple[int, int]) -> None:
        with contextlib.suppress(ArkClientError):
            self.client.release(flow)

    def _end(self, c: ConnLease, state: str) -> None:
        self._release(c.flow)
        c.state = state
        self.live.pop(c.flow, None)
        self.ended = [*self.ended[-1023:], c]

    def sweep(self, table: Mapping[TupleKey, int], now: float) -> None:
        """Renew the leases of connections that moved bytes; release the gone and the idle."""
        with self.lock:
            for c in list(self.live.values()):
                if c.state == "asked":  # no "open" yet: kept (renewed) for PENDING_S at most
                    if now - c.asked_s > PENDING_S:
                        self._end(c, "failed")
                    else:
                        self._renew(c)
                    continue
                moved = table.get((c.sport, c.dst, c.dport))
                if moved is None:
                    self._end(c, "closed")
                elif moved != c.moved:
                    c.moved, c.active_s = moved, now
                    self._renew(c)
                elif now - c.active_s > self.idle_s:
                    self._end(c, "idle")
                else:
                    self._renew(c)

    def _renew(self, c: ConnLease) -> None:
        try:
            lease = self.client.renew(c.flow)
        except ArkClientError:
            self._end(c, "lost")
            return
        if lease.path != c.path:  # re-pathed by the agent: the connection cannot follow
            self._end(c, "lost")

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"live": [asdict(c) for c in self.live.values()], "ended": [asdict(c) for c in self.ended],
                    "refused": self.refused}


def socket_table() -> dict[TupleKey, int]:
    """This network namespace's TCP connections (established or connecting): bytes moved each."""
    from pyroute2 import DiagSocket
    from pyroute2.netlink.diag import SS_ESTABLISHED, SS_SYN_SENT

    out: dict[TupleKey, int] = {}
    with DiagSocket() as ds:
        ds.bind()
        for m in ds.get_sock_stats(family=socket.AF_INET, states=(1 << SS_ESTABLISHED) | (1 << SS_SYN_SENT),
                                   extensions=2):  # INET_DIAG_INFO: tcp_info
            info = m.get_attr("INET_DIAG_INFO")
            moved = int(info["tcpi_bytes_acked"]) + int(info["tcpi_bytes_received"]) if info else 0
            out[(int(m["idiag_sport"]), str(m["idiag_dst"]), int(m["idiag_dport"]))] = moved
    return out


# ---------------------------------------------------------------------------- the socket
def _line(f: Any) -> str | None:
    """One line of at most MAX_LINE bytes from the exchange's file, or None."""
    raw = f.readline(MAX_LINE + 1)
    return raw[:-1].decode("ascii", "replace") if raw.endswith(b"\n") else None


def _parse_ask(line: str) -> tuple[str, int] | None:
    parts = line.split(" ")
    if len(parts) != 3 or parts[0] != "ask" or not parts[2].isdigit():
        return None
    try:
        ipaddress.IPv4Address(parts[1])
    except ValueError:
        return None
    dport = int(parts[2])
    return (parts[1], dport) if 1 <= dport <= 0xFFFF else None


def handle(conn: socket.socket, leases: ConnLeases, clock: Callable[[], float] = time.monotonic) -> str:
    """One exchange with the interposer; what came of it (for counting)."""
    conn.settimeout(ASK_TIMEOUT_S)
    f = conn.makefile("rb")
    try:
        line = _line(f)
        ask = _parse_ask(line) if line is not None else None
        if ask is None:
            return "malformed"
        got = leases.ask(*ask, clock())
        if isinstance(got, str):
            conn.sendall(b"none " + got.encode()[:200] + b"\n")
            return "refused"
        c, ports = got
        conn.sendall(("ports " + ",".join(str(p) for p in ports) + "\n").encode())
        reply = _line(f)
        parts = (reply or "").split(" ")
        if len(parts) == 2 and parts[0] == "open" and parts[1].isdigit() and int(parts[1]) in ports:
            leases.opened(c, int(parts[1]), clock())
            return "opened"
        leases.failed(c)
        return "failed"
    except OSError:
        return "malformed"
    finally:
        f.close()
        conn.close()


def serve(path: str, leases: ConnLeases, stop: threading.Event) -> threading.Thread:
    """Answer the interposer on unix socket ``path`` (mode 0600) in a thread until ``stop``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(64)
    srv.settimeout(0.2)

    def loop() -> None:
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                handle(conn, leases)

    t = threading.Thread(target=loop, name="ark-connlease", daemon=True)
    t.start()
    return t


def _hosts(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        ip, sep, name = item.partition("=")
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise SystemExit(f"--hosts: expected IP=NAME,...; got {item!r:.60}") from None
        if not sep or not name:
            raise SystemExit(f"--hosts: expected IP=NAME,...; got {item!r:.60}")
        out[ip] = name
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.integrations.connlease")
    ap.add_argument("--agent", required=True, help="the local agent's API endpoint")
    ap.add_argument("--socket", required=True, help="the unix socket the interposer's lease rules name")
    ap.add_argument("--hosts", required=True, help="IP=NAME,...: the peers' data addresses and cluster names")
    ap.add_argument("--bytes", type=int, default=64 << 20, help="bytes each connection lease books")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds without a byte before a lease is given back")
    ap.add_argument("--sweep", type=float, default=0.2, help="seconds between looks at the socket table")
    ap.add_argument("--state", default="", help="write what is held here after every sweep (JSON)")
    a = ap.parse_args(argv)
    if not 1 <= a.bytes <= 2**62 or not 0.05 <= a.idle <= 3600 or not 0.01 <= a.sweep <= 10:
        ap.error("--bytes 1..2^62, --idle 0.05..3600 s, --sweep 0.01..10 s")
    stop = threading.Event()
    with ArkClient(a.agent) as client:
        leases = ConnLeases(client, _hosts(a.hosts), nbytes=a.bytes, idle_s=a.idle)
        serve(a.socket, leases, stop)
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(a.sweep):
            leases.sweep(socket_table(), time.monotonic())
            if a.state:
                Path(a.state + ".tmp").write_text(json.dumps(leases.state()))
                os.replace(a.state + ".tmp", a.state)
        with leases.lock:
            for c in list(leases.live.values()):
                leases._end(c, "closed")
        if a.state:
            Path(a.state).write_text(json.dumps(leases.state()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
