"""Client for a local ARK agent: what a serving engine calls before a KV transfer.

    from ark.agent.client import ArkClient

    with ArkClient("ipc:///run/ark/gpu0.sock") as ark:
        with ark.lease("gpu8", nbytes) as lease:      # renewed in the background
            qp.set_udp_sport(lease.src_port)           # or the GRH flow label
            transfer(...)
            lease.check()                              # raises LeaseLost if it was lost
        # released here

A process that dies holding leases (killed, crashed) has them released by its agent within
a second (:mod:`ark.agent.holders`); one that only closes its client keeps them.

Errors say what went wrong: :class:`AgentUnavailable` (no agent at the endpoint),
:class:`AgentNotReady` (it is resynchronising), :class:`AgentTimeout` (it did not answer
in time), :class:`RequestRefused` (it answered no), :class:`LeaseLost` (a held lease could
not be renewed). All are :class:`ArkClientError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from ark.core.node import Lease

log = logging.getLogger("ark.client")


class ArkClientError(RuntimeError):
    """The agent refused a request or did not answer."""


class AgentUnavailable(ArkClientError):
    """No agent listens at the endpoint (its socket is missing)."""


class AgentTimeout(ArkClientError):
    """The agent did not answer in time (overloaded, or hung)."""


class AgentNotReady(ArkClientError):
    """The agent is still resynchronising with its peers."""


class RequestRefused(ArkClientError):
    """The agent answered that the request is invalid or impossible."""


class LeaseLost(ArkClientError):
    """A held lease ended while its holder still used it (agent gone, or the flow expired)."""


def _lease(d: dict[str, Any]) -> Lease:
    return Lease(
        (int(d["flow_id"][0]), int(d["flow_id"][1])), int(d["dst"]), int(d["path"]), int(d["src_port"]),
        None if d["flow_label"] is None else int(d["flow_label"]), float(d["expires"]), bool(d["reserved"]),
        str(d.get("fallback", "")),  # an older agent does not say why
    )


class HeldLease:
    """A lease inside :meth:`ArkClient.lease`: its current fields, and whether it was lost.

    The fields follow renewals (``expires``) and re-paths the agent reports on renewal.
    ``lost`` is set, ``error`` filled and ``on_lost`` called (from the renewing thread)
    when a renewal fails for good; :meth:`check` raises :class:`LeaseLost` from then on.
    """

    def __init__(self, lease: Lease) -> None:
        self.current = lease
        self.ports: list[list[int]] = [[lease.src_port] if lease.reserved else []]  # per part, as reserved
        self.lost = threading.Event()
        self.error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)  # flow_id, dst, path, src_port, flow_label, expires, reserved

    def check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(f"lease {self.flow_ids()}: {self.error}") from self.error

    def flow_ids(self) -> list[tuple[int, int]]:
        return [self.current.flow_id]

    def renew_with(self, client: ArkClient) -> None:
        self.current = client.renew(self.current.flow_id)

    def release_with(self, client: ArkClient) -> None:
        client.release(self.current.flow_id)


class HeldSplit(HeldLease):
    """A multi-path lease inside :meth:`ArkClient.lease` (``parts`` given): one
    :class:`Lease` per part in ``parts``, renewed and released as one. ``expires`` is the
    earliest part's; a part that cannot be renewed loses the whole lease."""

    def __init__(self, leases: list[Lease]) -> None:
        super().__init__(leases[0])
        self.parts = leases
        self.ports = [[le.src_port] if le.reserved else [] for le in leases]

    def __getattr__(self, name: str) -> Any:
        if name == "expires":
            return min(le.expires for le in self.parts)
        raise AttributeError(f"a multi-path lease has no single {name}; see .parts")

    @property
    def src_ports(self) -> list[int]:
        return [le.src_port for le in self.parts]

    @property
    def paths(self) -> list[int]:
        return [le.path for le in self.parts]

    def flow_ids(self) -> list[tuple[int, int]]:
        return [le.flow_id for le in self.parts]

    def renew_with(self, client: ArkClient) -> None:
        self.parts = client.renew_split(self.flow_ids())
        self.current = self.parts[0]

    def release_with(self, client: ArkClient) -> None:
        client.release_split(self.flow_ids())


class ArkClient:
    """One REQ connection to the agent's local API (not shared between threads)."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0, context: zmq.Context | None = None) -> None:
        self.endpoint, self.timeout_ms = endpoint, int(timeout_s * 1000)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[len("ipc://"):]):
            raise AgentUnavailable(f"no agent at {self.endpoint} (its socket does not exist)")
        with self._lock:
            s = self._socket()
            try:
                s.send(msgpack.packb(req, use_bin_type=True))
                rep = msgpack.unpackb(s.recv(), raw=False)
            except zmq.Again:
                # A REQ socket that missed its reply is stuck: start over (lazy pirate).
                s.close(0)
                self._sock = None
                raise AgentTimeout(f"agent at {self.endpoint}: no answer within {self.timeout_ms} ms") from None
        if not isinstance(rep, dict):
            raise ArkClientError(f"agent at {self.endpoint}: malformed answer")
        if not rep.get("ok"):
            cls = AgentNotReady if rep.get("not_ready") else RequestRefused
            raise cls(str(rep.get("error", "request refused")))
        return dict(rep)

    def reserve(self, dst: str | int, nbytes: int, dport: int = 4791, wait_ready_s: float = 10.0) -> Lease:
        """A path, source port and flow label for a KV flow to ``dst``."""
        return self.reserve_ports(dst, nbytes, dport=dport, wait_ready_s=wait_ready_s)[0][0]

    def reserve_split(self, dst: str | int, nbytes: int, parts: int = 0, dport: int = 4791,
                      wait_ready_s: float = 10.0) -> list[Lease]:
        """A multi-path lease: one :class:`Lease` per part, each on its own path while the
        fabric has free ones. ``parts`` = 0: the agent chooses by size (one part per its
        ``split_part_bytes``, at most one per path)."""
        return [le for le, _ in self.reserve_ports(dst, nbytes, dport=dport, parts=parts, wait_ready_s=wait_ready_s)]

    def reserve_ports(self, dst: str | int, nbytes: int, *, dport: int = 4791, parts: int | None = None,
                      connections: int = 0, wait_ready_s: float = 10.0,
                      avoid: tuple[int, ...] = ()) -> list[tuple[Lease, list[int]]]:
        """A lease (``parts`` None) or a multi-path lease, each part with the source ports
        of its path for its share of ``connections`` (its own port first; none for a part
        that reserved nothing), in one round trip. Retries while the agent is not ready.
        ``avoid``: paths a single-path lease stays off while others remain."""
        deadline = time.monotonic() + wait_ready_s
        req: dict[str, Any] = {"op": "reserve", "dst": dst, "nbytes": nbytes, "dport": dport}
        if avoid:
            req["avoid"] = list(avoid)
        if parts is not None:
            req["parts"] = parts
        if connections > 1:
            req["connections"] = connections
        while True:
            try:
                rep = self.call(req)
                break
            except AgentNotReady:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        out = []
        for d in rep["leases"] if parts is not None else [rep["lease"]]:
            lease = _lease(d)
            ports = [int(p) for p in d.get("ports", ())] or ([lease.src_port] if lease.reserved else [])
            out.append((lease, ports))
        return out

    def renew(self, flow_id: tuple[int, int]) -> Lease:
        return _lease(self.call({"op": "renew", "flow": list(flow_id)})["lease"])

    def renew_split(self, flow_ids: list[tuple[int, int]]) -> list[Lease]:
        """Renew every part of a multi-path lease; refused as a whole if one part is gone."""
        return [_lease(d) for d in self.call({"op": "renew", "flows": [list(f) for f in flow_ids]})["leases"]]

    def release(self, flow_id: tuple[int, int]) -> None:
        self.call({"op": "release", "flow": list(flow_id)})

    def release_split(self, flow_ids: list[tuple[int, int]]) -> None:
        self.call({"op": "release", "flows": [list(f) for f in flow_ids]})

    def more_ports(self, flow_id: tuple[int, int], n: int) -> tuple[int, list[int]]:
        """(the flow's path now, up to ``n`` more source ports of it, held for the flow until
        its release). The path is the lease's unless a race re-pathed the flow meanwhile."""
        rep = self.call({"op": "more_ports", "flow": list(flow_id), "n": n})
        return int(rep["path"]), [int(p) for p in rep["ports"]]

    def status(self, samples: int = 0) -> dict[str, Any]:
        st: dict[str, Any] = self.call({"op": "status", "samples": samples})["status"]
        return st

    def ports(self, peer: str | int, dport: int = 4791) -> list[int]:
        return [int(p) for p in self.call({"op": "ports", "peer": peer, "dport": dport})["ports"]]

    def reload(self) -> dict[tuple[int, int], Lease]:
        """Re-read the path-map files; returns the re-pathed flows and their new leases."""
        rep = self.call({"op": "reload"})["repathed"]
        return {(int(r["old"][0]), int(r["old"][1])): _lease(r["lease"]) for r in rep}

    def refresh(self, peers: list[str] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """Make the agent re-probe its peers and reload; its probe figures and re-pathed flows."""
        c = ArkClient(self.endpoint, timeout_s, self._ctx)  # probing takes longer than a call
        try:
            req: dict[str, Any] = {"op": "refresh"}
            if peers is not None:
                req["peers"] = list(peers)
            rep = c.call(req)
        finally:
            c.close()
        return {"probed": rep["probed"],
                "repathed": {(int(r["old"][0]), int(r["old"][1])): _lease(r["lease"]) for r in rep["repathed"]}}

    def current(self, flow_id: tuple[int, int]) -> Lease:
        """The flow's lease as it stands (a re-pathed flow answers with its new port)."""
        return _lease(self.call({"op": "lease", "flow": list(flow_id)})["lease"])

    def metrics(self) -> str:
        return str(self.call({"op": "metrics"})["text"])

    @contextmanager
    def lease(
        self, dst: str | int, nbytes: int, dport: int = 4791, renew: bool = True,
        on_lost: Callable[[HeldLease], None] | None = None, parts: int | None = None, connections: int = 0,
        on_renew: Callable[[HeldLease], None] | None = None,
    ) -> Iterator[HeldLease]:
        """Reserve, renew in the background while the body runs, release at exit.

        ``parts``: a multi-path lease (:class:`HeldSplit`, one path per part; 0 lets the
        agent choose by size); None: one path (:class:`HeldLease`). ``connections``: the
        connections the body will open; ``held.ports`` then lists, per part, that part's
        ports for its share of them (see :meth:`reserve_ports`). A lease that cannot
        be renewed is reported while the body runs (``held.lost``, ``on_lost``,
        ``held.check()``). ``on_renew(held)`` is called from the renewing thread after each
        renewal (a part the agent re-pathed shows in ``held``'s fields); an exception it
        raises is logged, and renewals go on. At exit the body's own exception always wins:
        a failure to release is then only attached to it as a note.
        """
        got = self.reserve_ports(dst, nbytes, dport=dport, parts=parts, connections=connections)
        held = HeldLease(got[0][0]) if parts is None else HeldSplit([le for le, _ in got])
        held.ports = [ports for _, ports in got]
        stop = threading.Event()
        renewer = None
        if renew:
            renewer = threading.Thread(target=self._renew_loop, args=(held, stop, on_lost, on_renew), daemon=True)
            renewer.start()
        try:
            yield held
        except BaseException as body_error:
            stop.set()
            if renewer is not None:
                renewer.join()
            if not held.lost.is_set():
                try:
                    held.release_with(self)
                except ArkClientError as e:
                    body_error.add_note(f"ark: releasing lease {held.flow_ids()} also failed: {e}")
            raise
        stop.set()
        if renewer is not None:
            renewer.join()
        if not held.lost.is_set():
            held.release_with(self)

    def _renew_loop(self, held: HeldLease, stop: threading.Event, on_lost: Callable[[HeldLease], None] | None,
                    on_renew: Callable[[HeldLease], None] | None = None) -> None:
        # A separate connection: REQ sockets are not shared between threads. Renew when a
        # third of the lease has passed; retry quickly on a slow or missing agent, until
        # the lease would have run out.
        mine = ArkClient(self.endpoint, max(0.2, self.timeout_ms / 4000), self._ctx)
        try:
            wait = max(0.05, (held.expires - time.time()) / 3)
            while not stop.wait(wait):
                try:
                    held.renew_with(mine)
                    wait = max(0.05, (held.expires - time.time()) / 3)
                    if on_renew is not None:
                        self._renewed(held, on_renew)
                except (AgentTimeout, AgentUnavailable) as e:
                    if time.time() < held.expires:
                        wait = 0.05
                        continue
                    self._lost(held, e, on_lost)
                    return
                except ArkClientError as e:  # refused: the agent no longer has the flow
                    self._lost(held, e, on_lost)
                    return
        finally:
            mine.close()

    @staticmethod
    def _renewed(held: HeldLease, on_renew: Callable[[HeldLease], None]) -> None:
        try:
            on_renew(held)
        except Exception:  # the caller's hook must not stop the renewals
            log.exception("on_renew of lease %s failed", held.flow_ids())

    @staticmethod
    def _lost(held: HeldLease, error: BaseException, on_lost: Callable[[HeldLease], None] | None) -> None:
        held.error = error
        held.lost.set()
        if on_lost is not None:
            on_lost(held)

    def close(self) -> None:
        with self._lock:  # never close a socket another thread is using
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

    def __enter__(self) -> ArkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_ready(endpoints: list[str], timeout_s: float = 30.0) -> None:
    """Wait until every agent answers and is ready to reserve (synced with its peers)."""
    deadline = time.monotonic() + timeout_s
    for ep in endpoints:
        c = ArkClient(ep, timeout_s=0.5)
        try:
            while True:
                try:
                    if c.status()["ready"]:
                        break
                except ArkClientError:
                    pass
                if time.monotonic() > deadline:
                    raise ArkClientError(f"agent at {ep} not ready after {timeout_s} s")
                time.sleep(0.05)
        finally:
            c.close()
