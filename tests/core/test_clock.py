"""Clock offsets from heartbeats: a host whose clock is off stops reserving; others do not."""

from __future__ import annotations

import math

import pytest

from ark.core.clock import ClockWatch
from ark.core.lease import LeasePolicy
from ark.core.messages import Release, Reserve
from ark.core.node import Node, NodeLimits, Publish
from ark.core.pathmap import PathMapCache
from ark.core.table import ReservationTable
from ark.core.topology import preset
from tests.liars import shift_clock

FAB = preset("paper")
MAPS = PathMapCache(FAB)
HOSTS = [0, 1, 8, 9]
HB = 0.1


class SkewedNet:
    """Instant delivery; each host reads its own clock (true time + offset)."""

    def __init__(self, offsets: dict[int, float], hosts: list[int] = HOSTS) -> None:
        self.offsets = offsets
        self.nodes = {h: Node(h, FAB, MAPS, [p for p in hosts if p != h], incarnation=1, heartbeat_s=HB,
                              peer_timeout_s=0.5, lease=LeasePolicy(1.0, 2.0), limits=NodeLimits(max_clock_offset_s=0.1))
                      for h in hosts}
        self.t = 10.0

    def clock(self, h: int) -> float:
        return self.t + self.offsets.get(h, 0.0)

    def emit(self, src: int, outs) -> None:
        queue = [(src, o) for o in outs]
        while queue:
            s, o = queue.pop(0)
            for d in ([h for h in self.nodes if h != s] if isinstance(o, Publish) else [o.peer]):
                queue.extend((d, r) for r in self.nodes[d].on_message(s, o.data, self.clock(d)))

    def run(self, seconds: float, step: float = 0.01) -> None:
        end = self.t + seconds
        while self.t < end:
            for h, n in self.nodes.items():
                self.emit(h, n.tick(self.clock(h)))
            self.t += step


def started(offsets: dict[int, float], hosts: list[int] = HOSTS) -> SkewedNet:
    net = SkewedNet(offsets, hosts)
    for h, n in net.nodes.items():
        net.emit(h, n.start(net.clock(h)))
    return net


# Beyond the timestamp window too (30 s, an hour): every message of such a host is out of
# window, yet its heartbeats still carry the clock sample that fences it.
@pytest.mark.parametrize("offset", [0.5, -0.5, 30.0, -30.0, 3600.0])
def test_a_host_off_by_more_than_the_bound_stops_reserving_within_two_heartbeats(offset: float) -> None:
    net = started({8: offset})
    net.run(2 * HB + 0.02)
    skewed = net.nodes[8]
    assert skewed.skewed and all(not n.skewed for h, n in net.nodes.items() if h != 8)
    st = skewed.status(net.clock(8))
    assert st["clock"]["skewed"] and st["clock"]["offset_s"] == pytest.approx(offset, abs=0.02)
    lease, outs = skewed.reserve(0, 10**9, net.clock(8))
    assert not lease.reserved and outs == [] and skewed.counters.fenced_requests == 1
    # The others go on reserving, and see the offset in their own status.
    lease, outs = net.nodes[1].reserve(9, 10**9, net.clock(1))
    assert lease.reserved and outs
    assert net.nodes[1].status(net.clock(1))["peers"]["8"]["clock_offset_s"] == pytest.approx(-offset, abs=0.02)


def test_a_host_that_turns_skewed_gives_up_what_it_holds_and_recovers() -> None:
    net = started({})
    net.run(0.3)
    lease, outs = net.nodes[8].reserve(0, 10**9, net.clock(8))
    net.emit(8, outs)
    assert lease.reserved and lease.flow_id in net.nodes[0].core.table()
    net.offsets[8] = 0.8  # its clock steps
    net.run(2 * HB + 0.02)
    assert net.nodes[8].skewed
    assert lease.flow_id not in net.nodes[0].core.table()  # released everywhere: no stale claim
    assert not net.nodes[8].lease_of(lease.flow_id).reserved
    net.offsets[8] = 0.0
    net.run(0.6)  # its heartbeats prove it right again
    assert not net.nodes[8].skewed
    assert net.nodes[8].reserve(1, 10**9, net.clock(8))[0].reserved


def test_offsets_within_the_bound_change_nothing() -> None:
    net = started({0: 0.04, 8: -0.03})
    net.run(1.0)
    assert not any(n.skewed for n in net.nodes.values())


def test_with_two_hosts_both_stop_when_they_disagree() -> None:
    net = started({8: 0.5}, hosts=[0, 8])
    net.run(0.3)
    assert net.nodes[0].skewed and net.nodes[8].skewed


def _rt(w: ClockWatch, peer: int, own_sent: float, theta: float, delay: float = 0.001) -> None:
    """One full round trip with ``peer`` whose clock reads ``theta`` ahead of ours."""
    w.sent(own_sent)
    t2 = own_sent + delay + theta
    t3 = t2 + 0.05
    w.hello(peer, t3 - theta + delay, t3, [(0, own_sent, t2)], me=0)


def test_round_trips_measure_both_directions_and_one_peer_is_one_vote() -> None:
    w = ClockWatch(bound_s=0.1, fresh_s=1.0)
    for p, theta in ((1, 0.3), (2, 0.3), (3, 0.0)):
        _rt(w, p, 10.0, theta)
    assert w.ahead_of_us() == [1, 2] and w.behind_us() == []
    assert w.offset(1) == pytest.approx(-0.3) and w.offset(3) == pytest.approx(0.0)
    v = w.verdict(10.1)
    assert v is not None and v[0] and "behind 2 of 3" in v[1]
    w = ClockWatch(bound_s=0.1, fresh_s=1.0)
    for p, theta in ((1, -0.3), (2, -0.3), (3, 0.0)):
        _rt(w, p, 10.0, theta)
    v = w.verdict(10.1)
    assert w.behind_us() == [1, 2] and v is not None and v[0] and "ahead of 2 of 3" in v[1]
    assert w.verdict(12.0) is None  # nobody heard recently: no evidence either way


def test_a_heartbeat_alone_proves_only_a_peer_ahead_and_a_bogus_echo_is_ignored() -> None:
    w = ClockWatch(bound_s=0.1, fresh_s=1.0)
    w.hello(1, 10.0, 10.3, [], me=0)  # sent "after" it arrived: ahead, whatever the delay
    w.hello(2, 10.0, 9.7, [], me=0)  # could be delay: proves nothing
    assert w.ahead_of_us() == [1] and w.behind_us() == [] and not w.off(2)
    w.hello(2, 10.1, 9.8, [(0, 123.0, 9.75)], me=0)  # echoes a heartbeat we never sent
    assert w.bad_echoes == 1 and w.behind_us() == []
    w.sent(10.05)
    w.hello(2, 10.2, 9.9, [(0, 10.05, 9.0)], me=0)  # a negative round trip: impossible
    assert w.bad_echoes == 2


def test_a_clock_step_replaces_older_measurements() -> None:
    w = ClockWatch(bound_s=0.1, fresh_s=5.0)
    for k in range(4):
        _rt(w, 1, 10.0 + k * 0.1, 0.0)
    assert not w.off(1)
    _rt(w, 1, 11.0, -0.8)  # its clock stepped back
    assert w.behind_us() == [1] and w.offset(1) == pytest.approx(0.8)


class LyingNet(SkewedNet):
    """Listed peers in ``liars`` shift the clock they show one destination: each HELLO's
    ``sent_at`` and echoed arrival times to ``dst`` read ``shift`` off (``lies[(liar, dst)]``)."""

    def __init__(self, offsets: dict[int, float], hosts: list[int], lies: dict[tuple[int, int], float]) -> None:
        super().__init__(offsets, hosts)
        self.lies = lies

    def emit(self, src: int, outs) -> None:
        queue = [(src, o) for o in outs]
        while queue:
            s, o = queue.pop(0)
            for d in ([h for h in self.nodes if h != s] if isinstance(o, Publish) else [o.peer]):
                data = shift_clock(o.data, self.lies.get((s, d), 0.0))
                queue.extend((d, r) for r in self.nodes[d].on_message(s, data, self.clock(d)))


def lying(offsets: dict[int, float], hosts: list[int], lies: dict[tuple[int, int], float]) -> LyingNet:
    net = LyingNet(offsets, hosts, lies)
    for h, n in net.nodes.items():
        net.emit(h, n.start(net.clock(h)))
    return net


SIX = [0, 1, 2, 8, 9, 10]


def test_a_liar_vouching_for_a_skewed_host_does_not_keep_it_reserving() -> None:
    # Host 8's clock is 1 s behind; liar 2 shows 8 a clock 1 s behind too.
    net = lying({8: -1.0}, HOSTS + [2], {(2, 8): -1.0})
    net.run(4 * HB)
    assert net.nodes[8].skewed and not any(n.skewed for h, n in net.nodes.items() if h != 8)
    lease, _ = net.nodes[8].reserve(0, 10**9, net.clock(8))
    assert not lease.reserved


def test_a_liar_cannot_get_an_honest_host_fenced() -> None:
    # Liar 2 shows host 1 (only) a clock 1 s ahead, and host 0 one 1 s behind.
    net = lying({}, HOSTS + [2], {(2, 1): 1.0, (2, 0): -1.0})
    net.run(4 * HB)
    assert not any(n.skewed for n in net.nodes.values())
    assert net.nodes[1].status(net.clock(1))["clock"]["ahead_of_us"] == [2]


@pytest.mark.parametrize("skew", [1.0, -1.0])
def test_fewer_than_half_faulty_peers_fence_no_honest_host_and_keep_no_skewed_one(skew: float) -> None:
    # A skewed host is as much against its peers as a liar: for every honest host here,
    # liar 2 and skewed host 9 together are two of five peers. 2 vouches for 9 and shows
    # honest hosts 0 and 1 a clock off the same way as 9's.
    lies = {(2, 9): skew, (2, 0): skew, (2, 1): skew}
    net = lying({9: skew}, SIX, lies)
    net.run(4 * HB)
    assert [h for h, n in net.nodes.items() if n.skewed] == [9]


def test_two_liars_among_six_hosts_fence_no_honest_host() -> None:
    lies = {(liar, h): 1.0 for liar in (2, 10) for h in (0, 1, 8, 9)}
    net = lying({}, SIX, lies)
    net.run(4 * HB)
    assert not any(n.skewed for n in net.nodes.values())


def test_receivers_refuse_reservations_of_a_host_they_measure_off() -> None:
    # Liars 2 and 9 vouch for skewed host 8: half of 8's peers lie, so 8 goes on reserving
    # (outside the bound), but honest host 0, whose clock most peers back, refuses them.
    net = lying({8: -1.0}, [0, 1, 2, 8, 9], {(2, 8): -1.0, (9, 8): -1.0})
    net.run(4 * HB)
    assert not net.nodes[8].skewed
    lease, outs = net.nodes[8].reserve(1, 10**9, net.clock(8))
    net.emit(8, outs)
    assert lease.reserved and lease.flow_id not in net.nodes[0].core.table()
    assert net.nodes[0].counters.skewed_owner == 1
    # The liars take it; 8 itself judges nobody: most of its peers measure it off.
    assert lease.flow_id in net.nodes[2].core.table() and not net.nodes[8].clock.trusted(net.clock(8))


def test_two_honest_hosts_near_the_bound_on_either_side_refuse_nothing() -> None:
    # 0.07 s behind and 0.07 s ahead: each within the bound of the majority, 0.14 s apart.
    net = started({1: -0.07, 9: 0.07}, hosts=SIX)
    net.run(4 * HB)
    assert net.nodes[1].clock.off(9)  # beyond the bound from each other, yet both honest
    lease, outs = net.nodes[9].reserve(1, 10**9, net.clock(9))
    net.emit(9, outs)
    assert lease.reserved and not any(n.skewed for n in net.nodes.values())
    assert all(lease.flow_id in n.core.table() for n in net.nodes.values())
    assert not any(n.counters.skewed_owner for n in net.nodes.values())


def test_the_fence_holds_in_a_cluster_larger_than_the_echo_rotation() -> None:
    # 150 hosts: each HELLO echoes 16 peers, so a pair closes a round trip about every tenth
    # heartbeat, while heartbeats keep coming in between.
    n, me, off = 150, 0, 1.0
    watches = [ClockWatch(bound_s=0.1, fresh_s=5.0) for _ in range(n)]
    verdicts, trusted = [], []
    for k in range(40):
        t = 10.0 + k * 0.1
        hellos = []
        for h, w in enumerate(watches):
            sent = t + (off if h == me else 0.0)
            hellos.append((h, sent, [tuple(e) for e in w.echoes(sent)]))
            w.sent(sent)
        for h, sent, echoes in hellos:
            for d, w in enumerate(watches):
                if d != h:
                    w.hello(h, t + 0.001 + (off if d == me else 0.0), sent, echoes, d)
        if k >= 25:
            verdicts.append(watches[me].verdict(t + off + 0.01))
            trusted.append(watches[1].trusted(t + 0.01))
    assert all(v is not None and v[0] for v in verdicts) and all(trusted)
    assert watches[1].verdict(t + 0.01) == (False, "") and watches[1].behind_us() == [] and watches[1].ahead_of_us() == [0]


@pytest.mark.parametrize(("offset", "behind"), [(0.05, 0.0), (-0.05, 0.0), (1.0, -1.0), (-1.0, 1.0), (-0.33, 0.3),
                                                (-30.0, 5.0)])
def test_each_host_measures_how_far_a_peer_runs_behind_it_rounded_to_the_bound(offset: float, behind: float) -> None:
    net = started({8: offset})
    net.run(4 * HB)
    assert net.nodes[1].clock.behind(8, cap=5.0) == pytest.approx(behind)
    # The peer measures the same figure the other way round (the round trip is shared).
    assert net.nodes[8].clock.behind(1, cap=5.0) == pytest.approx(-behind)
    assert net.nodes[1].core.behind(8) == pytest.approx(max(-net.nodes[1].window_s, min(net.nodes[1].window_s, behind)))


def _res(owner: int, seq: int, ts: float, expires: float, path: int = 0) -> Reserve:
    return Reserve((owner, seq), ts, owner, 9, 4791, path, 50000 + seq, 10**6, 1e11, expires=expires)


def _tables(*msgs: Reserve) -> tuple[ReservationTable, ReservationTable]:
    """(a replica that measured host 0's clock 1 s behind its own, one that did not)."""
    judged, plain = ReservationTable(FAB, retention_s=30.0), ReservationTable(FAB, retention_s=30.0)
    judged.set_clock(0, 1.0, margin=0.1)
    for t in (judged, plain):
        for m in msgs:
            t.receive(m)
    return judged, plain


def _paths(t: ReservationTable) -> dict[tuple[int, int], int | None]:
    return {f: e[2] for f, e in t.entries().items()}


def test_an_owner_behind_holds_its_path_against_others_until_its_flow_really_ends_and_follows_itself() -> None:
    # Hosts 0 and 1 share leaf 0's uplinks. Host 0's clock runs 1 s behind this replica's:
    # its flow stated to end at 11.0 really ends at 12.0 here (12.1 with the margin).
    a = _res(0, 1, 10.0, 11.0)
    other = _res(1, 1, 11.5, 20.0)  # host 1's next, on path 0
    judged, plain = _tables(a, other)
    assert _paths(judged) == {a.flow: 0, other.flow: 1}  # host 0's flow still holds: host 1's moves
    assert _paths(plain) == {a.flow: 0, other.flow: 0}  # read on one clock: a double booking
    assert judged.exclusive_conflicts(at=11.6) == [] and plain.exclusive_conflicts(at=11.6) == []
    # Host 0's own next reservation follows its first as on host 0 (ended on its clock).
    own = _res(0, 2, 11.5, 20.0)
    judged, plain = _tables(a, own)
    assert _paths(judged) == _paths(plain) == {a.flow: 0, own.flow: 0}
    # What replicas compare stays the messages: digests and stated-end views agree.
    assert judged.state_digest(0.0) == plain.state_digest(0.0)
    assert judged.table(at=11.6) == plain.table(at=11.6)
    # For this replica's own requests too: the lease runs out at 11.0 on host 0's clock,
    # 12.1 here (and the expiry grace, 0.25 s, after). A RELEASE that arrives proves the
    # flow over at once, whatever the clocks.
    judged, _ = _tables(a)
    judged.tick(12.3)
    assert a.flow in set().union(*judged.link_holders().values())
    judged.tick(12.4)
    assert a.flow not in set().union(*judged.link_holders().values())
    judged, _ = _tables(a)
    judged.receive(Release(a.flow, 10.5))
    assert judged.link_holders() == {} or a.flow not in set().union(*judged.link_holders().values())
    # Measured within the bound again: the stated ends hold, as on every replica.
    judged, _ = _tables(a, other)
    judged.set_clock(0, 0.0, margin=0.1)
    assert _paths(judged) == {a.flow: 0, other.flow: 0}


def test_lag_is_the_difference_of_two_owners_offsets_plus_the_margin() -> None:
    t = ReservationTable(FAB)
    t.set_clock(3, 1.0, margin=0.1)  # host 3 runs 1 s behind this replica
    t.set_clock(4, -0.5, margin=0.1)  # host 4 runs 0.5 s ahead of it
    assert t.lag(3, 4) == pytest.approx(1.6) and t.lag(4, 3) == 0.0
    assert t.lag(3, -1) == pytest.approx(1.1) and t.lag(-1, 4) == pytest.approx(0.6) and t.lag(5, 6) == 0.0
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="behind"):
            t.set_clock(3, bad)
