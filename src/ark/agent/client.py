"""Client for a local ARK agent: what a serving engine calls before a KV transfer.

    from ark.agent.client import ArkClient

    with ArkClient("ipc:///run/ark/gpu0.sock") as ark:
        with ark.lease("gpu8", nbytes) as lease:      # renewed in the background
            qp.set_udp_sport(lease.src_port)           # or the GRH flow label
            transfer(...)
        # released here

``reserve`` / ``renew`` / ``release`` are also available directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from ark.core.node import Lease


class ArkClientError(RuntimeError):
    """The agent refused a request or did not answer."""


class AgentNotReady(ArkClientError):
    """The agent is still resynchronising with its peers."""


def _lease(d: dict[str, Any]) -> Lease:
    return Lease(
        (int(d["flow_id"][0]), int(d["flow_id"][1])), int(d["dst"]), int(d["path"]), int(d["src_port"]),
        None if d["flow_label"] is None else int(d["flow_label"]), float(d["expires"]), bool(d["reserved"]),
    )


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
        with self._lock:
            s = self._socket()
            try:
                s.send(msgpack.packb(req, use_bin_type=True))
                rep = msgpack.unpackb(s.recv(), raw=False)
            except zmq.Again:
                # A REQ socket that missed its reply is stuck: start over (lazy pirate).
                s.close(0)
                self._sock = None
                raise ArkClientError(f"agent at {self.endpoint}: no answer within {self.timeout_ms} ms") from None
        if not rep.get("ok"):
            cls = AgentNotReady if rep.get("not_ready") else ArkClientError
            raise cls(rep.get("error", "request refused"))
        return dict(rep)

    def reserve(self, dst: str | int, nbytes: int, dport: int = 4791, wait_ready_s: float = 10.0) -> Lease:
        """A path, source port and flow label for a KV flow to ``dst``."""
        deadline = time.monotonic() + wait_ready_s
        while True:
            try:
                return _lease(self.call({"op": "reserve", "dst": dst, "nbytes": nbytes, "dport": dport})["lease"])
            except AgentNotReady:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    def renew(self, flow_id: tuple[int, int]) -> Lease:
        return _lease(self.call({"op": "renew", "flow": list(flow_id)})["lease"])

    def release(self, flow_id: tuple[int, int]) -> None:
        self.call({"op": "release", "flow": list(flow_id)})

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
    def lease(self, dst: str | int, nbytes: int, dport: int = 4791, renew: bool = True) -> Iterator[Lease]:
        """Reserve, renew in the background while the body runs, release at exit."""
        lease = self.reserve(dst, nbytes, dport)
        stop = threading.Event()
        renewer = None
        if renew:
            renewer = threading.Thread(target=self._renew_loop, args=(lease, stop), daemon=True)
            renewer.start()
        try:
            yield lease
        finally:
            stop.set()
            if renewer is not None:
                renewer.join()
            self.release(lease.flow_id)

    def _renew_loop(self, lease: Lease, stop: threading.Event) -> None:
        # A separate connection: REQ sockets are not shared between threads.
        mine = ArkClient(self.endpoint, self.timeout_ms / 1000, self._ctx)
        try:
            expires = lease.expires
            while not stop.wait(max(0.05, (expires - time.time()) / 3)):
                try:
                    expires = mine.renew(lease.flow_id).expires
                except ArkClientError:
                    return
        finally:
            mine.close()

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
