"""Clock offsets from heartbeats: a host whose clock is off stops reserving; others do not."""

from __future__ import annotations

import pytest

from ark.core.clock import ClockWatch
from ark.core.lease import LeasePolicy
from ark.core.node import Node, NodeLimits, Publish
from ark.core.pathmap import PathMapCache
from ark.core.topology import preset

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


def test_clock_watch_bounds_and_majority() -> None:
    w = ClockWatch(bound_s=0.1, fresh_s=1.0)
    for p in (1, 2, 3):
        w.hello(p, 10.0, 10.3, [], me=0)  # their clocks 0.3 s ahead of ours: we are behind
    v = w.verdict(10.0)
    assert w.ahead_of_us() == [1, 2, 3] and v is not None and v[0] and "behind 3 of 3" in v[1]
    w = ClockWatch(bound_s=0.1, fresh_s=1.0)
    w.hello(1, 10.0, 9.7, [0], me=0)  # delay could explain a positive sample: only their word counts
    w.hello(2, 10.0, 9.7, [0], me=0)
    w.hello(3, 10.0, 9.99, [], me=0)
    v = w.verdict(10.0)
    assert w.ahead_of_us() == [] and v is not None and v[0] and "ahead of 2 of 3" in v[1]
    assert w.verdict(12.0) is None  # nobody heard recently: no evidence either way
