"""A listed host attacking the arbiter, real processes: it asks for every path, floods, and
replays its requests; an honest agent beside it keeps getting reserved leases. A host's
burst that would keep the leader from its beats, its many connections, floods of every
message kind, and an arbiter key's forged epochs and oversized grants."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ark.agent.arbiter_run import _arbiter_exit
from ark.agent.client import ArkClient
from ark.agent.cluster import load as load_cluster
from ark.agent.cluster import read_secret_key
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core import arbiter_wire as w
from ark.core.arbiter import SEQ_SHIFT
from tests.agent.test_arbiter_process import _Host, _until


def test_a_flooding_greedy_host_is_capped_and_an_honest_agent_still_reserves(tmp_path: Path) -> None:
    # 32 spines: more paths than its cap of 16 live reservations, so the cap is what stops it.
    # 200 requests/s per host: a flood of 3,000 outruns it however slowly this machine serves it.
    # The honest agent waits up to 2 s for its answer, not the default 0.1 s: on two cores the
    # flooder's encryption, the arbiter's decryption of 3,000 messages and the agent share the
    # CPUs, and a CI run once took 0.1 s to answer it (the claim is that it is served, not how
    # fast a starved machine serves it; its latency is in the failure message).
    cf, names = write_cluster(tmp_path, 4, arbiters=1, control="arbiter", max_flows_per_host=16, lease_min_s=30.0,
                              spines=32, arbiter_rate_per_host=200.0, arbiter_timeout_s=2.0)
    cl = load_cluster(cf)
    idx = {n: cl.host(n).index for n in names}  # names alternate leaves: 0 and 2 on one, 1 and 3 on the other
    procs = AgentProcs(cf, [names[3]], tmp_path)
    procs.start("arb0")
    procs.start(names[3])
    hostile = _Host(cf, names[0])  # a listed host's key, driven by hand
    try:
        procs.wait_ready([names[3]])
        assert isinstance(_until(lambda: hostile.call(0, w.Ping(1, 0), 0.5), 10.0), w.Pong)
        sock = hostile.socks[0]
        n = 3000
        t0 = time.monotonic()
        for rid in range(10, 10 + n):  # every path, as fast as it can: 16 parts each
            sock.send(w.encode(w.Ask(rid, 0, idx[names[1]], 10**9, 4791, 16)))
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as victim:
            t_ask = time.monotonic()
            lease = victim.reserve(names[2], 10**9)  # the other direction: links the attacker cannot hold
            latency = time.monotonic() - t_ask
        answers = []
        while len(answers) < n and sock.poll(5000):
            answers.append(w.decode_to_host(sock.recv()))
        flood_s = time.monotonic() - t0
        grants = [a for a in answers if isinstance(a, w.Grant)]
        limited = sum(1 for a in grants if not a.parts)  # beyond its tokens: no grant, nothing decided
        parts = [p for a in grants for p in a.parts]
        assert len(answers) == n and len(parts) == 16 * (n - limited) and limited > 0
        reserved = [p for p in parts if p.reserved]
        assert len(reserved) == 16  # its cap of live reservations, whatever it asks
        why = {p.why.split(":")[0] for p in parts if not p.reserved}
        assert why == {"cap"}, why
        assert lease.reserved and latency < 2.0, (lease, latency, flood_s)

        # Replays: a request id among its last 64 gets the kept answer and changes nothing.
        last = answers[-1]
        again = hostile.call(0, w.Ask(10 + n - 1, 0, idx[names[1]], 10**9, 4791, 16))
        assert again == last
        # Registering a flow of the current epoch that was never handed out: refused.
        epoch = last.epoch
        forged = w.Held((idx[names[0]], epoch << SEQ_SHIFT | 999_999), idx[names[1]], 4791, 0, 10**9, False, 10.0)
        reg = hostile.call(0, w.Register(10_000_000, epoch, [forged]))
        assert isinstance(reg, w.Grant) and not reg.parts[0].reserved and reg.parts[0].why == "unknown"
        # Naming the honest agent's flow: counted, nothing happens to it.
        hostile.call(0, w.Drop(10_000_001, epoch, [lease.flow_id]))
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as victim:
            assert victim.renew(lease.flow_id).reserved
    finally:
        hostile.close()
        procs.stop_all()


def _exit_record(log: Path) -> dict[str, Any]:
    """The ``arbiter_stopped`` record of an arbiter's log (its counters at a clean stop)."""
    rec = _arbiter_exit(log)
    assert rec, log.read_text()[-2000:]
    return rec


def _granted(answers: list[w.ToHost]) -> list[w.Part]:
    return [p for a in answers if isinstance(a, w.Grant) for p in a.parts if p.reserved]


def test_a_burst_of_sixteen_part_asks_under_ark_balance_forces_no_takeover(tmp_path: Path) -> None:
    # Tokens enough for the whole burst: what is tried is the batch, not the rate limit. Each
    # ask's parts share paths under ark-balance, so every link's holders grow with the table;
    # a decision whose cost grew with them (or a batch that keeps the beats in) let the standby
    # take over while the primary was still deciding, and drop the batch's grants.
    cf, names = write_cluster(tmp_path, 4, arbiters=2, control="arbiter", policy="ark-balance", takeover_s=1.0,
                              lease_min_s=30.0, arbiter_rate_per_host=1e6, arbiter_burst_per_host=1 << 20)
    procs = AgentProcs(cf, [], tmp_path)
    procs.start("arb0")
    procs.start("arb1")
    host = _Host(cf, names[0])
    dst = load_cluster(cf).host(names[1]).index
    try:
        first = _until(lambda: _grant(host.call(0, w.Ask(1, 0, dst, 10**9, 4791, 16), 0.5)), 10.0)
        assert isinstance(first, w.Grant), first
        time.sleep(1.0)  # the standby has the table and hears beats
        n = 250  # 4,016 flows with the first: within its 4,096 live
        sock = host.socks[0]
        for rid in range(10, 10 + n):
            sock.send(w.encode(w.Ask(rid, first.epoch, dst, 10**9, 4791, 16)))
        answers = []
        while len(answers) < n and sock.poll(10_000):
            answers.append(w.decode_to_host(sock.recv()))
        time.sleep(2.5)  # takeover_s plus the standby's two beats, after the burst
        ping = host.call(0, w.Ping(99, first.epoch))
        assert isinstance(ping, w.Pong) and ping.epoch == first.epoch, ping  # the primary still leads its epoch
    finally:
        host.close()
        procs.stop_all()
    granted = _granted(answers)
    assert len(answers) == n and len(granted) == 16 * n, (len(answers), len(granted))
    standby = _exit_record(tmp_path / "arb1.log")
    assert standby["counters"]["takeovers"] == 0, standby
    # Every grant of the burst reached the standby's table (and the first ask's 16).
    assert standby["counters"]["changes_applied"] >= 16 * (n + 1), standby


def _grant(r: w.ToHost | None) -> w.Grant | None:
    return r if isinstance(r, w.Grant) else None


def test_a_host_holding_300_connections_leaves_a_restarted_honest_agent_its_share(tmp_path: Path) -> None:
    cf, names = write_cluster(tmp_path, 4, arbiters=1, control="arbiter", lease_min_s=30.0, arbiter_timeout_s=0.5)
    procs = AgentProcs(cf, [names[3]], tmp_path)
    procs.start("arb0")
    procs.start(names[3])
    hogs = [_Host(cf, names[0]) for _ in range(300)]  # one listed host's key, 300 connections
    try:
        procs.wait_ready([names[3]])
        assert isinstance(_until(lambda: hogs[0].call(0, w.Ping(1, 0), 0.5), 10.0), w.Pong)
        for i, h in enumerate(hogs):  # each says who it is: authenticated, and counted as that host's
            h.socks[0].send(w.encode(w.Ping(100 + i, 0)))
        time.sleep(2.0)
        procs.kill(names[3])  # the honest agent restarts: its connection is a new one
        procs.start(names[3])
        procs.wait_ready([names[3]])
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as honest:
            t0 = time.monotonic()
            lease = honest.reserve(names[2], 10**9)
            while not lease.reserved and time.monotonic() - t0 < 1.0:
                honest.release(lease.flow_id)
                time.sleep(0.05)
                lease = honest.reserve(names[2], 10**9)
            took = time.monotonic() - t0
        assert lease.reserved and took < 1.0, (lease, took)
    finally:
        for h in hogs:
            h.close()
        procs.stop_all()
    rec = _exit_record(tmp_path / "arb0.log")
    # Its connections beyond its share were closed (some before they spoke: as silent ones).
    assert rec["connections"]["shed_sender"] >= 100, rec["connections"]


def test_renewal_release_and_ping_floods_are_metered_and_bounded_at_the_follower(tmp_path: Path) -> None:
    # ark-balance: all 64 of its flows are reserved (shared), so each Extend names 64 live flows.
    cf, names = write_cluster(tmp_path, 4, arbiters=2, control="arbiter", policy="ark-balance", takeover_s=1.0,
                              lease_min_s=30.0, arbiter_rate_per_host=200.0)
    procs = AgentProcs(cf, [], tmp_path)
    procs.start("arb0")
    procs.start("arb1")
    host = _Host(cf, names[0])
    dst = load_cluster(cf).host(names[1]).index
    try:
        first = _until(lambda: _grant(host.call(0, w.Ask(1, 0, dst, 10**9, 4791, 16), 0.5)), 10.0)
        assert isinstance(first, w.Grant), first
        time.sleep(1.0)
        epoch, flows = first.epoch, [p.flow for p in first.parts]
        for rid in (2, 3, 4):
            g = host.call(0, w.Ask(rid, epoch, dst, 10**9, 4791, 16))
            assert g is not None
            flows += [p.flow for p in _granted([g])]
        assert len(flows) == 64, len(flows)
        time.sleep(1.5)  # its tokens back
        sock = host.socks[0]
        n = 300
        for rid in range(10, 10 + n):
            sock.send(w.encode(w.Extend(rid, epoch, flows)))
        for rid in range(10_000, 11_000):
            sock.send(w.encode(w.Ping(rid, epoch)))
        answers = []
        while sock.poll(1500):
            answers.append(w.decode_to_host(sock.recv()))
        extended = [a for a in answers if isinstance(a, w.Extended)]
        pongs = [a for a in answers if isinstance(a, w.Pong)]
        assert len(extended) == n and all(s > 0 for a in extended for s in a.lease_s)  # answered, leases kept
        assert len(pongs) < 500, len(pongs)  # beyond its tokens, pings go unanswered
        for rid in range(20_000, 20_000 + n):  # releases: the first frees the 64, the rest find none held
            sock.send(w.encode(w.Drop(rid, epoch, flows)))
        dropped = []
        while sock.poll(1500):
            dropped.append(w.decode_to_host(sock.recv()))
        assert len(dropped) == n and all(isinstance(a, w.Dropped) for a in dropped)  # a release only frees
        time.sleep(0.5)
    finally:
        host.close()
        procs.stop_all()
    primary, standby = _exit_record(tmp_path / "arb0.log"), _exit_record(tmp_path / "arb1.log")
    assert primary["counters"]["rate_limited"] >= n // 2, primary
    # The release flood frees the 64 once; the rest are set look-ups, no table change.
    assert primary["counters"]["released"] == 64 and primary["counters"]["unknown"] >= (n - 1) * 64, primary
    # 300 x 64 renewals would be 19,200 table changes for the follower; its tokens allow a few
    # hundred (a burst of 256 and 200 a second).
    assert standby["counters"]["changes_applied"] < 2_000, standby


def test_a_forged_epoch_neither_stops_nor_ends_the_arbiter(tmp_path: Path) -> None:
    """A beat at the last epoch, signed with the other arbiter's key: refused and counted;
    the arbiter keeps leading its epoch and never ends on 'epoch: exhausted'."""
    cf, names = write_cluster(tmp_path, 4, arbiters=2, control="arbiter", takeover_s=0.5, lease_min_s=4.0)
    cl = load_cluster(cf)
    procs = AgentProcs(cf, [], tmp_path)
    # Both run (a leader answers only while its standby acknowledges its beats); the forger
    # holds arb1's key beside the real arb1.
    procs.start("arb0")
    procs.start("arb1")
    host = _Host(cf, names[0])
    pub, sec = read_secret_key(str(tmp_path / "keys" / "arb1.key_secret"))
    ctx = zmq.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.curve_publickey, forger.curve_secretkey = pub, sec
    forger.curve_serverkey = cl.arbiters[0].public_key.encode()
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(cl.arbiters[0].control)
    dst = cl.host(names[1]).index
    try:
        grant = _until(lambda: _grant(host.call(0, w.Ask(1, 0, dst, 10**9, 4791), 0.5)), 10.0)
        assert isinstance(grant, w.Grant), grant
        for _ in range(5):
            forger.send(w.encode(w.Beat((1 << 30) - 1, True, True)))  # odd: an epoch of rank 1
            time.sleep(0.1)
        time.sleep(2.0)  # takeover_s, and more: a follower would try to lead again by now
        assert procs.procs["arb0"].poll() is None, (tmp_path / "arb0.log").read_text()[-2000:]
        pong = host.call(0, w.Ping(2, grant.epoch))
        assert isinstance(pong, w.Pong) and pong.epoch == grant.epoch, pong
    finally:
        host.close()
        ctx.destroy(0)
        procs.stop_all()
    rec = _exit_record(tmp_path / "arb0.log")
    assert rec["counters"]["epoch_jumps"] >= 1 and rec["counters"]["stepped_down"] == 0, rec


class _FakeArbiter:
    """An arbiter's key in the test's hands: answers an agent as ``answer`` says."""

    def __init__(self, cluster_file: Path, workdir: Path) -> None:
        cl = load_cluster(cluster_file)
        pub, sec = read_secret_key(str(workdir / "keys" / "arb0.key_secret"))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.curve_server, self.sock.curve_publickey, self.sock.curve_secretkey = True, pub, sec
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(cl.arbiters[0].control)
        self.epoch, self.parts = 2, 1  # what asks are answered with
        self.host, self.n = cl.hosts[0].index, 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            if not self.sock.poll(50):
                continue
            ident, data = self.sock.recv_multipart()
            msg = w.decode_from_host(data)
            if isinstance(msg, w.Ask):
                parts = []
                for i in range(self.parts):
                    self.n += 1
                    parts.append(w.Part((self.host, self.epoch << SEQ_SHIFT | self.n), i % 4, True, False, 86400.0))
                reply: w.ToHost = w.Grant(msg.rid, self.epoch, parts)
            else:
                reply = w.Pong(msg.rid, 2)
            self.sock.send_multipart([ident, w.encode(reply)])

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.ctx.destroy(0)


def test_an_agent_refuses_grants_of_more_parts_than_asked_and_forged_epochs(tmp_path: Path) -> None:
    cf, names = write_cluster(tmp_path, 2, arbiters=1, control="arbiter", lease_min_s=4.0, arbiter_timeout_s=0.3)
    fake = _FakeArbiter(cf, tmp_path)
    procs = AgentProcs(cf, [names[0]], tmp_path)
    procs.start(names[0])
    try:
        procs.wait_ready([names[0]])
        with ArkClient(procs.api(names[0]), timeout_s=5.0) as c:
            assert _until(lambda: c.reserve(names[1], 10**9).reserved, 10.0)  # epoch 2, one part: taken
            fake.parts = 64  # 64 parts for a one-part ask
            greedy = c.reserve(names[1], 10**9)
            assert not greedy.reserved, greedy
            assert len(procs.tables([names[0]])[names[0]]) <= 2, procs.tables([names[0]])  # one flow per ask
            fake.parts, fake.epoch = 1, (1 << 30) - 1  # the last epoch: a jump no leader makes
            time.sleep(1.0)  # the link is up again (pings answered at epoch 2)
            forged = c.reserve(names[1], 10**9)
            assert not forged.reserved, forged
            fake.epoch = 4  # the next leader's epoch: believed (it would be refused after the forged one)
            time.sleep(1.0)
            assert _until(lambda: c.reserve(names[1], 10**9).reserved, 5.0)
            st = c.status()["arbiter"]["counters"]
        assert st["misfits"] >= 1 and st["epoch_jumps"] >= 1, st
    finally:
        procs.stop_all()
        fake.close()


def test_keyless_connections_reopened_from_a_listed_address_leave_an_honest_agent_its_share(tmp_path: Path) -> None:
    """Raw TCP from the hosts' own address that never finishes a handshake, 100 new ones a
    second (each lives the 2 s handshake timeout): they crowd out only that address's
    silent connections, and the honest agent's says who it is as soon as it is up."""
    cf, names = write_cluster(tmp_path, 4, arbiters=1, control="arbiter", lease_min_s=30.0, arbiter_timeout_s=0.5)
    cl = load_cluster(cf)
    port = int(cl.arbiters[0].control.rsplit(":", 1)[1])
    procs = AgentProcs(cf, [names[3]], tmp_path)
    procs.start("arb0")
    stop = threading.Event()

    def flood() -> None:
        open_: list[socket.socket] = []
        while not stop.is_set():
            for _ in range(10):
                s = socket.socket()
                with contextlib.suppress(OSError):
                    s.connect(("127.0.0.1", port))
                open_.append(s)
            while len(open_) > 300:
                open_.pop(0).close()
            time.sleep(0.1)
        for s in open_:
            s.close()

    t = threading.Thread(target=flood, daemon=True)
    try:
        time.sleep(1.0)
        t.start()
        time.sleep(3.0)  # the budget (84 connections here) would be full by now
        procs.start(names[3])
        procs.wait_ready([names[3]])
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as honest:
            time.sleep(0.5)
            t0 = time.monotonic()
            lease = honest.reserve(names[2], 10**9)
            while not lease.reserved and time.monotonic() - t0 < 1.0:
                honest.release(lease.flow_id)
                time.sleep(0.05)
                lease = honest.reserve(names[2], 10**9)
            took = time.monotonic() - t0
        assert lease.reserved and took < 1.0, (lease, took)
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        procs.stop_all()
    rec = _exit_record(tmp_path / "arb0.log")
    assert rec["connections"]["shed_pending"] >= 100, rec["connections"]
