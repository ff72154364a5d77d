"""The engine's client against a scripted ZeroMQ peer on a real ipc socket.

The real agent is exercised in test_agent.py; here the peer answers exactly what a test
needs (slow, refusing, resynchronising), which a live agent cannot be made to do on cue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from ark.agent.client import AgentNotReady, ArkClient, ArkClientError, LeaseLost

LEASE = {"flow_id": [0, 7], "dst": 8, "path": 2, "src_port": 50000, "flow_label": 0x3350,
         "expires": 0.0, "reserved": True}


class Peer:
    """A ROUTER on an ipc path answering each request with ``answer(req)`` (None: stay silent)."""

    def __init__(self, endpoint: str, answer: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        self.requests: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(endpoint)
        self._answer, self._stop = answer, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            rid, _, body = self._sock.recv_multipart()
            req = msgpack.unpackb(body)
            self.requests.append(req)
            rep = self._answer(req)
            if rep is not None:
                self._sock.send_multipart([rid, b"", msgpack.packb(rep)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture()
def endpoint(tmp_path) -> Iterator[str]:
    yield f"ipc://{tmp_path}/api.sock"


def _lease_reply(req: dict[str, Any]) -> dict[str, Any]:
    if req["op"] in ("reserve", "renew"):
        return {"ok": True, "lease": {**LEASE, "expires": time.time() + 0.3}}
    return {"ok": True}


def test_reserve_parses_the_lease(endpoint) -> None:
    peer = Peer(endpoint, _lease_reply)
    try:
        with ArkClient(endpoint) as c:
            lease = c.reserve("gpu8", 10**9)
        assert (lease.flow_id, lease.path, lease.src_port, lease.flow_label, lease.reserved) == ((0, 7), 2, 50000, 0x3350, True)
        assert peer.requests[0] == {"op": "reserve", "dst": "gpu8", "nbytes": 10**9, "dport": 4791}
    finally:
        peer.close()


def test_reserve_waits_out_a_resync_then_gives_up(endpoint) -> None:
    answers = iter([{"ok": False, "error": "node: resynchronising", "not_ready": True}] * 3)
    peer = Peer(endpoint, lambda req: next(answers, None) or _lease_reply(req))
    try:
        with ArkClient(endpoint) as c:
            assert c.reserve("gpu8", 1).src_port == 50000
        assert len(peer.requests) == 4
    finally:
        peer.close()
    peer = Peer(endpoint, lambda req: {"ok": False, "error": "node: resynchronising", "not_ready": True})
    try:
        with ArkClient(endpoint) as c, pytest.raises(AgentNotReady):
            c.reserve("gpu8", 1, wait_ready_s=0.1)
    finally:
        peer.close()


def test_refusal_and_silence_are_errors_and_the_client_recovers(endpoint) -> None:
    silent = threading.Event()
    peer = Peer(endpoint, lambda req: None if silent.is_set() else {"ok": False, "error": "dst: no such host"})
    try:
        with ArkClient(endpoint, timeout_s=0.2) as c:
            with pytest.raises(ArkClientError, match="dst: no such host"):
                c.reserve("nope", 1)
            silent.set()
            with pytest.raises(ArkClientError, match="no answer within 200 ms"):
                c.status()
            silent.clear()  # a REQ socket that missed a reply is replaced: the next call works
            with pytest.raises(ArkClientError, match="dst: no such host"):
                c.reserve("nope", 1)
    finally:
        peer.close()


def test_lease_renews_while_the_body_runs_and_releases_at_exit(endpoint) -> None:
    peer = Peer(endpoint, _lease_reply)
    try:
        with ArkClient(endpoint) as c, c.lease("gpu8", 10**9) as lease:
            time.sleep(0.5)  # the lease lasts 0.3 s: only renewals keep it
            assert lease.flow_id == (0, 7)
        ops = [r["op"] for r in peer.requests]
        assert ops[0] == "reserve" and ops[-1] == "release" and ops.count("renew") >= 2
    finally:
        peer.close()


def _split_reply(refuse_renewals_after: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    renewals = 0

    def answer(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal renewals
        expires = time.time() + 0.3
        parts = [{**LEASE, "flow_id": [0, 7 + k], "path": k, "src_port": 50000 + k, "expires": expires}
                 for k in range(2)]
        if req["op"] == "reserve":
            return {"ok": True, "leases": parts}
        if req["op"] == "renew":
            renewals += 1
            if renewals > refuse_renewals_after:
                return {"ok": False, "error": "flow: (0, 8) is not an active local flow (released or expired)"}
            return {"ok": True, "leases": parts}
        return {"ok": True}
    return answer


def test_a_multi_path_lease_renews_and_releases_its_parts_as_one(endpoint) -> None:
    peer = Peer(endpoint, _split_reply(refuse_renewals_after=10**6))
    try:
        with ArkClient(endpoint) as c, c.lease("gpu8", 10**9, parts=2) as held:
            time.sleep(0.5)
            assert held.flow_ids() == [(0, 7), (0, 8)] and held.src_ports == [50000, 50001] and held.paths == [0, 1]
            held.check()
        reserve, *middle, release = peer.requests
        assert reserve == {"op": "reserve", "dst": "gpu8", "nbytes": 10**9, "dport": 4791, "parts": 2}
        assert middle and all(r == {"op": "renew", "flows": [[0, 7], [0, 8]]} for r in middle)
        assert release == {"op": "release", "flows": [[0, 7], [0, 8]]}
        with pytest.raises(AttributeError, match="see .parts"):
            _ = held.src_port
    finally:
        peer.close()


def test_a_multi_path_lease_is_lost_when_a_part_cannot_be_renewed(endpoint) -> None:
    peer = Peer(endpoint, _split_reply(refuse_renewals_after=1))
    lost: list[Any] = []
    try:
        with ArkClient(endpoint) as c, c.lease("gpu8", 10**9, parts=2, on_lost=lost.append) as held:
            assert held.lost.wait(2.0)
            with pytest.raises(LeaseLost, match=r"\[\(0, 7\), \(0, 8\)\].*not an active local flow"):
                held.check()
        assert lost == [held] and peer.requests[-1]["op"] == "renew"  # a lost lease is not released
    finally:
        peer.close()
