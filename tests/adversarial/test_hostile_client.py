"""A buggy or hostile local client, and a client whose agent goes away under it."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest
import zmq

from ark.agent.api import API_MAX_BYTES
from ark.agent.attack import OP_ARGS, hostile_requests
from ark.agent.bench import bed
from ark.agent.client import AgentNotReady, AgentTimeout, AgentUnavailable, ArkClient, LeaseLost

PER_OP = 1000


def _req(ctx: zmq.Context, api: str) -> zmq.Socket:
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(api)
    return s


def test_a_thousand_hostile_requests_per_op_are_refused_in_one_line() -> None:
    with bed(agents=2) as b:
        api = b.procs.api(b.running[0])
        with ArkClient(api) as c:
            before = c.call({"op": "table"})
        ctx = zmq.Context()
        answered = oversized = 0
        try:
            s = _req(ctx, api)
            for i, op in enumerate(OP_ARGS):
                for body in hostile_requests(op, PER_OP, seed=i):
                    s.send(body)
                    if len(body) > API_MAX_BYTES + 256:  # over the socket's cap: the agent drops the connection
                        oversized += 1
                        s.close(0)
                        s = _req(ctx, api)
                        continue
                    rep = msgpack.unpackb(s.recv())
                    answered += 1
                    assert not rep["ok"] and "\n" not in rep["error"] and "internal error" not in rep["error"], (op, rep)
        finally:
            ctx.destroy(0)
        assert answered + oversized == PER_OP * len(OP_ARGS) and answered >= 0.8 * PER_OP * len(OP_ARGS)
        assert all(p.poll() is None for p in b.procs.procs.values())
        with ArkClient(api) as c:
            assert c.call({"op": "table"}) == before and c.status()["node"]["errors"] == 0


def test_lost_lease_is_reported_while_the_body_runs_and_never_masks_its_error() -> None:
    with bed(agents=2) as b:
        src, dst = b.running
        lost: list[object] = []
        with ArkClient(b.procs.api(src), timeout_s=0.5) as c:
            with pytest.raises(ZeroDivisionError) as e, c.lease(dst, 10**6, on_lost=lost.append) as held:
                os.kill(b.pid(src), signal.SIGKILL)  # the agent dies under the lease
                assert held.lost.wait(5.0)
                assert lost == [held]
                with pytest.raises(LeaseLost):
                    held.check()
                _ = 1 / 0  # the body's own failure must come out as it is
            assert not getattr(e.value, "__notes__", [])  # a lost lease is not released again


def test_a_failed_release_is_a_note_on_the_bodys_error() -> None:
    with bed(agents=2) as b:
        src, dst = b.running
        with ArkClient(b.procs.api(src), timeout_s=0.5) as c:
            with pytest.raises(KeyError) as e, c.lease(dst, 10**6):
                os.kill(b.pid(src), signal.SIGKILL)
                b.procs.procs[src].wait()
                raise KeyError("the transfer failed")  # before the renewer notices anything
            assert e.value.args == ("the transfer failed",)
            assert any("releasing lease" in n for n in e.value.__notes__)


def test_no_agent_not_ready_and_timeout_are_told_apart(tmp_path) -> None:
    with pytest.raises(AgentUnavailable, match="no agent"), ArkClient(f"ipc://{tmp_path}/none.sock") as c:
        c.status()
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp_path}/slow.sock")
        with pytest.raises(AgentTimeout, match="no answer within 200 ms"), ArkClient(f"ipc://{tmp_path}/slow.sock", 0.2) as c:
            c.status()  # nobody answers
        router.close(0)
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp_path}/resync.sock")
        with ArkClient(f"ipc://{tmp_path}/resync.sock", 2.0) as c:
            import threading

            def answer() -> None:
                assert router.poll(2000)
                rid, _, _body = router.recv_multipart()
                router.send_multipart([rid, b"", msgpack.packb({"ok": False, "error": "resync", "not_ready": True})])

            threading.Thread(target=answer, daemon=True).start()
            time.sleep(0.05)
            with pytest.raises(AgentNotReady):
                c.reserve("gpu1", 1, wait_ready_s=0.0)
    finally:
        ctx.destroy(0)
