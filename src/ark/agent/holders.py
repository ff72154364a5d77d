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

A client's identity is looked up once per connection, not once per request: the sending
pid (one property lookup) and its ``/proc`` entry are kept by the connection's routing id,
which names one connection of one process for as long as it is open (the kernel's
``SO_PEERCRED`` is the connecting process's, fixed at connect). Any connection closing
empties that cache (the monitor does not say which one closed), so a process that is gone
is never looked up from it; so does the cache reaching :data:`MAX_CONNECTIONS`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq

from ark.core.messages import FlowId

CHECK_S = 1.0
AFTER_CLOSE_S = 0.05
MAX_CONNECTIONS = 4096  # identities kept at once (more connections: looked up again)

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
        with open(f"/proc/{pid}/stat", "rb") as f:  # not pathlib: this is on the sweep's path
            stat = f.read()
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
        self._conns: dict[bytes, tuple[int, Proc | None]] = {}  # routing id -> (pid, process)
        self.lookups = 0  # /proc reads for identities (not for sweeps)

    def pid_of(self, rid: bytes, frame: zmq.Frame) -> int:
        """The pid of the process on connection ``rid`` (0: not known), looked up once."""
        known = self._conns.get(rid)
        if known is not None:
            return known[0]
        pid = peer_pid(frame)
        self._remember(rid, pid)
        return pid

    def _remember(self, rid: bytes, pid: int) -> None:
        if len(self._conns) >= MAX_CONNECTIONS:
            self._conns.clear()
        self.lookups += pid > 0
        self._conns[rid] = (pid, process(pid) if pid > 0 else None)

    def hold(self, flow: FlowId, pid: int, rid: bytes = b"") -> None:
        """``pid`` (on connection ``rid``) reserved or renewed ``flow``: it holds it now."""
        if pid <= 0:
            return
        known = self._conns.get(rid)
        proc = known[1] if known is not None and known[0] == pid else process(pid)
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
        self._conns.clear()  # which connection closed is not said: every identity is looked up again
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
