"""Real ``ark arbiter`` processes on loopback: CURVE, grants, a killed primary, strangers."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import zmq

from ark.agent.cluster import load as load_cluster
from ark.agent.cluster import read_secret_key
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core import arbiter_wire as w


class _Host:
    """One listed host's DEALERs to every arbiter, with its own CURVE key."""

    def __init__(self, cluster_file: Path, name: str) -> None:
        cl = load_cluster(cluster_file)
        h = cl.host(name)
        self.index = h.index
        pub, sec = read_secret_key(str(h.secret_key_file))
        self.ctx = zmq.Context()
        self.socks = []
        for a in cl.arbiters:
            s = self.ctx.socket(zmq.DEALER)
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, a.public_key.encode()
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a.control)
            self.socks.append(s)

    def call(self, rank: int, msg: w.FromHost, timeout_s: float = 2.0) -> w.ToHost | None:
        """The answer to ``msg`` (late answers to earlier calls are skipped)."""
        s = self.socks[rank]
        s.send(w.encode(msg))
        end = time.monotonic() + timeout_s
        while s.poll(max(0, int((end - time.monotonic()) * 1000))):
            reply = w.decode_to_host(s.recv())
            if reply.rid == msg.rid:
                return reply
        return None

    def close(self) -> None:
        self.ctx.destroy(0)


def _until(fn, timeout_s: float):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    return fn()


def test_a_killed_primary_is_replaced_by_the_standby_which_keeps_its_grants(tmp_path: Path) -> None:
    cf, names = write_cluster(tmp_path, 4, arbiters=2, takeover_s=0.5, lease_min_s=4.0)
    procs = AgentProcs(cf, [], tmp_path)
    procs.start("arb0")
    procs.start("arb1")
    host = _Host(cf, names[0])  # names alternate leaves: names[1] is on the other leaf
    dst = load_cluster(cf).host(names[1]).index
    try:
        def primary_grants() -> w.ToHost | None:  # at a cold start the first rank leads after takeover_s
            r = host.call(0, w.Ask(1, 0, dst, 10**9, 4791), 0.5)
            return r if isinstance(r, w.Grant) else None

        grant = _until(primary_grants, 10.0)
        assert isinstance(grant, w.Grant) and grant.parts[0].reserved, grant
        epoch, flow = grant.epoch, grant.parts[0].flow
        refused = host.call(1, w.Ask(2, epoch, dst, 10**9, 4791))
        assert isinstance(refused, w.Refused) and refused.leader == 0
        procs.kill("arb0")
        t_kill = time.monotonic()

        def standby_leads() -> w.ToHost | None:
            r = host.call(1, w.Ping(3, epoch), 0.5)
            return r if isinstance(r, w.Pong) else None

        pong = _until(standby_leads, 10.0)
        took = time.monotonic() - t_kill
        assert isinstance(pong, w.Pong) and pong.epoch > epoch and pong.epoch % 2 == 1
        assert took < 3.0, took  # takeover_s 0.5 plus two beats of the standby's rank
        ext = host.call(1, w.Extend(4, pong.epoch, [flow]))
        assert isinstance(ext, w.Extended) and ext.lease_s[0] > 0  # the standby followed the grant
        nxt = host.call(1, w.Ask(5, pong.epoch, dst, 10**9, 4791))
        assert isinstance(nxt, w.Grant) and nxt.parts[0].reserved and nxt.parts[0].path != grant.parts[0].path
    finally:
        host.close()
        procs.stop_all()


def test_a_restarted_standby_follows_the_live_leader_and_keeps_the_epoch_it_heard(tmp_path: Path) -> None:
    """The standby's own epoch of the leader's generation is higher than the leader's; after
    a restart it must still follow the live leader, not lead on an empty table."""
    # The default takeover_s: the restarted standby's first beat from the leader comes over a
    # fresh CURVE connection, which a loaded machine can delay past a short takeover_s.
    cf, names = write_cluster(tmp_path, 4, arbiters=2, takeover_s=1.0, lease_min_s=20.0)
    procs = AgentProcs(cf, [], tmp_path)
    procs.start("arb0")
    procs.start("arb1")
    host = _Host(cf, names[0])
    dst = load_cluster(cf).host(names[1]).index
    try:
        def primary_grants() -> w.ToHost | None:
            r = host.call(0, w.Ask(1, 0, dst, 10**9, 4791), 0.5)
            return r if isinstance(r, w.Grant) else None

        grant = _until(primary_grants, 10.0)
        assert isinstance(grant, w.Grant) and grant.parts[0].reserved, grant
        kept = tmp_path / "state" / "arbiter-arb1.epoch"
        assert _until(lambda: kept.exists() and int(kept.read_text()) == grant.epoch, 5.0)
        procs.kill("arb1")
        procs.start("arb1")
        time.sleep(3.0)  # takeover_s plus two beats: it would have led by now
        # The leader answers again once the restarted standby acknowledges its beats (its lease needs them).
        pong = _until(lambda: r if isinstance(r := host.call(0, w.Ping(2, grant.epoch), 0.5), w.Pong) else None, 5.0)
        assert isinstance(pong, w.Pong) and pong.epoch == grant.epoch, pong  # the leader still leads its epoch
        refused = host.call(1, w.Ask(3, grant.epoch, dst, 10**9, 4791))
        assert isinstance(refused, w.Refused) and refused.leader == 0
        ext = host.call(0, w.Extend(4, grant.epoch, [grant.parts[0].flow]))
        assert isinstance(ext, w.Extended) and ext.lease_s[0] > 0
    finally:
        host.close()
        procs.stop_all()


def test_a_stranger_gets_no_answer_and_the_arbiter_keeps_serving(tmp_path: Path) -> None:
    cf, names = write_cluster(tmp_path, 2, arbiters=1)
    procs = AgentProcs(cf, [], tmp_path)
    procs.start("arb0")
    arb = load_cluster(cf).arbiters[0]
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = arb.public_key.encode()
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(arb.control)
        host = _Host(cf, names[0])
        assert isinstance(_until(lambda: host.call(0, w.Ping(1, 0), 0.5), 10.0), w.Pong)
        # Its handshake is refused, so it may have no connection to send on at all (a blocking
        # send would wait forever): either way it must get no answer.
        with contextlib.suppress(zmq.Again):
            stranger.send(w.encode(w.Ask(1, 0, 1, 10**9, 4791)), zmq.NOBLOCK)
        assert not stranger.poll(1000)
        host.socks[0].send(b"\x00junk")  # a listed host sending junk: dropped, the next ping answered
        assert isinstance(host.call(0, w.Ping(3, 0)), w.Pong)
        host.close()
    finally:
        ctx.destroy(0)
        procs.stop_all()


def test_an_error_in_the_connection_guard_is_counted_and_never_ends_the_arbiter(tmp_path: Path, monkeypatch) -> None:
    import threading

    from ark.agent import arbiter_guard
    from ark.agent.arbiter import ArbiterProcess

    cf, _names = write_cluster(tmp_path, 2, arbiters=1, control="arbiter")
    calls = [0]
    real = arbiter_guard.SharedGuard.expire

    def failing(self: arbiter_guard.SharedGuard, now: float) -> None:  # a fault in the guard: every third call
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise RuntimeError("guard fault")
        real(self, now)

    monkeypatch.setattr(arbiter_guard.SharedGuard, "expire", failing)
    arb = ArbiterProcess(load_cluster(cf), "arb0")
    stop = threading.Timer(2.5, arb.stop)
    stop.start()
    try:
        arb.run()  # returns when stopped, not on the guard's error
    finally:
        stop.cancel()
    assert calls[0] >= 3 and arb._error_kinds.get("connections: RuntimeError", 0) >= 1, (calls, arb._error_kinds)


def test_a_grant_that_reaches_the_agent_with_more_parts_than_asked_is_cut_to_what_was_asked(tmp_path: Path) -> None:
    # The link refuses such a grant first (a misfit); this is the agent's own second guard.
    from ark.agent.daemon import Agent
    from ark.agent.holders import Holders
    from ark.core.arbiter_host import Done

    cf, names = write_cluster(tmp_path, 2, arbiters=1, control="arbiter")
    cl = load_cluster(cf)
    agent = Agent(cl, names[0])
    assert agent.arbiter is not None
    ctx = zmq.Context()
    api = ctx.socket(zmq.ROUTER)
    api.bind("inproc://api")
    try:
        agent.holders = Holders(api)
        replies: list[dict] = []
        agent.reply = lambda _rid, reply: replies.append(reply)  # type: ignore[method-assign]
        me, dst = cl.host(names[0]).index, cl.host(names[1]).index
        now = time.time()
        parts = [w.Part((me, 2 << 32 | k), 0, True, False, 10.0) for k in range(1, 65)]  # 64 for a one-part ask
        agent.arbiter._granted(("reserve", b"r", 1, dst, 10**9, 4791, None, 1), Done("t", w.Grant(1, 2, parts), now),
                               now)
        assert [r["ok"] for r in replies] == [True] and replies[0]["lease"]["reserved"]
        assert agent.arbiter.bad_grants == 63 and len(agent.node.core.local_flows()) == 1
    finally:
        ctx.destroy(0)  # the api socket and the holders' monitor
