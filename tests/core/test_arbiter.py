"""The arbiter's sans-IO core: decisions, leases, caps, retries, epochs and takeover."""

from __future__ import annotations

import random

import msgspec
import pytest

from ark.core import arbiter_wire as w
from ark.core.arbiter import SEQ_SHIFT, Arbiter, ArbiterLimits, ArbiterOut
from ark.core.lease import LeasePolicy
from ark.core.table import CoreError
from ark.core.topology import preset

PAPER = preset("paper")  # 2 leaves of 8 GPUs, 4 spines: hosts 0-7 on leaf 0, 8-15 on leaf 1
LEASE = LeasePolicy(1.0, 2.0, 60.0)


def _arbiter(policy: str = "ark", **kw: object) -> Arbiter:
    a = Arbiter(PAPER, policy=policy, lease=LEASE, **kw)  # type: ignore[arg-type]
    a.start(0.0)
    return a


def _ask(a: Arbiter, host: int, rid: int, dst: int = 8, nbytes: int = 10**8, now: float = 0.0, parts: int = 1,
         epoch: int = 0) -> w.Grant:
    out = a.on_host(host, w.encode(w.Ask(rid, epoch, dst, nbytes, 4791, parts)), now)
    replies = [o for o in out if o.host == host]
    assert len(replies) == 1
    reply = w.decode_to_host(replies[0].data)
    assert isinstance(reply, w.Grant), reply
    return reply


def test_a_lone_arbiter_leads_and_grants_the_lowest_free_path_then_ecmp() -> None:
    a = _arbiter()
    assert a.leading
    paths = [_ask(a, h, h).parts[0] for h in range(5)]  # five senders on leaf 0, four spines
    assert [p.path for p in paths[:4]] == [0, 1, 2, 3] and all(p.reserved for p in paths[:4])
    assert not paths[4].reserved and paths[4].why == "no free path"
    assert all(p.flow[0] == h and p.flow[1] >> SEQ_SHIFT == a.epoch for h, p in enumerate(paths))
    assert a.table.exclusive_conflicts() == []
    same_leaf = _ask(a, 0, 99, dst=1).parts[0]
    assert not same_leaf.reserved and same_leaf.why == "same leaf"


def test_split_parts_take_distinct_paths_and_share_the_least_backlogged_when_full() -> None:
    a = _arbiter("ark-split")
    parts = _ask(a, 0, 1, nbytes=3 * 10**9, parts=3).parts
    assert [p.path for p in parts] == [0, 1, 2] and not any(p.shared for p in parts)
    more = _ask(a, 1, 2, nbytes=10**9, parts=2).parts
    assert more[0].path == 3 and not more[0].shared
    assert more[1].shared and more[1].reserved and more[1].path != 3


def test_release_frees_the_path_and_only_the_owner_may_name_a_flow() -> None:
    a = _arbiter()
    p = _ask(a, 0, 1).parts[0]
    a.on_host(3, w.encode(w.Drop(1, 0, [p.flow])), 0.1)  # another host names it: nothing happens
    assert a.counters.foreign == 1 and _ask(a, 1, 2, now=0.2).parts[0].path == 1
    out = a.on_host(0, w.encode(w.Drop(2, 0, [p.flow])), 0.3)
    assert isinstance(w.decode_to_host(out[0].data), w.Dropped)
    assert _ask(a, 2, 3, now=0.4).parts[0].path == 0


def test_extend_renews_held_flows_and_answers_minus_one_for_the_others() -> None:
    a = _arbiter()
    p = _ask(a, 0, 1, nbytes=0).parts[0]
    assert p.lease_s == pytest.approx(1.0)
    reply = w.decode_to_host(a.on_host(0, w.encode(w.Extend(2, 0, [p.flow, (0, 12345)])), 0.5)[0].data)
    assert isinstance(reply, w.Extended) and reply.lease_s[0] == pytest.approx(1.0) and reply.lease_s[1] == -1
    a.tick(1.4)
    assert a.table.get(p.flow).end == pytest.approx(1.5)  # type: ignore[union-attr]
    a.tick(3.0)  # expired (plus the grace): the path is free again
    assert _ask(a, 1, 3, now=3.0).parts[0].path == 0


def test_a_host_beyond_its_rate_gets_no_grant_and_beyond_its_live_cap_ecmp_with_the_reason() -> None:
    a = _arbiter(limits=ArbiterLimits(max_flows_per_host=2, rate_per_host=10.0, burst_per_host=3))
    got = [_ask(a, 0, i, dst=8 + i).parts for i in range(4)]
    assert [p.reserved for p in got[0] + got[1] + got[2]] == [True, True, False] and got[3] == []
    assert got[2][0].why == "cap: 2 live reservations"  # beyond the tokens: no grant at all (the host goes ECMP)
    assert a.counters.rate_limited == 1 and a.counters.capped == 1
    assert _ask(a, 0, 9, dst=12, now=0.2).parts[0].why.startswith("cap")  # tokens back, cap still holds


def test_an_epoch_whose_flow_ids_are_used_up_leads_on_in_a_new_one() -> None:
    a = _arbiter()
    first = _ask(a, 0, 1).parts[0]
    a._n = (1 << SEQ_SHIFT) - 1  # the last id of this epoch was handed out
    nxt = _ask(a, 1, 2).parts[0]
    assert a.leading and a.epoch > first.flow[1] >> SEQ_SHIFT and a.epoch % a.arbiters == a.rank
    assert nxt.flow == (1, a.epoch << SEQ_SHIFT | 1) and nxt.path == 1  # the earlier grant still holds path 0


def test_a_retried_request_id_gets_the_same_answer_and_changes_nothing() -> None:
    a = _arbiter()
    first = a.on_host(0, w.encode(w.Ask(7, 0, 8, 100, 4791)), 0.0)
    again = a.on_host(0, w.encode(w.Ask(7, 0, 8, 100, 4791)), 0.01)
    assert again == [ArbiterOut(0, -1, first[0].data)] and a.counters.retries == 1
    assert len(a.table.table()) == 1


def test_hostile_bytes_and_claims_are_counted_and_change_nothing() -> None:
    a = _arbiter()
    before = a.status()
    for data in (b"", b"\xff" * 10, msgspec.msgpack.encode([1, 1, 0, 99, 1, 1, 1, 0]),
                 msgspec.msgpack.encode([1, 1, 0, 8, -1, 1, 1, 0]), msgspec.msgpack.encode([21, 5, True, True])):
        a.on_host(0, data, 0.0)
    a.on_host(0, w.encode(w.Ask(11, 0, 0, 100, 4791)), 0.0)  # to itself
    a.on_host(99, w.encode(w.Ask(2, 0, 8, 100, 4791)), 0.0)  # not a host of the fabric
    assert a.counters.invalid == 7 and a.table.table() == {} and a.epoch == before["epoch"]
    # A host that claims a newer epoch does not make the arbiter step down.
    assert _ask(a, 0, 3, epoch=(1 << 30) - 1).parts[0].reserved and a.leading
    # A foreign arbiter message (rank 0 talking to itself, a rank that does not exist) is dropped.
    assert a.on_arbiter(0, w.encode(w.Beat(7, True, True)), 0.0) == [] and a.leading


class _Pair:
    """Two arbiters wired back to back; ``up`` False stops one (it neither ticks nor hears),
    ``cut`` cuts the link between them."""

    def __init__(self, policy: str = "ark") -> None:
        self.a = [Arbiter(PAPER, rank=r, arbiters=2, policy=policy, lease=LEASE) for r in range(2)]
        self.up = [True, True]
        self.cut = False
        self.now = 0.0
        for x in self.a:
            self.deliver(x, x.start(0.0))

    def deliver(self, src: Arbiter, outs: list[ArbiterOut]) -> list[ArbiterOut]:
        to_hosts = []
        for o in outs:
            if o.arbiter >= 0:
                if self.up[src.rank] and self.up[o.arbiter] and not self.cut:
                    self.deliver(self.a[o.arbiter], self.a[o.arbiter].on_arbiter(src.rank, o.data, self.now))
            else:
                to_hosts.append(o)
        return to_hosts

    def run(self, until: float) -> None:
        while self.now < until:
            self.now = round(self.now + 0.05, 6)
            for x in self.a:
                if self.up[x.rank]:
                    self.deliver(x, x.tick(self.now))

    def ask(self, rank: int, host: int, rid: int, epoch: int = 0, nbytes: int = 10**8) -> w.ToHost:
        x = self.a[rank]
        outs = self.deliver(x, x.on_host(host, w.encode(w.Ask(rid, epoch, 8, nbytes, 4791)), self.now))
        self.deliver(x, x.flush())
        return w.decode_to_host(outs[0].data)


def test_the_first_rank_leads_at_a_cold_start_and_the_other_follows_its_table() -> None:
    p = _Pair()
    p.run(1.5)
    lead, follow = p.a
    assert lead.leading and not follow.leading and follow.synced and lead.epoch % 2 == 0
    refused = p.ask(1, 0, 1)
    assert isinstance(refused, w.Refused) and refused.leader == 0
    grants = [p.ask(0, h, h) for h in range(3)]
    assert all(isinstance(g, w.Grant) for g in grants)
    assert follow.table.table() == lead.table.table() and len(lead.table.table()) == 3


def test_the_standby_takes_over_a_silent_leader_with_a_higher_epoch_and_its_table() -> None:
    p = _Pair()
    p.run(1.5)
    g = p.ask(0, 0, 1, nbytes=10**10)  # a lease of 2.6 s: it outlives the takeover
    assert isinstance(g, w.Grant)
    old_epoch, flow = p.a[0].epoch, g.parts[0].flow
    p.up[0] = False  # the primary dies
    p.run(3.0)
    new = p.a[1]
    assert new.leading and new.epoch > old_epoch and new.epoch % 2 == 1
    # A renewal of the old leader's grant works: the standby followed it.
    ext = w.decode_to_host(new.on_host(0, w.encode(w.Extend(2, new.epoch, [flow])), p.now)[0].data)
    assert isinstance(ext, w.Extended) and ext.lease_s[0] > 0
    nxt = p.ask(1, 1, 3, epoch=new.epoch)
    assert isinstance(nxt, w.Grant) and nxt.parts[0].path == 1  # path 0 is still held by host 0
    assert nxt.parts[0].flow[1] >> SEQ_SHIFT == new.epoch
    # The old primary comes back leading its old epoch: the new leader's beat makes it follow.
    p.up[0] = True
    p.run(3.5)
    assert not p.a[0].leading and p.a[1].leading and p.a[0].synced
    assert p.a[0].table.table() == p.a[1].table.table()


def _answer(x: Arbiter, host: int, rid: int, now: float, epoch: int = 0) -> w.ToHost:
    return w.decode_to_host(x.on_host(host, w.encode(w.Ask(rid, epoch, 8, 10**8, 4791)), now)[0].data)


def test_a_leader_cut_from_its_follower_stops_answering_before_the_follower_leads() -> None:
    """The leader lease: answers end ``lease_s`` after the last beat the follower
    acknowledged was sent; the follower leads ``takeover_s`` after it heard that beat."""
    p = _Pair()
    p.run(1.5)
    lead, follow = p.a
    assert isinstance(p.ask(0, 0, 1), w.Grant)
    p.cut = True
    cut_at, last_answer, took_over, rid = p.now, -1.0, -1.0, 10
    while took_over < 0:
        p.run(round(p.now + 0.05, 6))
        rid += 1
        if isinstance(_answer(lead, 1, rid, p.now), w.Grant):
            last_answer = p.now
        if follow.leading:
            took_over = p.now
    assert lead.leading and lead.counters.no_lease > 0  # it still believes it leads, and says no
    assert cut_at < last_answer < took_over and last_answer <= cut_at + lead.lease_s
    refused = _answer(lead, 1, rid + 1, p.now)
    assert isinstance(refused, w.Refused) and refused.why == "no lease" and refused.leader == -1
    assert isinstance(_answer(follow, 1, rid + 2, p.now, follow.epoch), w.Grant)  # its lease needs no dead leader's
    p.cut = False
    p.run(p.now + 0.5)
    assert not lead.leading and follow.leading and lead.synced


def test_a_stopped_leader_that_resumes_answers_nothing_until_its_follower_acknowledges_it() -> None:
    p = _Pair()
    p.run(1.5)
    lead, follow = p.a
    p.up[0] = False  # SIGSTOP for three takeover periods: the standby leads meanwhile
    p.run(4.5)
    assert follow.leading and follow.epoch > lead.epoch
    assert isinstance(_answer(follow, 2, 1, p.now, follow.epoch), w.Grant)
    p.up[0] = True  # it resumes still leading its old epoch, and a host that heard nothing new asks it
    refused = _answer(lead, 1, 2, p.now)
    assert isinstance(refused, w.Refused) and refused.why == "no lease"
    assert lead.counters.paused == 1 and lead.counters.no_lease == 1 and lead.counters.granted == 0
    p.run(5.0)
    assert not lead.leading and follow.leading and lead.synced


def test_a_stopped_follower_stops_the_leaders_answers_until_it_is_back() -> None:
    """With two arbiters the follower is the leader's witness: a leader cannot tell a dead
    follower from one cut off (which leads), so it answers nothing meanwhile."""
    p = _Pair()
    p.run(1.5)
    lead = p.a[0]
    p.up[1] = False
    p.run(2.5)
    assert isinstance(_answer(lead, 1, 1, p.now), w.Refused)
    p.up[1] = True
    p.run(2.8)  # the leader's next beat, acknowledged
    assert p.a[0].leading and isinstance(_answer(lead, 1, 2, p.now), w.Grant)


def test_an_arbiter_that_never_heard_its_peer_answers_nothing_after_leading() -> None:
    """A restarted (or lone-started) arbiter of two leads after takeover_s of silence, but
    the other may lead too (cut off, not dead): no answer without its acknowledgement."""
    a = Arbiter(PAPER, rank=0, arbiters=2, lease=LEASE)
    a.start(0.0)
    a.tick(1.1)
    assert a.leading and isinstance(_answer(a, 1, 1, 1.1), w.Refused)
    (beat,) = a.tick(1.4)  # a beat at 1.4; rank 1 acknowledges it (and one from the future: ignored)
    assert w.decode_between(beat.data).sent == 1.4
    a.on_arbiter(1, w.encode(w.Beat(1, False, False, 1.41, 9.0, a.epoch)), 1.41)
    assert isinstance(_answer(a, 1, 2, 1.41), w.Refused)
    a.on_arbiter(1, w.encode(w.Beat(1, False, False, 1.41, 1.4, a.epoch + 2)), 1.41)  # another epoch's
    assert isinstance(_answer(a, 1, 3, 1.41), w.Refused)
    a.on_arbiter(1, w.encode(w.Beat(1, False, False, 1.41, 1.4, a.epoch)), 1.41)
    assert isinstance(_answer(a, 1, 4, 1.42), w.Grant)
    assert isinstance(_answer(a, 1, 5, 1.4 + a.lease_s + 0.01), w.Refused)  # that acknowledgement has run out


def test_registering_old_leases_after_a_takeover_keeps_free_paths_and_refuses_clashes() -> None:
    p = _Pair()
    p.run(1.5)
    p.up[0] = False
    p.run(3.0)
    new = p.a[1]
    old = new.epoch - 1  # an epoch of rank 0 before: flows this table never held
    mine = w.Held((0, old << SEQ_SHIFT | 5), 8, 4791, 2, 10**8, False, 0.8)
    theirs = w.Held((1, old << SEQ_SHIFT | 6), 9, 4791, 2, 10**8, False, 0.8)
    reply = w.decode_to_host(new.on_host(0, w.encode(w.Register(1, new.epoch, [mine])), p.now)[0].data)
    assert isinstance(reply, w.Grant) and reply.parts[0].path == 2 and reply.parts[0].flow == mine.flow
    clash = w.decode_to_host(new.on_host(1, w.encode(w.Register(2, new.epoch, [theirs])), p.now)[0].data)
    # Its port leads over path 2, which is taken: never moved to another path, plain ECMP.
    assert isinstance(clash, w.Grant) and not clash.parts[0].reserved and clash.parts[0].why == "no free path"
    forged = w.Held((0, new.epoch << SEQ_SHIFT | 99), 8, 4791, 3, 10**8, False, 0.8)  # this epoch's id, never granted
    bad = w.decode_to_host(new.on_host(0, w.encode(w.Register(3, new.epoch, [forged])), p.now)[0].data)
    assert isinstance(bad, w.Grant) and not bad.parts[0].reserved and bad.parts[0].why == "unknown"
    assert new.table.exclusive_conflicts() == []


def test_a_follower_that_misses_changes_fetches_the_whole_table_again() -> None:
    p = _Pair()
    p.run(1.5)
    p.up[1] = False
    p.ask(0, 0, 1)  # lost on the way to the follower
    p.up[1] = True
    p.ask(0, 1, 2)  # the follower sees a gap
    assert p.a[1].counters.gaps == 1 and p.a[1].synced
    assert p.a[1].table.table() == p.a[0].table.table() and len(p.a[1].table.table()) == 2


@pytest.mark.parametrize("policy", ["ark", "ark-balance", "ark-split"])
def test_random_load_never_puts_two_exclusive_holders_on_a_link(policy: str) -> None:
    rng = random.Random(7)
    a = _arbiter(policy)
    held: list[tuple[int, tuple[int, int]]] = []
    now = 0.0
    for rid in range(2000):
        now += rng.expovariate(200.0)
        host = rng.randrange(16)
        if held and rng.random() < 0.45:
            h, f = held.pop(rng.randrange(len(held)))
            a.on_host(h, w.encode(w.Drop(rid, 0, [f])), now)
        else:
            dst = rng.choice([d for d in range(16) if d // 8 != host // 8])
            g = _ask(a, host, rid, dst=dst, nbytes=rng.randrange(10**9), now=now, parts=rng.choice([1, 1, 2, 3]))
            held += [(host, p.flow) for p in g.parts if p.reserved]
        a.tick(now)
        assert _exclusive_clashes(a) == []
    if policy == "ark":
        assert a.table.exclusive_conflicts() == []


def _exclusive_clashes(a: Arbiter) -> list[int]:
    """Links held by two reservations that both claim them alone (shared ones may overlap)."""
    alone: dict[int, int] = {}
    for f, (path, shared) in a.table.table().items():
        if not shared:
            for lk in a.table.links(a.table.get(f).msg, path):  # type: ignore[union-attr]
                alone[lk] = alone.get(lk, 0) + 1
    return sorted(lk for lk, n in alone.items() if n > 1)


def test_bad_construction_is_refused_in_one_line() -> None:
    with pytest.raises(CoreError, match="rank"):
        Arbiter(PAPER, rank=2, arbiters=2)
    with pytest.raises(CoreError, match="takeover_s"):
        Arbiter(PAPER, heartbeat_s=1.0, takeover_s=0.5)
    with pytest.raises(CoreError, match="clock_drift"):
        Arbiter(PAPER, clock_drift=float("nan"))
    with pytest.raises(CoreError, match="lease_margin_s"):
        Arbiter(PAPER, heartbeat_s=0.25, takeover_s=1.0, lease_margin_s=0.8)
    with pytest.raises(CoreError, match="rate_per_host"):
        ArbiterLimits(rate_per_host=float("nan"))


def test_every_message_kind_takes_tokens_by_its_parts_or_flows() -> None:
    a = _arbiter("ark-balance", limits=ArbiterLimits(rate_per_host=40.0, burst_per_host=32))
    flows = [p.flow for p in _ask(a, 0, 1, parts=16).parts]  # 16 tokens of 32
    assert all(p.reserved for p in _ask(a, 0, 2, parts=16).parts)  # 32
    assert not any(p.reserved for p in _ask(a, 0, 3, parts=16).parts)  # 16 more: beyond
    a.on_host(0, w.encode(w.Extend(4, 0, flows)), 0.5)  # 20 tokens back, 16 taken: renewed
    renewed = a.counters.renewed
    assert renewed == 16
    ext = w.decode_to_host(a.on_host(0, w.encode(w.Extend(5, 0, flows)), 0.5)[0].data)
    assert isinstance(ext, w.Extended) and all(s > 0 for s in ext.lease_s)  # beyond: leases as they stand
    assert a.counters.renewed == renewed and a.counters.rate_limited == 2
    assert all(p.reserved for p in _ask(a, 0, 6, parts=4, now=0.5).parts)  # the last 4 tokens
    assert a.on_host(0, w.encode(w.Ping(7, 0)), 0.5) == []  # a ping beyond the tokens: unanswered
    assert a.on_host(0, w.encode(w.Ask(1, 0, 8, 10**8, 4791, 16)), 0.5) == []  # so is a retry
    a.on_host(0, w.encode(w.Drop(8, 0, flows)), 0.5)  # beyond, yet released: a release only frees
    assert a.counters.released == 16 and a.counters.rate_limited == 5
    assert a.on_host(1, w.encode(w.Ping(1, 0)), 0.5) != []  # another host's tokens are its own


def test_a_forged_epoch_from_the_other_arbiter_is_refused_and_no_epoch_left_means_following() -> None:
    a = Arbiter(PAPER, rank=0, arbiters=2, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5,
                limits=ArbiterLimits(max_epoch_jump=100))
    a.start(0.0)
    a.tick(0.6)
    assert a.leading and a.epoch == 2
    assert a.on_arbiter(1, w.encode(w.Beat((1 << 30) - 1, True, True)), 0.7) == []
    assert a.leading and a.counters.epoch_jumps == 1 and a.seen_epoch == 2
    a.on_arbiter(1, w.encode(w.Beat(101, True, True)), 0.8)  # within the bound: a real leader's, followed
    assert not a.leading and a.seen_epoch == 101
    b = Arbiter(PAPER, rank=0, arbiters=2, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5, seen_epoch=(1 << 30) - 1)
    b.start(0.0)
    for t in (0.6, 1.2, 1.8):  # it would lead, but no epoch is left: it follows, counted, and never raises
        b.tick(t)
        assert not b.leading
    assert b.counters.epoch_exhausted >= 2 and b.next_deadline() > 1.8


def test_a_links_backlog_kept_as_holders_come_and_go_equals_folding_them_all_again() -> None:
    # Asks only: the running fold, exactly. Releases too: the tree of the fold's steps, to rounding.
    from ark.core.table import backlog

    a = _arbiter("ark-balance")
    rng = random.Random(3)
    live: list[tuple[int, int]] = []
    now, folds = 0.0, 0
    for rid in range(1, 400):
        now += rng.random() * 0.01
        if live and rng.random() < 0.3:
            f = live.pop(rng.randrange(len(live)))
            a.on_host(f[0], w.encode(w.Drop(rid, 0, [f])), now)
        else:
            host = rng.randrange(8)
            g = w.decode_to_host(a.on_host(host, w.encode(w.Ask(rid, 0, 8 + rng.randrange(8), rng.randrange(1, 10**9),
                                                                    4791, rng.randrange(1, 5))), now)[0].data)
            assert isinstance(g, w.Grant)
            live += [p.flow for p in g.parts if p.reserved]
        folds += bool(a.table._backlog)
        for lk in list(a.table._holders)[:6]:
            want = backlog([a.table.get(f).msg for f in a.table.holders(lk)], now)  # type: ignore[union-attr]
            assert a.table.link_backlog(lk, now) == pytest.approx(want, rel=1e-9, abs=1e-3)
    assert a.table._trees and folds  # both ways were taken


def test_every_message_costs_a_token_before_any_work_and_beyond_them_no_decision_is_made() -> None:
    a = _arbiter(limits=ArbiterLimits(rate_per_host=10.0, burst_per_host=4))
    # A Drop of a flow the host does not hold and a Register whose leases are all unknown cost tokens.
    assert a.on_host(0, w.encode(w.Drop(1, 0, [(0, 5 << 32 | 1)])), 0.0) != []
    unknown = [w.Held((0, 99 << 32 | k), 8, 4791, 0, 10**6, False, 1.0) for k in range(3)]  # ids of a later epoch
    reg = w.decode_to_host(a.on_host(0, w.encode(w.Register(2, 0, unknown)), 0.0)[0].data)
    assert isinstance(reg, w.Grant) and [p.why for p in reg.parts] == ["unknown"] * 3
    assert a.on_host(0, w.encode(w.Ping(3, 0)), 0.0) == []  # 1 + 3 tokens spent: unanswered
    # A rate-limited Ask: a Grant with no parts, no decision made, no flow id drawn.
    n, flows = a._n, len(a.table.table())
    assert _ask(a, 0, 4, parts=16).parts == [] and a._n == n and len(a.table.table()) == flows
    assert a.counters.asks == 0 and a.counters.rate_limited == 2


def test_a_drop_handles_only_the_flows_its_host_holds() -> None:
    a = _arbiter(limits=ArbiterLimits(rate_per_host=10.0, burst_per_host=8))
    held = _ask(a, 0, 1).parts[0].flow
    other = _ask(a, 1, 1, dst=12).parts[0].flow
    looked: list[object] = []
    get = a.table.get
    a.table.get = lambda f: looked.append(f) or get(f)  # type: ignore[method-assign]
    bogus = [(0, 7 << 32 | k) for k in range(w.MAX_FLOWS_PER_MESSAGE - 2)]
    a.on_host(0, w.encode(w.Drop(2, 0, [*bogus, other, held])), 0.1)  # beyond the tokens too
    assert looked == [held] and a.table.get(held).released is not None  # type: ignore[union-attr]
    assert a.table.get(other).released is None  # type: ignore[union-attr]
    assert a.counters.released == 1 and a.counters.unknown == len(bogus) and a.counters.foreign == 1
