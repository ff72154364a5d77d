from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ark.core.messages import Release, Reserve
from ark.core.pathmap import PathMapCache
from ark.core.protocol import MORE_PORTS_PER_FLOW, ArkCore, CoreError
from ark.core.topology import preset, spine_leaf
from tests.harness import Cluster

PAPER = preset("paper")
# Three busy leaves plus a fourth whose hosts never send: host REF is the reference
# replica that sees every other host's messages.
THREE = spine_leaf(leaves=4, spines=3, gpus_per_leaf=2, hash="crc32")
SENDERS = 6
REF = 7


def test_lowest_free_path_then_fallback_under_ark() -> None:
    c = Cluster(PAPER)
    decs = [c.request(0, 8 + i, 10**9, 1.0 + i) for i in range(4)]
    assert [d.path for d in decs] == [0, 1, 2, 3]
    assert all(d.reserved and not d.fallback for d in decs)
    # All four spines busy: plain ECMP, nothing reserved, nothing broadcast.
    d = c.request(0, 12, 10**9, 5.0)
    assert d.fallback and not d.reserved and d.messages == ()
    pm = PathMapCache(PAPER)(0, 12, 4791)
    assert pm.path_of(d.port) == d.path
    assert c.cores[0].counters.fallbacks == 1
    # Release frees the path for the next flow.
    c.release(0, decs[1].flow, 6.0)
    assert c.request(0, 9, 10**9, 7.0).path == 1


def test_chosen_port_hashes_to_chosen_path() -> None:
    c = Cluster(PAPER)
    maps = PathMapCache(PAPER)
    for i in range(4):
        d = c.request(1, 9, 10**9, float(i))
        assert maps(1, 9, 4791).path_of(d.port) == d.path
        assert d.flow_label is not None and 0 < d.flow_label < 1 << 20


def test_more_ports_are_free_ports_of_the_flows_path_held_until_release() -> None:
    c = Cluster(PAPER)
    core = c.cores[0]
    pm = PathMapCache(PAPER)(0, 8, 4791)
    d = c.request(0, 8, 10**9, 1.0)
    more = core.more_ports(d.flow, 5)
    assert len(more) == 5 and len({d.port, *more}) == 6
    assert all(pm.path_of(p) == d.path for p in more)
    # Held: later flows towards the same peer never get them, whatever path they take.
    held = {d.port, *more}
    others = [c.request(0, 8, 10**9, 2.0 + i) for i in range(3)]
    assert all(o.port not in held for o in others)
    for o in others:
        c.release(0, o.flow, 6.0)
    # A flow holds at most MORE_PORTS_PER_FLOW extra ports: fewer than asked, then none.
    everything = core.more_ports(d.flow, 1 << 16)
    assert len(everything) == MORE_PORTS_PER_FLOW - 5 and core.more_ports(d.flow, 3) == []
    c.release(0, d.flow, 7.0)
    again = c.request(0, 8, 10**9, 8.0)
    assert again.path == d.path and core.more_ports(again.flow, 4) != []  # given back at release
    with pytest.raises(CoreError, match="not an active local flow"):
        core.more_ports(d.flow, 1)
    with pytest.raises(CoreError, match="n: must be >= 0"):
        core.more_ports(again.flow, -1)


def test_intra_leaf_flows_reserve_nothing() -> None:
    c = Cluster(PAPER)
    d = c.request(0, 3, 10**9, 1.0)
    assert not d.reserved and d.messages == () and d.path == 0
    assert c.cores[0].table() == {}


def test_a_peers_reservation_on_one_leaf_holds_no_link() -> None:
    """An owner never sends one, but a peer may: it is kept, holds nothing, blocks nobody."""
    c = Cluster(PAPER)
    peer = c.cores[5]
    peer.receive(Reserve((0, 1), 1.0, 0, 3, 4791, 0, 49152, 10**9, 1e11), 1.0)
    peer.receive(Release((0, 1), 1.5), 1.5)
    d = c.request(5, 9, 10**9, 1.2)
    assert d.reserved and d.path == 0
    assert all((0, 1) not in hs for hs in peer.link_holders().values())


def test_reservations_are_per_link() -> None:
    fab = spine_leaf(leaves=4, spines=2, gpus_per_leaf=2)
    c = Cluster(fab)
    a = c.request(0, 2, 10**9, 1.0)  # leaf0 -> leaf1
    c.deliver_all(random.Random(0), 1.1)
    b = c.request(4, 6, 10**9, 2.0)  # leaf2 -> leaf3: disjoint links, same path index
    assert a.path == 0 and b.path == 0 and b.reserved
    c.deliver_all(random.Random(0), 2.1)
    d = c.request(5, 3, 10**9, 3.0)  # leaf2 -> leaf1: uplink leaf2/spine0 and downlink spine0/leaf1 busy
    assert d.path == 1


def test_race_smaller_key_wins_and_loser_is_repathed() -> None:
    c = Cluster(PAPER)
    a = c.request(0, 8, 10**9, 1.0)
    b = c.request(1, 9, 10**9, 1.000005)  # inside the broadcast window: both take path 0
    assert a.path == b.path == 0
    evs = c.cores[1].receive(a.messages[0], 1.00002, sender=0)
    assert len(evs) == 1 and evs[0].flow == b.flow and evs[0].path == 1 and evs[0].reserved
    assert PathMapCache(PAPER)(1, 9, 4791).path_of(evs[0].port) == 1
    assert c.cores[0].receive(b.messages[0], 1.00002, sender=1) == []
    c.pending = {h: [] for h in c.pending}
    for h in range(2, 16):
        for m in (b.messages[0], a.messages[0]):
            c.cores[h].receive(m, 1.00003)
    assert len(c.digests()) == 1
    assert c.cores[5].table() == {a.flow: (0, False), b.flow: (1, False)}
    assert c.cores[1].counters.races_lost == 1


def test_release_before_reserve_is_remembered() -> None:
    c = Cluster(PAPER)
    a = c.request(0, 8, 10**9, 1.0)
    rel = c.cores[0].release(a.flow, 2.0).messages[0]
    peer = c.cores[5]
    peer.receive(rel, 2.1)
    peer.receive(a.messages[0], 2.2)
    assert peer.table() == {} and peer.digest() == c.cores[0].digest()


def test_duplicates_and_invalid_messages_do_not_change_the_table() -> None:
    c = Cluster(PAPER)
    a = c.request(0, 8, 10**9, 1.0)
    peer = c.cores[3]
    peer.receive(a.messages[0], 1.1)
    before = peer.digest()
    peer.receive(a.messages[0], 1.2)
    assert peer.counters.duplicates == 1
    bad = [
        a.messages[0]._replace(path=7),  # no such path
        a.messages[0]._replace(dst=99),  # no such host
        a.messages[0]._replace(port=12345, nbytes=5),  # same flow id, other content
        Reserve((2, 1), 1.0, 2, 2, 4791, 0, 50000, 1, 1e9),  # to itself
    ]
    for m in bad:
        peer.receive(m, 1.3)
    peer.receive(Reserve((2, 9), 1.0, 2, 9, 4791, 1, 50000, 1, 1e9), 1.3, sender=4)  # impersonation
    peer.receive(Release((0, 1), 0.5), 1.4)  # release before its own reserve ts
    assert peer.counters.invalid == 6
    assert peer.digest() == before


def test_ark_balance_picks_least_backlog_and_records_it() -> None:
    c = Cluster(PAPER, policy="ark-balance")
    sizes = [8e9, 2e9, 6e9, 4e9]
    decs = [c.request(0, 8 + i, int(s), 1.0) for i, s in enumerate(sizes)]
    assert [d.path for d in decs] == [0, 1, 2, 3]
    d = c.request(0, 12, 10**9, 1.01)
    assert d.path == 1 and d.shared and d.reserved and len(d.messages) == 1
    # Now path 1 holds 2 GB + 1 GB (minus what drained): path 3 (4 GB) is next... until
    # the backlog of path 1 exceeds path 3's.
    e = c.request(0, 13, 10**9, 1.02)
    assert e.path == 1
    f = c.request(0, 14, 10**9, 1.03)
    assert f.path == 3
    c.deliver_all(random.Random(1), 1.1)
    assert len(c.digests()) == 1
    t = c.cores[9].table()
    assert t[d.flow] == (1, True)


def test_core_rejects_bad_calls() -> None:
    maps = PathMapCache(PAPER)
    with pytest.raises(CoreError, match="policy: must be one of ark, ark-balance"):
        ArkCore(0, PAPER, maps, policy="greedy")
    core = ArkCore(0, PAPER, maps)
    with pytest.raises(CoreError, match="dst"):
        core.request(0, 10, 1.0)
    with pytest.raises(CoreError, match="flow"):
        core.release((0, 99), 1.0)


def test_tick_forgets_old_releases_and_drops_stale_messages() -> None:
    c = Cluster(PAPER)
    a = c.request(0, 8, 10**9, 1.0)
    c.release(0, a.flow, 2.0)
    peer = c.cores[4]
    c.deliver_all(random.Random(0), 2.1)
    assert a.flow in peer.entries()
    peer.tick(100.0)
    assert a.flow not in peer.entries()
    peer.receive(a.messages[0], 100.1)  # a late duplicate from long ago
    assert peer.counters.stale == 1 and peer.table() == {}


# ---------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------
op = st.tuples(
    st.sampled_from(["req", "req", "rel", "deliver", "deliver", "deliver"]),
    st.integers(0, SENDERS - 1),
    st.integers(0, SENDERS - 1),
    st.integers(0, 10**6),
)


def _run_ops(ops, policy: str, skew: list[float], seed: int) -> Cluster:
    c = Cluster(THREE, policy=policy)
    now = 1.0
    rng = random.Random(seed)
    for kind, h, other, x in ops:
        now += (x % 1000) * 1e-6  # steps of up to 1 ms; races inside the window
        if kind == "req":
            if THREE.hosts[h].leaf == THREE.hosts[other].leaf:
                continue
            c.request(h, other, 10**8 + x * 10**4, now + skew[h])
        elif kind == "rel":
            if c.flows[h]:
                c.release(h, c.flows[h][x % len(c.flows[h])], now + skew[h])
        elif c.pending[h]:
            c.deliver_one(h, x % len(c.pending[h]), now)
    c.deliver_all(rng, now + 1e-3)
    return c


@given(
    ops=st.lists(op, min_size=1, max_size=60),
    policy=st.sampled_from(["ark", "ark-balance"]),
    skew=st.lists(st.floats(-5e-5, 5e-5), min_size=THREE.n_hosts, max_size=THREE.n_hosts),
    seed=st.integers(0, 2**16),
)
def test_any_delivery_order_gives_identical_tables(ops, policy, skew, seed) -> None:
    c = _run_ops(ops, policy, skew, seed)
    assert len(c.digests()) == 1
    # And equal to a fresh replica fed everything in key order, then the releases.
    ref = ArkCore(REF, THREE, PathMapCache(THREE), policy=policy)
    reserves = sorted((m for m in c.sent if isinstance(m, Reserve)), key=lambda m: m.key)
    for m in reserves + [m for m in c.sent if isinstance(m, Release)]:
        ref.receive(m, 99.0)
    assert ref.table() == c.cores[0].table()
    assert ref.digest() == c.cores[0].digest()


@given(
    ops=st.lists(op, min_size=1, max_size=60),
    skew=st.lists(st.floats(-5e-5, 5e-5), min_size=THREE.n_hosts, max_size=THREE.n_hosts),
    seed=st.integers(0, 2**16),
)
def test_no_link_held_by_two_winners_after_delivery(ops, skew, seed) -> None:
    c = _run_ops(ops, "ark", skew, seed)
    for core in c.cores:
        assert core.exclusive_conflicts() == []
    # Every local flow that is reserved sits on the path its replica assigned.
    for core in c.cores:
        table = core.table()
        for f, (_dst, path, _port, reserved) in core.local_flows().items():
            if reserved:
                assert table[f][0] == path


@given(
    times=st.lists(st.sampled_from([1.0, 1.0, 1.5, 2.0]), min_size=2, max_size=40),
    hosts=st.lists(st.integers(0, SENDERS - 1), min_size=40, max_size=40),
)
def test_reservation_keys_are_a_strict_total_order(times, hosts) -> None:
    c = Cluster(THREE, policy="ark-balance")
    keys = []
    for i, t in enumerate(sorted(times)):
        h = hosts[i]
        dst = (h + 2) % SENDERS
        d = c.request(h, dst, 10**9, t)
        keys += [m.key for m in d.messages]
    assert len(set(keys)) == len(keys)
    s = sorted(keys)
    assert all(a < b for a, b in itertools.pairwise(s))


def test_the_table_sets_and_thaws_assignments_the_node_decided_on() -> None:
    from ark.core.table import ReservationTable

    t = ReservationTable(PAPER)
    f = (3, 1)
    t.receive(Reserve(f, 1.0, 3, 12, 4791, 0, 50000, 10**9, 1e11))
    assert t.table()[f] == (0, False) and t.assignment(f) == (1.0, False, 0, False)
    t.adopt({f: (1, False)})  # taken and frozen: no recomputation moves it
    t.recompute()
    assert t.frozen() == {f: (1, False)} and t.table()[f] == (1, False)
    t.adopt({f: (9, False)})  # out of range: counted, dropped
    assert t.frozen() == {f: (1, False)} and t.counters.invalid == 1
    t.adopt({f: None})  # thawed: recomputed from what the table holds
    assert t.frozen() == {} and t.table()[f] == (0, False)
    assert t.adopt({(5, 5): (1, False)}) == []  # a reservation it does not hold: nothing


def test_two_replicas_fed_one_message_set_in_shuffled_orders_hold_each_links_backlog_exactly() -> None:
    """Plain tables (no backlog tree): a link's backlog, kept as holders arrive in or out of
    key order and leave, equals folding its holders again, to the bit, on every link."""
    from ark.core.table import ReservationTable, backlog

    rng = random.Random(11)
    msgs: list[Reserve | Release] = []
    for k in range(400):
        src, dst = rng.randrange(8), 8 + rng.randrange(8)
        msgs.append(Reserve((src, k + 1), rng.random() * 2.0, src, dst, 4791, rng.randrange(4), 50000 + k,
                            rng.randrange(1, 10**9), PAPER.path_rate_bps(src, dst, 0) * rng.choice((1.0, 0.5))))
    msgs += [Release(m.flow, m.ts + rng.random()) for m in rng.sample(msgs, 80) if isinstance(m, Reserve)]
    tables = []
    shuffled = list(msgs)
    random.Random(1).shuffle(shuffled)
    # One in time order (each link's fold kept as holders arrive), one shuffled (folds dropped and redone).
    for order in (sorted(msgs, key=lambda m: (m.ts, isinstance(m, Release))), shuffled):
        t = ReservationTable(PAPER, policy="ark-balance", backlog_index=False)
        for i, m in enumerate(order):
            t.receive(m)
            if i % 3 == 0:  # asked midway too, so that folds are kept, used and added to
                for lk in list(t._holders):
                    want = backlog([t.get(f).msg for f in t.holders(lk)], m.ts)  # type: ignore[union-attr]
                    assert t.link_backlog(lk, m.ts) == want, (i, lk)
        t.settle()
        tables.append(t)
    a, b = tables
    assert a.table() == b.table()
    links = set(a._holders) | set(b._holders)
    assert len(links) == 8 and all(len(a.holders(lk)) > 20 for lk in links)  # every uplink and downlink, shared
    for now in (2.0, 2.5, 4.0):
        for lk in sorted(links):
            want = backlog([a.get(f).msg for f in a.holders(lk)], now)  # type: ignore[union-attr]
            assert a.link_backlog(lk, now) == want and b.link_backlog(lk, now) == want, lk
