"""Scoped dissemination gives every sending host exactly the decisions full broadcast gives."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ark.core.messages import Message
from ark.core.pathmap import PathMapCache
from ark.core.protocol import ArkCore
from ark.core.scope import pair_links, scope_of
from ark.core.topology import spine_leaf

FAB = spine_leaf(leaves=4, spines=3, gpus_per_leaf=2, hash="crc32")
MAPS = PathMapCache(FAB)
CROSS = [(s, d) for s in range(8) for d in range(8) if FAB.hosts[s].leaf != FAB.hosts[d].leaf]


def test_components_follow_shared_links() -> None:
    # gpu0 (leaf 0) -> gpu2 (leaf 1) and gpu4 (leaf 2) -> gpu6 (leaf 3): no link in common.
    sc = scope_of(FAB, [(0, 2), (1, 3), (4, 6)])
    assert sc.peers(0) == {1} and sc.peers(4) == frozenset() and not sc.sends(2)
    assert sorted(map(sorted, sc.components())) == [[0, 1], [4]]
    assert pair_links(FAB, 0, 2) <= sc.links(1) and not pair_links(FAB, 4, 6) & sc.links(0)
    # gpu5 (leaf 2) -> gpu3 (leaf 1) shares downlinks into leaf 1 with gpu0's flows: one component.
    assert sc.peers(0) != scope_of(FAB, [(0, 2), (1, 3), (4, 6), (5, 3)]).peers(0)
    assert sorted(map(sorted, scope_of(FAB, [(0, 2), (1, 3), (4, 6), (5, 3)]).components())) == [[0, 1, 4, 5]]


class Twin:
    """The same hosts twice: every message to everyone, and only within the sender's component."""

    def __init__(self, pairs: list[tuple[int, int]], policy: str) -> None:
        self.scope = scope_of(FAB, pairs)
        self.full = [ArkCore(h, FAB, MAPS, policy=policy, seed=h) for h in range(8)]
        self.scoped = [ArkCore(h, FAB, MAPS, policy=policy, seed=h) for h in range(8)]
        self.pending: list[tuple[int, Message]] = []  # (recipient, message), full broadcast

    def request(self, src: int, dst: int, nbytes: int, now: float) -> None:
        a = self.full[src].request(dst, nbytes, now)
        b = self.scoped[src].request(dst, nbytes, now)
        assert (a.flow, a.path, a.port, a.reserved, a.fallback) == (b.flow, b.path, b.port, b.reserved, b.fallback)
        assert a.events == b.events
        self.pending += [(h, m) for m in a.messages for h in range(8) if h != src]

    def release(self, src: int, now: float) -> None:
        live = sorted(self.full[src].local_flows())
        if not live:
            return
        f = live[0]
        a, b = self.full[src].release(f, now), self.scoped[src].release(f, now)
        assert a == b
        self.pending += [(h, m) for m in a.messages for h in range(8) if h != src]

    def deliver(self, index: int, now: float) -> None:
        h, m = self.pending.pop(index % len(self.pending))
        evs = self.full[h].receive(m, now)
        if h in self.scope.peers(m.flow[0]):
            assert self.scoped[h].receive(m, now) == evs
        elif self.scope.sends(h):
            assert [e for e in evs if e.flow[0] == h] == []  # out of scope: it could not move our flows

    def check(self) -> None:
        for h in range(8):
            if self.scope.sends(h):
                mine = self.scope.links(h)
                full = {f: v for f, v in self.full[h].table().items() if f[0] in self.scope.peers(h) | {h}}
                assert full == self.scoped[h].table()
                assert self.full[h].local_flows() == self.scoped[h].local_flows()
                assert all(lk in mine for lk in self.scoped[h].link_holders())


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.sampled_from(CROSS), min_size=1, max_size=6, unique=True),
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000)), min_size=5, max_size=80),
    policy=st.sampled_from(["ark", "ark-balance"]),
)
def test_scoped_decisions_equal_full_broadcast(pairs, ops, policy) -> None:
    tw = Twin(pairs, policy)
    now = 1.0
    rng = random.Random(len(ops))
    for kind, x in ops:
        now += rng.choice([0.0, 1e-5, 1e-3, 0.05])
        if kind == 0:
            src, dst = pairs[x % len(pairs)]
            tw.request(src, dst, 10**8 + x, now)
        elif kind == 1:
            tw.release(pairs[x % len(pairs)][0], now)
        elif tw.pending:
            tw.deliver(x, now)
    while tw.pending:
        tw.deliver(rng.randrange(len(tw.pending)), now)
    tw.check()


def test_a_scoped_node_reserves_and_keeps_only_what_lies_in_its_links() -> None:
    """Out of scope: its own requests go to plain ECMP; a peer's reservation, published or
    relayed in a snapshot, is dropped and counted, and never enters the table."""
    from ark.core.envelope import K_DATA, K_SYNC_REP, encode_envelope
    from ark.core.lease import LeasePolicy
    from ark.core.messages import Reserve, encode
    from ark.core.node import Node

    links = scope_of(FAB, [(0, 2), (1, 3)]).links(0)  # leaf 0 -> leaf 1
    n = Node(0, FAB, MAPS, [1, 3, 5], incarnation=1, lease=LeasePolicy(1.0, 2.0, 600.0), scope_links=links)
    n.start(0.0)
    n.tick(2.0)  # nobody answered: ready anyway
    inside, _ = n.reserve(2, 10**9, 3.0)
    outside, outs = n.reserve(4, 10**9, 3.0)  # leaf 2's downlinks: nobody here hears about them
    assert inside.reserved and not outside.reserved and outs == [] and n.counters.out_of_scope == 1

    def reserve(src: int, dst: int, seq: int) -> bytes:
        return encode(Reserve((src, seq), 3.0, src, dst, 4791, 0, 50_000, 10**9, 1e11, expires=4.0))

    n.on_message(5, encode_envelope(K_DATA, 5, 1, 1, [reserve(5, 1, 1), b""]), 3.0)  # leaf 2 -> leaf 0
    n.on_message(1, encode_envelope(K_DATA, 1, 1, 1, [reserve(1, 3, 1), b""]), 3.0)  # in scope: taken
    assert n.counters.out_of_scope == 2 and (1, 1) in n.core.table() and (5, 1) not in n.core.table()
    # The same out-of-scope reservation relayed by a peer's snapshot: dropped as well.
    n.tick(3.0)
    n._request_sync(3, 3.0)  # a sync in flight to peer 3, so its reply is taken
    seq = (1 << 32) + 2  # of host 5's current incarnation (an earlier one's would be a replay)
    n.on_request(3, encode_envelope(K_SYNC_REP, 3, 1, 0, [[[reserve(5, 1, seq), b""]], 3.0, [], 0, 1]), 3.0)
    assert n.counters.out_of_scope == 3 and (5, seq) not in n.core.entries()
