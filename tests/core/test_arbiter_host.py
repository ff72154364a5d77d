"""A host's side of the arbiter protocol (ArbiterLink) against the real arbiter core, and
the node's bookkeeping of flows an arbiter placed."""

from __future__ import annotations

import math

import pytest

from ark.core import arbiter_wire as w
from ark.core.arbiter import Arbiter, ArbiterOut
from ark.core.arbiter_host import NO_ARBITER, ArbiterLink, LinkOut
from ark.core.lease import LeasePolicy
from ark.core.node import Node
from ark.core.pathmap import PathMapCache
from ark.core.table import CoreError
from ark.core.topology import preset

PAPER = preset("paper")  # hosts 0-7 on leaf 0, 8-15 on leaf 1, 4 spines
LEASE = LeasePolicy(1.0, 2.0, 60.0)


class _Wire:
    """Arbiters and one host's link, with the bytes moved by hand; ``dead`` arbiters drop all."""

    def __init__(self, arbiters: int = 2, host: int = 0, held: object = None) -> None:
        self.arbs = [Arbiter(PAPER, rank=r, arbiters=arbiters, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5)
                     for r in range(arbiters)]
        self.host = host
        self.link = ArbiterLink(arbiters, timeout_s=0.05, probe_s=0.1, forget_epoch_s=5.0,
                                held=held)  # type: ignore[arg-type]
        self.dead: set[int] = set()
        self.now = 0.0
        self._between([o for a in self.arbs for o in a.start(0.0)])

    def _between(self, outs: list[ArbiterOut]) -> None:
        while outs:
            o = outs.pop(0)
            if o.arbiter >= 0 and o.arbiter not in self.dead:
                src = next(a.rank for a in self.arbs if w.decode_between(o.data).epoch % len(self.arbs) == a.rank)
                outs += self.arbs[o.arbiter].on_arbiter(src, o.data, self.now)

    def to_arbiters(self, outs: list[LinkOut]) -> None:
        """Deliver the link's bytes; the answers go straight back to the link."""
        while outs:
            o = outs.pop(0)
            if o.rank in self.dead:
                continue
            for r in self.arbs[o.rank].on_host(self.host, o.data, self.now):
                outs += self.link.on_arbiter(o.rank, r.data, self.now)
            self._between(self.arbs[o.rank].flush())

    def run_until(self, t: float, step: float = 0.01) -> None:
        while self.now < t:
            self.now = round(self.now + step, 6)
            for a in self.arbs:
                if a.rank not in self.dead:
                    self._between(a.tick(self.now))
            self.to_arbiters(self.link.tick(self.now))


def test_a_request_goes_to_the_leader_and_comes_back_granted() -> None:
    net = _Wire()
    net.run_until(0.6)  # rank 0 leads after takeover_s at a cold start
    assert net.arbs[0].leading and not net.arbs[1].leading
    net.to_arbiters(net.link.ask("t1", 8, 10**9, 4791, 2, net.now))
    (done,) = net.link.take_done()
    assert done.tag == "t1" and isinstance(done.answer, w.Grant)
    assert [p.reserved for p in done.answer.parts] == [True, True]
    assert len({p.path for p in done.answer.parts}) == 2  # the parts of one lease on distinct paths
    assert net.link.epoch == net.arbs[0].epoch and net.link.up


def test_a_refused_request_is_sent_on_to_the_leader_the_refusal_names() -> None:
    net = _Wire()
    net.run_until(0.6)
    net.link.leader = 1  # as if the host had been talking to the standby
    net.to_arbiters(net.link.ask("t", 8, 10**9, 4791, 1, net.now))
    (done,) = net.link.take_done()
    assert isinstance(done.answer, w.Grant) and done.answer.parts[0].reserved
    assert net.link.counters.refused == 1 and net.link.counters.redirected == 1 and net.link.leader == 0


def test_no_arbiter_answering_means_ecmp_at_once_until_one_leads_again_then_leases_are_registered() -> None:
    held: list[w.Held] = []
    net = _Wire(held=lambda now: list(held))
    net.run_until(0.6)
    net.to_arbiters(net.link.ask("a", 8, 10**11, 4791, 1, net.now))  # a lease of 16 s: it outlives the takeover
    (grant,) = net.link.take_done()
    part = grant.answer.parts[0]  # type: ignore[union-attr]
    held.append(w.Held(part.flow, 8, 4791, part.path, 10**11, part.shared, part.lease_s))
    net.to_arbiters(net.link.ask("a2", 9, 10**11, 4791, 1, net.now))
    (grant2,) = net.link.take_done()
    net.dead.add(0)  # the primary dies
    t_dead = net.now
    net.to_arbiters(net.link.drop([grant2.answer.parts[0].flow], net.now))  # type: ignore[union-attr]
    net.to_arbiters(net.link.ask("b", 8, 10**9, 4791, 1, net.now))
    assert net.link.take_done() == []  # waiting: the standby refuses (it does not lead yet), then nobody
    net.run_until(net.now + 0.12)
    (b,) = net.link.take_done()
    assert b.tag == "b" and b.answer is None and not net.link.up
    net.to_arbiters(net.link.ask("c", 8, 10**9, 4791, 1, net.now))
    (c,) = net.link.take_done()
    assert c.answer is None  # down: answered at once, no wait
    net.run_until(t_dead + 1.5)  # the standby leads after takeover_s (+ two beats for rank 1); a probe finds it
    assert net.arbs[1].leading and net.link.up and net.link.leader == 1
    assert net.link.counters.registered == 1
    assert part.flow in net.arbs[1].table.table()  # followed, and registered: the standby holds it
    (reg,) = net.link.take_done()
    released = net.arbs[1].table.get(grant2.answer.parts[0].flow)  # type: ignore[union-attr]
    assert released is not None and released.released is not None  # the release no arbiter took, told to the next
    assert reg.tag == ("register", (part.flow,)) and isinstance(reg.answer, w.Grant)
    kept = reg.answer.parts[0]
    assert kept.flow == part.flow and kept.reserved and kept.path == part.path
    net.to_arbiters(net.link.ask("d", 8, 10**9, 4791, 1, net.now))
    (d,) = net.link.take_done()
    assert isinstance(d.answer, w.Grant) and d.answer.parts[0].reserved
    assert d.answer.parts[0].path != part.path  # the registered lease still holds its path
    assert 0.5 < net.link.status(net.now)["down_s"] < 1.5  # type: ignore[operator]


def test_an_answer_of_an_older_epoch_is_refused_until_that_epoch_is_forgotten() -> None:
    link = ArbiterLink(2, timeout_s=0.05, forget_epoch_s=5.0)
    link.on_arbiter(1, w.encode(w.Pong(99, 7)), 0.0)  # an answer of epoch 7 (unasked: counted only)
    assert link.epoch == 7
    link.ask("x", 8, 1, 4791, 1, 1.0)
    rid = link._rid
    link.on_arbiter(0, w.encode(w.Grant(rid, 4, [])), 1.0)  # the old leader, epoch 4: dropped
    assert link.take_done() == [] and link.counters.stale_epoch == 1
    link.on_arbiter(0, w.encode(w.Grant(rid, 4, [])), 6.5)  # nothing of epoch 7 heard for 5 s: both restarted
    (done,) = link.take_done()
    assert done.tag == "x" and link.epoch == 4 and link.counters.epoch_forgotten == 1


def test_the_link_checks_what_it_is_given_and_counts_garbage() -> None:
    with pytest.raises(CoreError, match="arbiters"):
        ArbiterLink(0)
    with pytest.raises(CoreError, match="timeout_s"):
        ArbiterLink(1, timeout_s=math.nan)
    link = ArbiterLink(1)
    with pytest.raises(CoreError, match="flows"):
        link.extend("t", [(0, i) for i in range(w.MAX_FLOWS_PER_MESSAGE + 1)], 0.0)
    for junk in (b"", b"\xff" * 10, w.encode(w.Ask(1, 0, 1, 1, 1))):  # an Ask is not an answer
        assert link.on_arbiter(0, junk, 0.0) == []
    assert link.on_arbiter(5, w.encode(w.Pong(1, 0)), 0.0) == []  # no such arbiter
    assert link.counters.invalid == 4
    link.on_arbiter(0, w.encode(w.Pong(12345, 0)), 0.0)  # answers nothing in flight
    assert link.counters.unknown_rid == 1


# ---------------------------------------------------------------------- the node's side
def _node(host: int = 0) -> Node:
    node = Node(host, PAPER, PathMapCache(PAPER), [], incarnation=1, lease=LEASE)
    node.start(0.0)
    return node


def test_a_placed_flow_takes_a_port_of_the_granted_path_and_the_arbiters_lease() -> None:
    node = _node()
    maps = PathMapCache(PAPER)(0, 8, 4791)
    lease = node.place((0, 5 << 32 | 1), 8, 10**9, 1.0, 4791, 2, lease_s=3.0)
    assert lease.reserved and lease.path == 2 and maps.path_of(lease.src_port) == 2
    assert lease.expires == pytest.approx(4.0) and lease.flow_id == (0, 5 << 32 | 1)
    more = node.more_ports(lease.flow_id, 3)
    assert len(more) == 3 and all(maps.path_of(p) == 2 for p in more)
    assert node.extend_to(lease.flow_id, 10.0, 2.0).expires == pytest.approx(12.0)
    gone = node.unreserve(lease.flow_id, "not held by the arbiter", 3.0)
    assert not gone.reserved and gone.fallback == "not held by the arbiter" and gone.src_port == lease.src_port
    ecmp = node.place((0, 5 << 32 | 2), 8, 10**9, 1.0, 4791, None, why="no free path")
    assert not ecmp.reserved and ecmp.fallback == "no free path"
    assert [f for f, *_ in node.reserved_leases(3.0)] == []
    with pytest.raises(CoreError, match="already a local flow"):
        node.place((0, 5 << 32 | 2), 8, 1, 1.0, 4791, 1)
    with pytest.raises(CoreError, match="not this host's"):
        node.place((3, 5 << 32 | 3), 8, 1, 1.0, 4791, 1)
    with pytest.raises(CoreError, match="path"):
        node.place((0, 5 << 32 | 4), 8, 1, 1.0, 4791, 9)
    fallback, _ = node.reserve(8, 10, 1.0, 4791, unreserved=NO_ARBITER)
    assert not fallback.reserved and fallback.fallback == NO_ARBITER


def test_a_placed_flow_within_a_leaf_takes_path_zeros_next_port_as_a_request_would() -> None:
    # Hosts 0 and 1 share a leaf: one path, nothing reserved, not a fallback, and the same
    # round-robin port a broadcast core would pick (not a random one).
    placed, requested = _node(), _node()
    for k in range(3):
        a = placed.place((0, 5 << 32 | k), 1, 10**9, 1.0, 4791, None, why="same leaf")
        b, _ = requested.reserve(1, 10**9, 1.0, 4791)
        assert (a.path, a.src_port, a.reserved, a.fallback) == (b.path, b.src_port, b.reserved, b.fallback)
        assert a.fallback == "same leaf" and not a.reserved
    assert placed.core.counters.fallbacks == 0


# ---------------------------------------------------------------------- fixed bugs, pinned
def test_request_ids_start_at_the_incarnation_so_a_restart_never_reuses_one() -> None:
    before = ArbiterLink(1, incarnation=7)
    before.ask("x", 8, 1, 4791, 1, 0.0)
    after = ArbiterLink(1, incarnation=8)  # the same host, restarted
    after.ask("y", 8, 1, 4791, 1, 0.0)
    assert before._rid == 7 << 32 | 1 and after._rid == 8 << 32 | 1
    with pytest.raises(CoreError, match=r"incarnation: must be 0\.\.1073741823; got 1073741824"):
        ArbiterLink(1, incarnation=1 << 30)


def test_a_timeout_fires_at_the_deadline_the_link_gives() -> None:
    """sent_at + timeout_s - sent_at can be below timeout_s in floats: the timer must not spin."""
    sent, timeout = 0.7, 0.1
    assert (sent + timeout) - sent < timeout  # the rounding this guards against
    link = ArbiterLink(2, timeout_s=timeout)
    outs = link.ask("x", 8, 1, 4791, 1, sent)
    assert outs[0].rank == 0
    again = link.tick(link.next_deadline())
    assert [o.rank for o in again] == [1] and link.counters.timeouts == 1


def test_a_lease_is_counted_from_when_the_request_was_first_sent() -> None:
    net = _Wire()
    net.run_until(0.6)
    asked = net.now
    outs = net.link.ask("late", 8, 10**9, 4791, 1, asked)
    net.now = asked + 0.04  # the request reaches the arbiter late; its lease begins there
    net.to_arbiters(outs)
    (done,) = net.link.take_done()
    assert done.asked_at == asked and isinstance(done.answer, w.Grant)
    part = done.answer.parts[0]
    assert done.left(part.lease_s, asked + 0.3) == pytest.approx(part.lease_s - 0.3)
    assert done.left(part.lease_s, asked + 1e6) == 0.0


def test_a_granted_path_is_pinned_on_the_host_whatever_its_own_table_holds() -> None:
    """An earlier leader's flow on path 1 (the new leader never heard of it) and a new grant
    of path 1: the node keeps both there; its own table never decides a grant again."""
    node = _node()
    old = node.place((0, 2 << 32 | 1), 8, 10**9, 1.0, 4791, 1, lease_s=30.0)
    new = node.place((0, 5 << 32 | 1), 8, 10**9, 2.0, 4791, 1, lease_s=30.0)
    assert old.reserved and new.reserved and old.path == new.path == 1
    node.tick(3.0)
    assert {f: path for f, _, _, path, *_ in node.reserved_leases(3.0)} == {old.flow_id: 1, new.flow_id: 1}
    assert node.lease_of(new.flow_id, 3.0).path == 1 and PathMapCache(PAPER)(0, 8, 4791).path_of(
        node.lease_of(new.flow_id, 3.0).src_port) == 1


def test_a_restarted_standby_follows_a_live_leader_of_a_lower_rank() -> None:
    """Rank 0 leads epoch 2 (generation 1); the standby restarts having heard of epoch 2: its
    own epoch of that generation (3) is higher, yet it follows rank 0 and takes its table."""
    net = _Wire()
    net.run_until(0.6)
    net.to_arbiters(net.link.ask("a", 8, 10**11, 4791, 1, net.now))
    (grant,) = net.link.take_done()
    lead = net.arbs[0]
    assert lead.leading and lead.epoch == 2 and net.arbs[1].seen_epoch == 2
    net.arbs[1] = Arbiter(PAPER, rank=1, arbiters=2, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5,
                          seen_epoch=net.arbs[1].seen_epoch)
    net._between(net.arbs[1].start(net.now))
    net.run_until(net.now + 2.0)
    assert lead.leading and lead.epoch == 2 and not net.arbs[1].leading and net.arbs[1].synced
    assert grant.answer.parts[0].flow in net.arbs[1].table.table()  # type: ignore[union-attr]


def test_a_follower_asks_for_the_table_again_when_its_ask_was_lost() -> None:
    lead = Arbiter(PAPER, rank=0, arbiters=2, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5)
    follower = Arbiter(PAPER, rank=1, arbiters=2, lease=LEASE, heartbeat_s=0.1, takeover_s=0.5)
    lead.start(0.0)
    follower.start(0.0)
    lead.tick(0.6)
    assert lead.leading
    beat = w.encode(w.Beat(lead.epoch, True, True))
    def asks(outs: list[ArbiterOut]) -> list[ArbiterOut]:  # leaving out the beats acknowledging the leader's
        return [o for o in outs if not isinstance(w.decode_between(o.data), w.Beat)]

    first = asks(follower.on_arbiter(0, beat, 0.6))
    assert [w.decode_between(o.data) for o in first] == [w.SyncAsk(follower.epoch)]  # lost on the way
    assert asks(follower.on_arbiter(0, beat, 0.7)) == []  # asked already: waits a while
    again = asks(follower.on_arbiter(0, beat, 0.81))  # two beats later: asks again
    assert [type(w.decode_between(o.data)) for o in again] == [w.SyncAsk]
    for o in lead.on_arbiter(1, again[0].data, 0.81):
        follower.on_arbiter(0, o.data, 0.81)
    assert follower.synced and not follower._syncing


def test_a_release_the_dead_leader_never_passed_on_is_told_to_the_new_leader() -> None:
    """The primary acknowledges a Drop and dies before its follower hears it: without the
    host telling the standby again, the path stays held there until the lease ends."""
    held: list[w.Held] = []
    net = _Wire(held=lambda now: list(held))
    net.run_until(0.6)
    net.to_arbiters(net.link.ask("a", 8, 10**11, 4791, 1, net.now))  # a 16 s lease
    (grant,) = net.link.take_done()
    flow = grant.answer.parts[0].flow  # type: ignore[union-attr]
    assert flow in net.arbs[1].table.table()  # the follower has it
    for o in net.link.drop([flow], net.now):  # answered by the primary, whose Changes never leave
        for r in net.arbs[0].on_host(0, o.data, net.now):
            net.link.on_arbiter(0, r.data, net.now)
    assert net.arbs[0].table.get(flow).released is not None  # type: ignore[union-attr]
    net.dead.add(0)
    assert net.arbs[1].table.get(flow).released is None  # type: ignore[union-attr]
    net.to_arbiters(net.link.ask("b", 9, 10**9, 4791, 1, net.now))  # finds no leader: the host goes down
    net.run_until(net.now + 2.0)  # the standby leads; the host finds it and registers
    assert net.arbs[1].leading and net.link.up
    assert net.arbs[1].table.get(flow).released is not None  # type: ignore[union-attr]


def test_a_release_made_while_no_arbiter_answers_reaches_the_leader_found_next() -> None:
    """The link is down (a partition); the same leader answers again afterwards, in the same
    epoch: the release made meanwhile still reaches it."""
    net = _Wire()
    net.run_until(0.6)
    net.to_arbiters(net.link.ask("a", 8, 10**11, 4791, 1, net.now))
    (grant,) = net.link.take_done()
    flow = grant.answer.parts[0].flow  # type: ignore[union-attr]
    net.dead.update({0, 1})  # cut from both
    net.to_arbiters(net.link.ask("b", 9, 10**9, 4791, 1, net.now))
    net.run_until(net.now + 0.12)
    assert not net.link.up
    net.to_arbiters(net.link.drop([flow], net.now))  # down: nothing goes out now
    assert net.arbs[0].table.get(flow).released is None  # type: ignore[union-attr]
    net.dead.clear()  # healed before any takeover: the same leader, the same epoch
    net.run_until(net.now + 0.3)
    assert net.link.up and net.link.epoch == net.arbs[0].epoch
    assert net.arbs[0].table.get(flow).released is not None  # type: ignore[union-attr]


def test_a_grant_of_more_parts_than_asked_or_a_forged_epoch_is_refused_and_counted() -> None:
    link = ArbiterLink(2, timeout_s=0.05, max_epoch_jump=1000)
    link.on_arbiter(0, w.encode(w.Pong(99, 4)), 0.0)  # epoch 4 heard
    out = link.ask("x", 8, 10**6, 4791, 1, 0.0)
    rid = link._rid
    part = w.Part((0, 4 << 32 | 1), 0, True, False, 10.0)
    assert out[0].rank == 0
    again = link.on_arbiter(0, w.encode(w.Grant(rid, 4, [part] * 2)), 0.0)  # two parts for one
    assert link.counters.misfits == 1 and link.take_done() == [] and again[0].rank == 1  # asked of the next
    link.on_arbiter(1, w.encode(w.Grant(rid, 4 + 1001, [part])), 0.0)  # far above every epoch heard
    assert link.counters.epoch_jumps == 1 and link.epoch == 4 and link.take_done() == []
    link.on_arbiter(1, w.encode(w.Dropped(rid, 5)), 0.0)  # another kind of answer
    assert link.counters.misfits == 2 and link.epoch == 4
    (unanswered,) = link.take_done()  # every arbiter tried: plain ECMP, and the link is down
    assert unanswered.answer is None and not link.up
    link.on_arbiter(1, w.encode(w.Pong(12345, 5)), 0.05)  # the next leader answers: up again
    link.ask("y", 8, 10**6, 4791, 1, 0.1)
    link.on_arbiter(link.leader, w.encode(w.Grant(link._rid, 5, [part])), 0.1)  # the next leader's: taken
    (done,) = link.take_done()
    assert done.tag == "y" and link.epoch == 5


def test_a_late_answer_from_an_arbiter_asked_earlier_is_checked_for_fit_too() -> None:
    """The request moved on to arbiter 1; arbiter 0's late grant for it, with more parts
    than were asked, is a misfit like any other: dropped, counted, the request still waits
    on arbiter 1 (not asked again), whose fitting grant is then taken."""
    link = ArbiterLink(2, timeout_s=0.05)
    link.on_arbiter(0, w.encode(w.Pong(99, 4)), 0.0)
    link.ask("x", 8, 10**6, 4791, 1, 0.0)
    rid = link._rid
    part = w.Part((0, 4 << 32 | 1), 0, True, False, 10.0)
    moved = link.on_arbiter(0, w.encode(w.Dropped(rid, 4)), 0.0)  # a misfit: asked of arbiter 1
    assert [o.rank for o in moved] == [1] and link.counters.misfits == 1
    late = link.on_arbiter(0, w.encode(w.Grant(rid, 4, [part] * 64)), 0.01)  # arbiter 0, late, 64 parts for 1
    assert late == [] and link.counters.misfits == 2 and link.take_done() == []
    assert link.counters.answered == 0 and rid in link._pending
    link.on_arbiter(1, w.encode(w.Grant(rid, 4, [part])), 0.02)
    (done,) = link.take_done()
    assert done.tag == "x" and len(done.answer.parts) == 1  # type: ignore[union-attr]
