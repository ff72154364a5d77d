"""Node: replication, gaps, resync, leases and restarts, with direct delivery."""

from __future__ import annotations

import pytest

from ark.core.lease import LeasePolicy
from ark.core.messages import Reserve, encode
from ark.core.node import (
    K_DATA,
    K_HELLO,
    K_SYNC_REP,
    Node,
    NodeLimits,
    NotReady,
    Publish,
    decode_envelope,
    encode_envelope,
)
from ark.core.pathmap import PathMapCache
from ark.core.protocol import CoreError
from ark.core.topology import preset

FAB = preset("paper")
MAPS = PathMapCache(FAB)
HOSTS = [0, 1, 8, 9]  # two prefill, two decode GPUs


def make(host: int, inc: int = 1, **kw) -> Node:
    return Node(host, FAB, MAPS, [h for h in HOSTS if h != host], incarnation=inc,
                lease=LeasePolicy(min_s=1.0, slack=2.0), **kw)


class Net:
    """Instant, lossless delivery unless told to drop."""

    def __init__(self) -> None:
        self.nodes = {h: make(h) for h in HOSTS}
        self.drop_to: set[int] = set()

    def emit(self, src: int, outs, now: float) -> None:
        queue = [(src, o) for o in outs]
        while queue:
            s, o = queue.pop(0)
            dests = [h for h in self.nodes if h != s] if isinstance(o, Publish) else [o.peer]
            for d in dests:
                if d in self.drop_to:
                    continue
                n = self.nodes[d]
                res = n.on_publish(s, o.data, now) if isinstance(o, Publish) else n.on_request(s, o.data, now)
                queue.extend((d, r) for r in res)

    def start(self, now: float = 0.0) -> None:
        for h, n in self.nodes.items():
            self.emit(h, n.start(now), now)
        for h, n in self.nodes.items():
            self.emit(h, n.tick(now + 1.5), now + 1.5)

    def digests(self, at: float) -> set[str]:
        return {n.core.digest(at=at) for n in self.nodes.values()}


def test_reserve_propagates_and_release_clears() -> None:
    net = Net()
    net.start()
    assert all(n.ready for n in net.nodes.values())
    lease, outs = net.nodes[0].reserve(8, 10**9, 2.0)
    assert lease.reserved and lease.flow_label is not None and lease.expires > 2.0
    net.emit(0, outs, 2.0)
    assert len(net.digests(2.0)) == 1 and lease.flow_id in net.nodes[9].core.table()
    net.emit(0, net.nodes[0].release(lease.flow_id, 2.5), 2.5)
    assert all(lease.flow_id not in n.core.table() for n in net.nodes.values())


def test_not_ready_until_peers_answer() -> None:
    n = make(0)
    n.start(0.0)
    with pytest.raises(NotReady):
        n.reserve(8, 10, 0.1)
    n.tick(0.5)  # nobody answered yet
    assert not n.ready
    n.tick(1.01)  # sync timeout: unreachable peers count as down
    assert n.ready


def test_gap_triggers_resync_and_recovers_a_lost_release() -> None:
    net = Net()
    net.start()
    lease, outs = net.nodes[0].reserve(8, 10**9, 2.0)
    net.emit(0, outs, 2.0)
    net.drop_to = {9}
    net.emit(0, net.nodes[0].release(lease.flow_id, 2.1), 2.1)
    assert lease.flow_id in net.nodes[9].core.table()  # missed the RELEASE
    net.drop_to = set()
    net.emit(0, net.nodes[0].tick(2.6), 2.6)  # HELLO shows the gap -> sync -> repaired
    assert net.nodes[9].counters.gaps == 1 and net.nodes[9].counters.sync_applied >= 2
    assert lease.flow_id not in net.nodes[9].core.table()
    assert len(net.digests(2.6)) == 1


def test_lease_expires_when_the_client_stops_renewing() -> None:
    net = Net()
    net.start()
    lease, outs = net.nodes[0].reserve(8, 10**9, 2.0)
    net.emit(0, outs, 2.0)
    renewed, outs = net.nodes[0].renew(lease.flow_id, 2.5)
    net.emit(0, outs, 2.5)
    assert renewed.expires > lease.expires
    assert net.nodes[9].core.end_of(lease.flow_id) == pytest.approx(renewed.expires)
    # The client vanishes: the owner releases at expiry; a peer that misses it expires it.
    net.drop_to = {9}
    t = renewed.expires + 0.01
    net.emit(0, net.nodes[0].tick(t), t)
    assert net.nodes[0].counters.local_expired == 1
    assert lease.flow_id in net.nodes[9].core.table()
    net.nodes[9].tick(t + 0.3)  # past the expiry grace
    assert lease.flow_id not in net.nodes[9].core.table()
    with pytest.raises(CoreError, match="not an active local flow"):
        net.nodes[0].renew(lease.flow_id, t)


def test_dead_host_reservations_vanish_within_one_lease() -> None:
    net = Net()
    net.start()
    lease, outs = net.nodes[1].reserve(9, 10**9, 2.0)
    net.emit(1, outs, 2.0)
    del net.nodes[1]  # SIGKILL: no release, no renewals
    end = lease.expires
    for n in net.nodes.values():
        n.tick(end - 0.01)
        assert lease.flow_id in n.core.table()
        n.tick(end + n.core.expiry_grace_s + 0.01)
        assert lease.flow_id not in n.core.table()


def test_restart_learns_and_releases_its_predecessors_flows() -> None:
    net = Net()
    net.start()
    lease, outs = net.nodes[0].reserve(8, 10**9, 2.0)
    net.emit(0, outs, 2.0)
    net.nodes[0] = make(0, inc=2)  # restart: state lost
    net.emit(0, net.nodes[0].start(3.0), 3.0)
    assert net.nodes[0].ready
    assert net.nodes[0].counters.predecessor_releases == 1
    assert all(lease.flow_id not in n.core.table() for n in net.nodes.values())
    # New flow ids never collide with the predecessor's.
    l2, outs = net.nodes[0].reserve(8, 10**9, 3.1)
    assert l2.flow_id[1] >> 32 == 2 and l2.path == 0
    net.emit(0, outs, 3.1)
    assert len(net.digests(3.1)) == 1


def test_sender_must_match_channel_and_owner() -> None:
    net = Net()
    net.start()
    peer = net.nodes[8]
    fake = Reserve((0, 99), 2.0, 0, 9, 4791, 0, 50000, 10, 1e9, False, 3.0)
    # Host 1 publishes a reservation in host 0's name: dropped, counted.
    env = encode_envelope(K_DATA, 1, 1, 10_000, [encode(fake), b""])
    before = peer.core.digest()
    peer.on_publish(1, env, 2.0)
    # An envelope that claims another sender than its channel: dropped.
    peer.on_publish(1, encode_envelope(K_DATA, 0, 1, 10_001, [encode(fake), b""]), 2.0)
    assert peer.counters.invalid + peer.core.counters.invalid == 2 and peer.core.digest() == before
    # An unsolicited sync reply is ignored (host 9 was never asked).
    assert peer.peers[9].sync_sent is None
    rep = encode_envelope(K_SYNC_REP, 9, 1, 5, [[[encode(fake._replace(flow=(9, 5), src=9, dst=1)), b""]], 2.0, [], 0, 1])
    peer.on_request(9, rep, 2.0)
    assert peer.core.digest() == before and peer.counters.dropped == 1


def test_overlong_lease_is_rejected() -> None:
    net = Net()
    net.start()
    peer = net.nodes[8]
    bad = Reserve((0, 7), 2.0, 0, 9, 4791, 0, 50000, 10, 1e9, False, 2.0 + 10_000)
    peer.on_publish(0, encode_envelope(K_DATA, 0, 1, 50, [encode(bad), b""]), 2.0)
    assert peer.counters.invalid == 1 and peer.core.table() == {}


def test_a_message_of_another_wire_version_is_dropped_and_counted_as_such() -> None:
    import msgpack

    net = Net()
    net.start()
    peer = net.nodes[8]
    before = peer.core.digest()
    ok = Reserve((0, 7), 2.0, 0, 9, 4791, 0, 50000, 10, 1e9, False, 3.0)
    # An envelope from a future release (version 4) and an old message inside a current one.
    future = msgpack.packb([4, K_DATA, 0, 1, 50, [encode(ok), b""]], use_bin_type=True)
    other_layout = msgpack.packb([4, K_DATA, 0, 1, 50, "new field", [encode(ok), b""]], use_bin_type=True)
    old_msg = msgpack.packb([0, *msgpack.unpackb(encode(ok))[1:]], use_bin_type=True)
    peer.on_publish(0, future, 2.0)
    peer.on_publish(0, other_layout, 2.0)
    peer.on_publish(0, encode_envelope(K_DATA, 0, 1, 51, [old_msg, b""]), 2.0)
    assert peer.counters.wrong_version == 3 and peer.counters.invalid == 3
    assert peer.core.digest() == before and peer.core.table() == {}
    # Garbage is invalid but not of another version.
    peer.on_publish(0, b"\xc1", 2.0)
    assert peer.counters.wrong_version == 3 and peer.counters.invalid == 4
    assert peer.status(2.0)["node"]["wrong_version"] == 3


def test_envelope_validation() -> None:
    assert decode_envelope(encode_envelope(K_HELLO, 3, 1, 9, [b"12345678", 1.0, 2.0, 2.0, []])).seq == 9
    for bad in (b"", b"\xc1", encode_envelope(9, 1, 1, 1, None), encode_envelope(K_DATA, 1, 1, 1, "str"),
                encode_envelope(K_HELLO, 1, 1, 1, None),
                encode_envelope(K_HELLO, 1, 1, 1, [b"12345678", 1, 2.0, 2.0, []]),  # an int time
                encode_envelope(K_HELLO, 1, 1, 1, [b"12345678", 1.0, float("nan"), 2.0, []]),
                encode_envelope(K_DATA, 1, 1, 1, [b"m", b"short signature"]),
                encode_envelope(K_SYNC_REP, 1, 1, 1, [[], 1.0, [], 1, 1]),  # part beyond parts
                encode_envelope(K_SYNC_REP, 1, 1, 1, [[], 1.0])):
        with pytest.raises(Exception, match="envelope"):
            decode_envelope(bad)


def test_status_reports_peers_and_counters() -> None:
    net = Net()
    net.start()
    st = net.nodes[0].status(1.6)
    assert st["ready"] and set(st["peers"]) == {"1", "8", "9"}
    assert all(p["up"] and p["synced"] for p in st["peers"].values())
    assert st["node"]["sync_applied"] == 3


def test_reload_pathmaps_repaths_moved_reservations_everywhere():
    """After a re-hash, a reserved flow whose port leads elsewhere gets a new reservation."""
    import numpy as np

    from ark.core.pathmap import PROBED, PathMap

    def probed(buckets):
        return PathMap(PROBED, 0, PROBED, FAB.hosts[0].ip, FAB.hosts[8].ip, 4791, (100, 199),
                       tuple(np.asarray(b, dtype=np.int64) for b in buckets), 6)

    class Maps:
        pm = probed([[100, 101], [110, 111], [120], [130]])

        def __call__(self, src, dst, dport):
            return self.pm if (src, dst) == (0, 8) else MAPS(src, dst, dport)

    maps = Maps()
    net = Net()
    net.nodes[0] = Node(0, FAB, maps, [h for h in HOSTS if h != 0], incarnation=1,
                        lease=LeasePolicy(min_s=1.0, slack=2.0))
    net.start()
    n0 = net.nodes[0]
    a, outs = n0.reserve(8, 10_000, 2.0)
    net.emit(0, outs, 2.0)
    b, outs = n0.reserve(8, 10_000, 2.0)
    net.emit(0, outs, 2.0)
    assert (a.path, b.path) == (0, 1)
    # Spine 0 failed: its ports now hash to spines 2 and 3; spine 1 is unchanged.
    maps.pm = probed([[], [110, 111], [100, 120], [101, 130]])
    repathed, outs = n0.reload_pathmaps(2.1)
    net.emit(0, outs, 2.1)
    assert list(repathed) == [a.flow_id]
    new = repathed[a.flow_id]
    # Port 100 now leads to spine 2, which is free: the reservation follows the port.
    assert (new.path, new.src_port) == (2, 100) and new.flow_id != a.flow_id
    # A second re-hash sends port 100 to spine 1, which b holds: a new port on a free path.
    maps.pm = probed([[], [100, 110, 111], [120], [101, 130]])
    repathed, outs = n0.reload_pathmaps(2.15)
    net.emit(0, outs, 2.15)
    assert list(repathed) == [new.flow_id]
    new = repathed[new.flow_id]
    assert (new.path, new.src_port) in ((2, 120), (3, 101), (3, 130))
    # The old id follows the new reservation; every replica agrees on the table.
    assert n0.lease_of(a.flow_id) == new
    assert n0.renew(a.flow_id, 2.2)[0].flow_id == new.flow_id
    tables = {h: n.core.table(at=2.2) for h, n in net.nodes.items()}
    assert all(t == tables[0] for t in tables.values())
    assert a.flow_id not in tables[0] and tables[0][new.flow_id][0] == new.path
    net.emit(0, n0.release(a.flow_id, 2.3), 2.3)
    assert new.flow_id not in n0.local_flows() and b.flow_id in n0.local_flows()
    with pytest.raises(CoreError):
        n0.lease_of(a.flow_id)


@pytest.mark.parametrize("released", [False, True])
def test_a_snapshot_judges_a_reservation_by_its_renewals_and_release(released: bool) -> None:
    """A joiner whose retention horizon lies past a RESERVE's first lease keeps the flow
    when renewals kept it alive past the horizon, and drops it when a RELEASE ended it
    before the horizon, even though a renewal had moved its lease past it."""
    peer = make(8)
    peer.start(0.0)
    peer.tick(1.5)  # nobody answers: ready after the sync timeout
    lease, _ = peer.reserve(0, 10**6, 1.5)  # first lease ends at about 2.5
    peer.renew(lease.flow_id, 2.4)  # lease until about 3.4
    if released:
        peer.release(lease.flow_id, 2.45)
    else:
        for t in (3.0, 4.0, 5.0, 6.0, 7.0, 8.0):
            peer.renew(lease.flow_id, t)
    joiner = make(0)
    req = next(o for o in joiner.start(8.0) if getattr(o, "peer", None) == 8)
    joiner.tick(8.0)  # retention horizon 3.0: past the first lease
    for reply in peer.on_request(0, req.data, 8.0):
        joiner.on_request(8, reply.data, 8.0)
    assert joiner.counters.sync_applied == 1
    for at in (3.2, 8.0):
        assert (lease.flow_id in joiner.core.table(at=at)) == (not released)
        assert joiner.core.digest(at=at) == peer.core.digest(at=at)


def test_snapshot_parts_never_split_one_flows_messages() -> None:
    from ark.core.envelope import SYNC_ITEMS_PER_PART, sync_parts

    # Flows of one, two and three messages, lined up so that plain cuts would split them.
    flows = [f for i in range(SYNC_ITEMS_PER_PART) for f in [i] * (1 + i % 3)]
    items = [(b"m", b"")] * len(flows)
    seen = 0
    parts = list(sync_parts(items, [], flows))
    assert len(parts) > 1
    for _part, _n, chunk, _frozen in parts:
        assert 0 < len(chunk) <= SYNC_ITEMS_PER_PART
        lo, hi = seen, seen + len(chunk)
        assert lo == 0 or flows[lo] != flows[lo - 1]
        assert hi == len(flows) or flows[hi] != flows[hi - 1]
        seen = hi
    assert seen == len(flows)


def test_a_split_lease_takes_distinct_paths_and_every_replica_holds_each_part() -> None:
    net = Net()
    net.start()
    leases, outs = net.nodes[0].reserve_split(8, 3 * 10**9 + 1, 2.0, 3)
    assert [le.path for le in leases] == [0, 1, 2] and all(le.reserved for le in leases)
    assert len({le.flow_id for le in leases}) == 3 and len({le.src_port for le in leases}) == 3
    assert [MAPS(0, 8, 4791).path_of(le.src_port) for le in leases] == [0, 1, 2]
    net.emit(0, outs, 2.0)
    assert len(net.digests(2.0)) == 1
    assert all(le.flow_id in net.nodes[9].core.table() for le in leases)
    # Each part is renewed and released on its own; releasing them all clears every replica.
    for le in leases:
        renewed, outs = net.nodes[0].renew(le.flow_id, 2.5)
        assert renewed.expires > le.expires
        net.emit(0, outs, 2.5)
    for le in leases:
        net.emit(0, net.nodes[0].release(le.flow_id, 2.6), 2.6)
    assert all(not n.core.table() for n in net.nodes.values())


def test_a_split_lease_beyond_the_free_paths_falls_back_part_by_part() -> None:
    net = Net()
    net.start()
    # Four paths from leaf 0 to leaf 1: five parts under policy ark leave the fifth unreserved.
    leases, outs = net.nodes[0].reserve_split(8, 5 * 10**6, 2.0, 5)
    assert sorted(le.path for le in leases[:4]) == [0, 1, 2, 3] and all(le.reserved for le in leases[:4])
    assert not leases[4].reserved and leases[4].fallback == "no free path"
    with pytest.raises(CoreError, match="parts: must be 1..16"):
        net.nodes[0].reserve_split(8, 10**6, 2.0, 17)
    with pytest.raises(CoreError, match="nbytes"):
        net.nodes[0].reserve_split(8, -1, 2.0, 2)
    # A fenced host (its clock is off) gets every part as plain ECMP, with the reason.
    net.nodes[1].skewed = "clock off"
    fenced, outs = net.nodes[1].reserve_split(9, 10**6, 2.0, 2)
    assert outs == [] and all(not le.reserved and le.fallback == "clock skewed" for le in fenced)


def test_the_parts_beyond_the_local_flow_cap_are_plain_ecmp_kept_nowhere() -> None:
    n = Node(0, FAB, MAPS, [], incarnation=1, limits=NodeLimits(max_local_flows=3))
    n.start(0.0)
    leases, _outs = n.reserve_split(8, 5 * 10**6, 1.0, 5)
    assert [le.reserved for le in leases] == [True, True, True, False, False]
    assert all(le.fallback == "cap: 3 live local flows" for le in leases[3:])
    assert len(n.local_flows()) == 3 and len({le.path for le in leases[:3]}) == 3


def test_a_part_that_loses_a_race_is_repathed_and_its_lease_follows() -> None:
    net = Net()
    net.start()
    a, b = net.nodes[0], net.nodes[1]
    early, early_outs = b.reserve(9, 10**9, 1.999)  # the smaller key, not yet heard by host 0
    leases, outs = a.reserve_split(8, 2 * 10**9, 2.0, 2)
    assert early.path == leases[0].path == 0  # both took the lowest free path
    net.emit(1, early_outs, 2.0)
    net.emit(0, outs, 2.0)
    # Host 0 recomputes its parts behind the earlier flow: each moves to the next free
    # path (a reserved path holds one flow, so the parts stay apart) and its lease follows.
    now = [a.lease_of(le.flow_id) for le in leases]
    assert [le.path for le in now] == [1, 2] and all(le.reserved for le in now)
    assert [MAPS(0, 8, 4791).path_of(le.src_port) for le in now] == [1, 2]
    assert len(net.digests(2.0)) == 1
    # What a renewal of the lease answers (the client's parts follow it), under the same ids.
    renewed = [a.renew(le.flow_id, 2.2)[0] for le in leases]
    assert [(r.flow_id, r.path, r.src_port) for r in renewed] == [(le.flow_id, le.path, le.src_port) for le in now]


def test_publishes_deferred_while_a_request_is_answered_go_out_after_in_order() -> None:
    """A driver answering a local request sets defer_publish: reserve, renew and release
    return nothing to send, and publish_deferred() then signs and envelopes all of it in
    the order it happened, so every replica ends where it would have."""
    signed: list[bytes] = []
    net = Net()
    net.nodes[0] = make(0, signer=lambda raw: signed.append(raw) or b"s" * 64)
    net.start()
    a = net.nodes[0]
    a.defer_publish = True
    lease, outs = a.reserve(8, 10**9, 2.0)
    split, outs2 = a.reserve_split(9, 4 * 10**9, 2.0, 3)
    assert outs == [] and outs2 == [] and signed == []  # nothing signed before the answer
    a.defer_publish = False
    out = a.publish_deferred()
    assert len(out) == 4 and len(signed) == 4 and a.publish_deferred() == []
    assert [decode_envelope(o.data).seq for o in out] == [1, 2, 3, 4]
    net.emit(0, out, 2.0)
    for f in (lease.flow_id, *(p.flow_id for p in split)):
        assert all(f in n.core.table() for n in net.nodes.values())
    a.defer_publish = True
    assert a.release(lease.flow_id, 2.5) == []
    a.defer_publish = False
    net.emit(0, a.publish_deferred(), 2.5)
    assert all(lease.flow_id not in n.core.table() for n in net.nodes.values())
    assert len(net.digests(2.5)) == 1


def test_a_split_lease_is_checked_once_and_refused_whole() -> None:
    """One pass: an invalid split request or a node still resynchronising raises before
    any part is taken; a valid one publishes every reserved part in one list."""
    n = make(0)
    n.start(0.0)
    with pytest.raises(NotReady):
        n.reserve_split(8, 10**9, 0.1, 4)
    with pytest.raises(CoreError, match="dst"):
        n.reserve_split(0, 10**9, 0.1, 4)
    assert n.local_flows() == [] and n.core.counters.requests == 0
    n.tick(1.01)
    leases, outs = n.reserve_split(8, 10**9, 1.1, 4)
    assert len({le.path for le in leases}) == 4 and len(outs) == 4 and len(n.local_flows()) == 4
