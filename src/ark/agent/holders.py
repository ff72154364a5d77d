"""Which local process holds each flow, so that a vanished client's flows are released.

An engine that dies holding leases would otherwise keep their links reserved until the
leases end (up to ``max_lease_s``). The local API is a Unix socket: the kernel tells
libzmq which process connected (``SO_PEERCRED``), and libzmq hands that on with every
message (the ``Peer-Address`` property, ``...:uid:gid:pid``). A flow is held by the process
that last reserved or renewed it (an engine may hand a flow to a worker that renews it).

Every :data:`CHECK_S`, and :data:`AFTER_CLOSE_S` after any API connection closes (a
killed process's connections close as it dies), the agent looks each holder up in
``/proc``. A holder that is gone (no such process, a zombie, or another process under the
same pid, told apart by its start time) has its flows released, and their RELEASE goes to
the peers: within :data:`CHECK_S` of its exit, plus the agent's loop.

A client the agent cannot see (an API over ``tcp://``, or a process in a pid namespace the
agent's cannot see into: pid 0) keeps its flows until their leases end, as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from ark.core.messages import FlowId

CHECK_S = 1.0
AFTER_CLOSE_S = 0.05

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot): one process, never reused


def peer_pid(frame: zmq.Frame) -> int:
    """The sending process of an ipc message (0: not known)."""
    try:
        addr = str(frame.get("Peer-Address"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return 0
    parts = addr.rsplit(":", 3)
    return int(parts[3]) if len(parts) == 4 and parts[3].isascii() and parts[3].isdigit() else 0


def process(pid: int) -> Proc | None:
    """``pid``'s (pid, start time) if it is a live process (not a zombie), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()  # after the command name, which may hold anything
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return pid, int(fields[19])


class Holders:
    """Flows by holding process; :meth:`sweep` says which to release."""

    def __init__(self, api_sock: zmq.Socket) -> None:
        self.monitor = api_sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._flows: dict[Proc, set[FlowId]] = {}
        self._holder: dict[FlowId, Proc] = {}
        self.due = math.inf  # time.monotonic() of the next sweep
        self.released = 0

    def hold(self, flow: FlowId, pid: int) -> None:
        """``pid`` reserved or renewed ``flow``: it holds it now."""
        proc = process(pid) if pid > 0 else None
        if proc is None or self._holder.get(flow) == proc:
            return
        self.drop(flow)
        self._holder[flow] = proc
        self._flows.setdefault(proc, set()).add(flow)
        self.due = min(self.due, time.monotonic() + CHECK_S)

    def drop(self, flow: FlowId) -> None:
        proc = self._holder.pop(flow, None)
        if proc is not None:
            held = self._flows[proc]
            held.discard(flow)
            if not held:
                del self._flows[proc]

    def closed(self) -> None:
        """API connections closed (monitor events waiting): sweep soon."""
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
        if self._flows:
            self.due = min(self.due, time.monotonic() + AFTER_CLOSE_S)

    def sweep(self, active: Callable[[FlowId], bool]) -> list[FlowId]:
        """Forget flows no longer ``active``; the flows of holders that are gone."""
        gone: list[FlowId] = []
        for proc, flows in list(self._flows.items()):
            for f in [f for f in flows if not active(f)]:
                self.drop(f)
            if proc in self._flows and process(proc[0]) != proc:
                gone.extend(flows)
                for f in list(flows):
                    self.drop(f)
        self.due = time.monotonic() + CHECK_S if self._flows else math.inf
        return gone

    def count(self) -> int:
        return len(self._holder)

    def close(self) -> None:
        self.monitor.close(0)
