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
