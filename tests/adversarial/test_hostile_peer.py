"""A listed host run by an attacker with its real keys, and strangers without keys.

The attacker's messages pass CURVE and ZAP and reach the node: every one of them must be
counted and dropped, the agent must stay up, answer its engines, and keep its table.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
import zmq.auth

from ark.agent.attack import KINDS, hostile_envelopes
from ark.agent.bench import Bed, bed, hostile_memory, rss_mb, unauthenticated
from ark.agent.client import ArkClient
from ark.agent.keys import Signatures
from ark.core.envelope import K_DATA, K_HELLO, K_SYNC_REP, K_SYNC_REQ, decode_envelope, encode_envelope
from ark.core.messages import Release, Reserve, encode

PER_KIND = 10_000


@pytest.fixture()
def trio():
    with bed(agents=3, peer_rate=1e7) as b:
        yield b


def _state(b: Bed) -> dict[str, tuple[str, int, bool, int]]:
    out = {}
    for n in b.running:
        with ArkClient(b.procs.api(n)) as c:
            st = c.status()
            table = c.call({"op": "table"})
        out[n] = (table["digest"], len(table["flows"]), st["ready"], st["node"]["errors"])
    return out


def _received(b: Bed, name: str) -> int:
    with ArkClient(b.procs.api(name)) as c:
        return int(c.status()["node"]["received"])


@pytest.mark.parametrize("kind", KINDS)
def test_ten_thousand_hostile_messages_of_each_kind_change_nothing(trio: Bed, kind: str) -> None:
    b = trio
    target = b.running[0]
    before = _state(b)
    received = _received(b, target)
    ctx = zmq.Context()
    try:
        sock = b.as_x(ctx, target)
        time.sleep(0.5)
        xi, dst = b.cluster.host(b.x).index, b.cluster.host(target).index
        for data in hostile_envelopes(kind, xi, dst, time.time, PER_KIND, seed=KINDS.index(kind)):
            sock.send(data)
        deadline = time.monotonic() + 60
        while _received(b, target) < received + PER_KIND and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        ctx.destroy(0)
    assert _received(b, target) >= received + PER_KIND
    assert all(p.poll() is None for p in b.procs.procs.values())
    assert _state(b) == before  # same tables, still ready, no handler error
    with ArkClient(b.procs.api(target)) as c:
        st = c.status()
    assert st["node"]["invalid"] + st["node"]["dropped"] + st["core"]["invalid"] + st["node"]["sync_throttled"] >= PER_KIND // 2


def _x_router(ctx: zmq.Context, b: Bed) -> zmq.Socket:
    """A ROUTER with X's real keys on X's control address: what the agents' DEALERs reach."""
    xpub, xsec = zmq.auth.load_certificate(str(b.workdir / "keys" / f"{b.x}.key_secret"))
    r = ctx.socket(zmq.ROUTER)
    r.curve_server = True
    r.curve_publickey, r.curve_secretkey = xpub, xsec
    for _ in range(100):  # the address may still be in TIME_WAIT from a previous test
        try:
            r.bind(b.cluster.host(b.x).control)
            return r
        except zmq.ZMQError:
            time.sleep(0.05)
    raise AssertionError("cannot bind X's control address")


def _asked_for_a_snapshot(inbox: zmq.Socket, dealer: zmq.Socket, xi: int, incarnation: int) -> None:
    """X makes first contact with the target, which then asks X for a snapshot."""
    now = time.time()
    dealer.send(encode_envelope(K_HELLO, xi, incarnation, 0, [b"\0" * 8, now - 2.5, now - 1.0, now, []]))
    assert inbox.poll(5000)
    frames = inbox.recv_multipart()
    while decode_envelope(frames[-1]).kind != K_SYNC_REQ:
        assert inbox.poll(5000)
        frames = inbox.recv_multipart()


def test_a_sync_reply_cannot_plant_reservations_in_another_hosts_name(trio: Bed) -> None:
    """X answers the target's sync request with reservations in the target's own name and
    in X's name: only X's own, properly signed and within the lease cap, are taken."""
    b = trio
    target = b.running[0]
    t_idx, xi = b.cluster.host(target).index, b.cluster.host(b.x).index
    dst = next(h.index for h in b.cluster.hosts if b.cluster.fabric.hosts[h.index].leaf != b.cluster.fabric.hosts[t_idx].leaf)
    _xpub, xsec = zmq.auth.load_certificate(str(b.workdir / "keys" / f"{b.x}.key_secret"))
    x_sign = Signatures(xsec, {}).sign
    ctx = zmq.Context()
    try:
        inbox, dealer = _x_router(ctx, b), b.as_x(ctx, target)
        time.sleep(0.5)
        _asked_for_a_snapshot(inbox, dealer, xi, 41)
        now = time.time()
        mine = Reserve((xi, (41 << 32) + 1), now, xi, dst, 4791, 0, 49152, 10**9, 1e11, False, now + 2.0)
        in_targets_name = Reserve((t_idx, 7), now, t_idx, dst, 4791, 1, 49153, 10**9, 1e11, False, now + 2.0)
        forever = Reserve((xi, (41 << 32) + 2), now, xi, dst, 4791, 2, 49154, 10**9, 1e11, False, float("inf"))
        items = [[encode(mine), x_sign(encode(mine))],
                 [encode(in_targets_name), b"\x01" * 64],  # a signature it cannot have made
                 [encode(in_targets_name._replace(flow=(t_idx, 8))), b""],
                 [encode(forever), x_sign(encode(forever))]]
        frozen = [[t_idx, 7, 3, False]]  # an assignment for the target's flow: only owners speak for theirs
        dealer.send(encode_envelope(K_SYNC_REP, xi, 41, 0, [items, now, frozen, 0, 1]))
        time.sleep(0.5)
        with ArkClient(b.procs.api(target)) as c:
            flows = {(f[0], f[1]) for f in c.call({"op": "table"})["flows"]}
            st = c.status()
        assert mine.flow in flows
        assert (t_idx, 7) not in flows and (t_idx, 8) not in flows and forever.flow not in flows
        assert st["node"]["forged"] >= 2 and st["node"]["out_of_window"] >= 1
        dealer.send(encode_envelope(K_DATA, xi, 41, 1, [encode(Release(mine.flow, time.time())), b""]))
    finally:
        ctx.destroy(0)


def test_a_frozen_assignment_lie_moves_no_live_reservation(trio: Bed) -> None:
    """X, a listed host, answers the target's sync request with a frozen assignment for
    another host's live flow (on another path, or on none): the target keeps the path its
    own recomputation gives, counts the claim and logs it."""
    b = trio
    fab = b.cluster.fabric
    leaf = {h.name: fab.hosts[h.index].leaf for h in b.cluster.hosts}
    target = b.running[0]
    owner = next(n for n in b.running[1:] if leaf[n] == leaf[target])  # a leaf-mate: same uplinks
    dst = next(h.index for h in b.cluster.hosts if leaf[h.name] != leaf[target])
    xi = b.cluster.host(b.x).index
    with ArkClient(b.procs.api(owner)) as c:
        lease = c.reserve(dst, 10**10)
    assert lease.reserved
    ctx = zmq.Context()
    try:
        inbox, dealer = _x_router(ctx, b), b.as_x(ctx, target)
        time.sleep(0.5)
        _asked_for_a_snapshot(inbox, dealer, xi, 43)
        f = lease.flow_id
        lies = [[f[0], f[1], (lease.path + 1) % fab.n_paths(f[0], dst), False], [f[0], f[1], -1, False]]
        dealer.send(encode_envelope(K_SYNC_REP, xi, 43, 0, [[], time.time(), lies, 0, 1]))
        time.sleep(0.5)
        with ArkClient(b.procs.api(target)) as c:
            flows = {(g[0], g[1]): g for g in c.call({"op": "table"})["flows"]}
            st = c.status()
        assert flows[tuple(f)][2] == lease.path and st["node"]["frozen_conflicts"] >= 1
        with ArkClient(b.procs.api(target)) as c:
            mine = c.reserve(dst, 10**10)  # same destination leaf: must not land on the owner's path
        assert mine.reserved and mine.path != lease.path
        assert "frozen_claim_refused" in (b.procs.workdir / f"{target}.log").read_text()
    finally:
        ctx.destroy(0)


def test_messages_beyond_the_peer_rate_are_dropped_before_decoding() -> None:
    with bed(agents=2, peer_rate=100) as b:
        target = b.running[0]
        ctx = zmq.Context()
        try:
            sock = b.as_x(ctx, target)
            time.sleep(0.5)
            for k in range(2000):
                sock.send(encode_envelope(K_HELLO, b.cluster.host(b.x).index, 3, k, [b"\0" * 8, 1.0, 2.0, 3.0, []]))
            time.sleep(1.0)
            with ArkClient(b.procs.api(target)) as c:
                st = c.status()
        finally:
            ctx.destroy(0)
    assert st["node"]["rate_limited"] >= 1500 and st["ready"]


def test_strangers_cannot_exhaust_memory_or_descriptors() -> None:
    """Three connections announcing 200 MiB handshake frames, then 1,100 idle connections
    to an agent limited to 1,024 descriptors: it stays small, up and answering."""
    r = unauthenticated(announce_mb=200, connections=3, idle=1100, fd_limit=1024)
    assert r["alive"] and r["growth_mb"] <= 20 and r["connections_shed"] > 0, r


def test_garbage_on_the_local_api_socket_is_refused() -> None:
    with bed(agents=2) as b:
        ctx = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.connect(b.procs.api(b.running[0]))
            s.send_multipart([b"", b"\x80" * (1 << 22)])  # over the API's message cap: never read
            s.send_multipart([b"", msgpack.packb({"op": "status", "samples": float("inf")})])
            assert s.poll(5000)
            reply = msgpack.unpackb(s.recv_multipart()[-1])
        finally:
            ctx.destroy(0)
        assert not reply["ok"] and reply["error"].startswith("samples: must be an integer")
        assert all(p.poll() is None for p in b.procs.procs.values())
        assert rss_mb(b.pid(b.running[0])) < 200


@pytest.mark.slow
def test_a_million_hostile_messages_grow_the_agent_by_at_most_50_mb() -> None:
    r = hostile_memory(1_000_000)
    assert r["ready"] and r["errors"] == 0 and r["reservations"] == 0 and r["growth_mb"] <= 50, r
