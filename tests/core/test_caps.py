"""An engine's own traffic is never refused for bookkeeping.

Released reservations do not count against a host's live cap; at a cap the answer is plain
ECMP with the reason, never an error; what peers keep of an owner stays bounded and the
same on every replica; extra ports are bounded per flow and come back when a flow moves.
"""

from __future__ import annotations

import random

from ark.core.lease import LeasePolicy
from ark.core.messages import Release, Reserve
from ark.core.node import Node, Publish
from ark.core.pathmap import PathMapCache
from ark.core.protocol import MORE_PORTS_SHARE, ArkCore, CoreLimits
from ark.core.topology import preset

PAPER = preset("paper")  # 2 leaves of 8 hosts, 4 spines: hosts 0-7 on leaf 0, 8-15 on leaf 1
MAPS = PathMapCache(PAPER)
LEASE = LeasePolicy(1.0, 2.0, 600.0)


def core(host: int = 0, maps: PathMapCache = MAPS, **limits: int) -> ArkCore:
    return ArkCore(host, PAPER, maps, lease=LEASE, limits=CoreLimits(**limits))


def test_released_reservations_do_not_count_against_the_live_cap() -> None:
    c = core(max_flows_per_host=16)
    for k in range(40):  # back to back, all within the retention: the old cap refused the 17th
        d = c.request(8, 10**6, 1.0 + k * 1e-3)
        assert d.reserved and d.why == ""
        c.release(d.flow, 1.0 + k * 1e-3)
    assert c.counters.capped == 0 and c.reservations.owner_count(0) == 40


def test_at_the_live_cap_a_request_is_plain_ecmp_with_the_reason() -> None:
    # ark-balance: every request reserves (shared once the four paths are taken).
    c = ArkCore(0, PAPER, MAPS, policy="ark-balance", lease=LEASE, limits=CoreLimits(max_flows_per_host=16))
    live = [c.request(8 + k % 8, 10**6, 1.0) for k in range(16)]
    assert all(x.reserved for x in live)
    d = c.request(8, 10**6, 1.0)
    assert not d.reserved and d.fallback and d.messages == () and d.why == "cap: 16 live reservations"
    assert MAPS(0, 8, 4791).path_of(d.port) == d.path and c.counters.capped == 1
    c.release(live[0].flow, 1.1)
    assert c.request(9, 10**6, 1.2).reserved  # below the cap again
    # Unreserving (a skewed clock) ends a live reservation too.
    c.unreserve(live[1].flow, 1.3)
    assert c.request(9, 10**6, 1.3).why != "cap: 16 live reservations"


def test_the_owner_stops_short_of_what_peers_keep_so_every_replica_takes_its_reservations() -> None:
    """Peers bound what they retain of one owner (live and ended: the memory bound); the
    owner stops reserving max_flows_per_host short of it. Peers that get its messages in
    any order, or forget later than it does, keep every one: the tables agree."""
    limits = CoreLimits(max_flows_per_host=16)
    owner, peers = core(**vars(limits)), [ArkCore(h, PAPER, MAPS, lease=LEASE, limits=limits) for h in (8, 9)]
    sent, whys = [], []
    for k in range(60):
        d = owner.request(8, 10**6, 1.0 + k * 1e-3)
        whys.append(d.why)
        sent += [*d.messages, *owner.release(d.flow, 1.0 + k * 1e-3).messages]
    assert limits.owner_retained == 48 and limits.retained_per_host == 64
    assert whys == [""] * 48 + ["cap: 48 reservations retained"] * 12
    rng = random.Random(7)
    for p in peers:
        rng.shuffle(sent)  # another delivery order per replica
        for m in sent:
            p.receive(m, 1.1, sender=0)
    assert all(p.counters.overflow == 0 and p.reservations.owner_count(0) == 48 for p in peers)
    assert len({owner.digest(at=1.01), *(p.digest(at=1.01) for p in peers)}) == 1
    # Once forgotten (retention_s after they ended), the owner reserves again.
    owner.tick(1.1 + owner.retention_s)
    assert owner.request(8, 10**6, 1.1 + owner.retention_s).reserved


def test_an_engine_churning_past_the_old_cap_is_never_refused_and_its_peer_keeps_up() -> None:
    """Node to Node, with the default limits: 1,400 reserve+release cycles a second for
    8 s (about 11,000 ended reservations retained at once, far past the 4,096 that once
    refused every request) reserve every time, and the peer drops none of them."""
    owner, peer = (Node(h, PAPER, MAPS, [p], incarnation=1, lease=LEASE) for h, p in ((0, 8), (8, 0)))
    for n in (owner, peer):
        n.start(0.0)
        n.tick(2.0)
    whys: dict[str, int] = {}
    for k in range(8 * 1400):
        now = 2.0 + k / 1400
        lease, outs = owner.reserve(8, 10**6, now)
        whys[lease.fallback] = whys.get(lease.fallback, 0) + 1
        outs += owner.release(lease.flow_id, now)
        for o in outs:
            assert isinstance(o, Publish)
            peer.on_message(0, o.data, now + 1e-4)
        if k % 140 == 0:  # the agents' loops: batches, timers
            for n in (owner, peer):
                n.flush()
                n.tick(now)
    assert whys == {"": 8 * 1400} and peer.core.counters.overflow == 0
    assert owner.core.reservations.owner_count(0) > CoreLimits().max_flows_per_host
    assert owner.core.digest(at=now) == peer.core.digest(at=now)


def test_more_ports_are_bounded_by_a_share_of_the_paths_bucket() -> None:
    small = PathMapCache(PAPER, port_range=(49152, 49152 + 255))  # about 64 ports a path
    c = core(maps=small)
    d = c.request(8, 10**6, 1.0)
    share = len(small(0, 8, 4791).buckets[d.path]) // MORE_PORTS_SHARE
    assert 0 < share < 16
    assert len(c.more_ports(d.flow, 1000)) == share and c.more_ports(d.flow, 1) == []


def _race(c: ArkCore, owner: int, dst: int, path: int, ts: float) -> None:
    """A peer's reservation with a smaller key on ``path``, sharing our uplinks."""
    c.receive(Reserve((owner, 1), ts, owner, dst, 4791, path, 50000, 10**9, 1e11, False, ts + 10), ts + 0.01,
              sender=owner)


def test_a_flow_raced_off_a_path_gives_its_ports_there_back() -> None:
    c = core(1)
    d = c.request(9, 10**9, 1.0)
    extra = c.more_ports(d.flow, 10)
    in_use = c._bucket(9, 4791).in_use
    assert d.path == 0 and set(extra) <= in_use
    _race(c, 0, 8, 0, 0.5)  # host 0 took path 0 first: we move to path 1
    flows = c.local_flows()
    assert flows[d.flow][1] == 1 and not set(extra) & in_use  # the extra ports of path 0 are free again
    assert d.port in in_use  # the port it left stays held until its next move (the engine may still send)
    _race(c, 2, 10, 1, 0.6)  # host 2 took path 1 before us too: path 2 now
    assert c.local_flows()[d.flow][1] == 2 and d.port not in in_use
    c.unreserve(d.flow, 2.0)  # giving up the reservation: the flow stays put, its older ports go back
    assert in_use == {c.local_flows()[d.flow][2]}


def test_a_free_path_whose_ports_are_all_held_gives_plain_ecmp_not_an_error() -> None:
    # A map with a single port on path 0 towards host 9 (of six): held by a flow raced off it.
    tiny = PathMapCache(PAPER, port_range=(49175, 49180))
    assert tiny(1, 9, 4791).counts()[0] == 1
    c = core(1, maps=tiny)
    d = c.request(9, 10**9, 1.0)
    _race(c, 0, 8, 0, 0.5)
    assert c.local_flows()[d.flow][1] == 1
    c.receive(Release((0, 1), 1.5), 1.5, sender=0)  # path 0 is free again, its one port is not
    e = c.request(9, 10**9, 2.0)
    assert not e.reserved and e.fallback and e.why == "no free port on path 0" and e.messages == ()
    assert tiny(1, 9, 4791).path_of(e.port) == e.path  # plain ECMP: a random port, its own path


def test_four_part_leases_back_to_back_never_meet_the_retained_cap_below_its_rate() -> None:
    """Node to Node, the default limits, timers run when next_deadline says (as an agent
    runs them, forgetting on the bookkeeping grid): 575 four-part leases a second for 8 s,
    2,300 reservations a second, 11,500 ended within one retention, under the 12,288 the
    owner stops at. Ends that wait only for the grid (up to a second more: 13,800) do not
    count, so every part reserves; the peer, forgetting on its own grid, keeps every one."""
    owner, peer = (Node(h, PAPER, MAPS, [p], incarnation=1, lease=LEASE) for h, p in ((0, 8), (8, 0)))
    for n in (owner, peer):
        n.start(0.0)
        n.tick(2.0)
    whys: dict[str, int] = {}
    rate, seconds = 575, 8
    for k in range(seconds * rate):
        now = 2.0 + k / rate
        leases, outs = owner.reserve_split(8, 4 * 10**6, now, 4)
        for le in leases:
            whys[le.fallback] = whys.get(le.fallback, 0) + 1
            outs += owner.release(le.flow_id, now)
        for o in outs:
            peer.on_message(0, o.data, now + 1e-4)
        for n in (owner, peer):
            if now >= n.next_deadline(now):
                n.flush()
                n.tick(now)
    assert whys == {"": 4 * seconds * rate} and owner.core.counters.capped == 0
    assert peer.core.counters.overflow == 0
    assert owner.core.digest(at=now) == peer.core.digest(at=now)
