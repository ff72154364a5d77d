"""State an outsider can make a node keep, and work it can make it do, stay bounded.

Sans-IO: a Node fed directly, so that each bound is checked exactly and fast.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ark.core.envelope import K_DATA, K_HELLO, encode_envelope
from ark.core.lease import LeasePolicy
from ark.core.messages import Release, Reserve, encode
from ark.core.node import Node, NodeLimits
from ark.core.pathmap import PathMapCache
from ark.core.protocol import CoreError, CoreLimits
from ark.core.topology import preset

FAB = preset("paper")
MAPS = PathMapCache(FAB)


def node(host: int = 8, **kw) -> Node:
    n = Node(host, FAB, MAPS, [p for p in (0, 1, 8, 9) if p != host], incarnation=1,
             lease=LeasePolicy(1.0, 2.0, 600.0), **kw)
    n.start(0.0)
    n.tick(2.0)  # nobody answered: ready anyway
    return n


def data(sender: int, seq: int, msg) -> bytes:
    return encode_envelope(K_DATA, sender, 1, seq, [encode(msg), b""])


def test_a_huge_transfer_gets_the_capped_lease_that_peers_accept() -> None:
    owner, peer = node(0), node(8)
    lease, outs = owner.reserve(9, 4 * 10**12, 10.0)  # 4 TB: uncapped, hours
    assert lease.expires == pytest.approx(10.0 + 600.0)
    peer.on_message(0, outs[0].data, 10.0)
    peer.flush()
    assert lease.flow_id in peer.core.table()


def test_far_future_releases_of_unknown_flows_are_not_kept() -> None:
    n = node()
    for k in range(5000):
        n.on_message(0, data(0, k + 1, Release((0, 10**6 + k), 1e6)), 10.0)
        n.on_message(0, data(0, 10_000 + k, Release((0, 2 * 10**6 + k), 11.0)), 10.0)
    assert n.core.reservations.early_messages() <= CoreLimits().max_early_per_host
    assert n.counters.out_of_window == 5000 and n.core.counters.overflow >= 5000 - CoreLimits().max_early_per_host


def test_gapped_sequence_numbers_keep_at_most_max_ahead() -> None:
    n = node(limits=NodeLimits(max_ahead=64))
    n.on_message(0, encode_envelope(K_HELLO, 0, 1, 0, [b"\0" * 8, 7.5, 9.7, 10.0, []]), 10.0)
    for k in range(10_000):  # every third sequence number: a hole before each
        n.on_message(0, data(0, 2 + 3 * k, Release((0, 5), 10.0)), 10.0)
        assert len(n.peers[0].ahead) <= 64


def test_reservations_per_owner_are_capped() -> None:
    limits = CoreLimits(max_flows_per_host=100)
    assert limits.retained_per_host == 400  # RETAINED_PER_LIVE x the live cap
    n = node(core_limits=limits)
    for k in range(1000):
        m = Reserve((0, k + 1), 10.0, 0, 9, 4791, k % 4, 49152 + k, 10**6, 1e11, False, 11.0)
        n.on_message(0, data(0, k + 1, m), 10.0)
    n.flush()
    assert sum(1 for f in n.core.entries() if f[0] == 0) == 400 and n.core.counters.overflow == 600
    assert len(n._sigs) <= 400  # no signature kept for a reservation the core dropped


def test_a_peer_reserving_and_releasing_fast_stays_within_the_retained_bound() -> None:
    """Released reservations no longer count against the live cap, but what a replica
    retains of one owner (live and ended, until forgotten) stays bounded: a peer sending
    reserve+release pairs far faster than any engine, stamped up to the window ahead so
    that they are kept as long as possible, never grows it past retained_per_host."""
    limits = CoreLimits(max_flows_per_host=64)
    bound = limits.retained_per_host
    n = node(core_limits=limits)
    seq, flows, peak = 0, 0, 0
    for step in range(120):  # 12 s, ticking every 0.1 s: every reservation is forgotten at least once
        now = 10.0 + step * 0.1
        for k in range(400):  # 4,000 pairs a second
            flows += 1
            ts = now + (4.9 if k % 2 else 0.0)  # half of them dated at the window's far end
            m = Reserve((0, flows), ts, 0, 9, 4791, k % 4, 49152 + k, 10**6, 1e11, False, ts + 1.0)
            for msg in (m, Release(m.flow, ts)):
                seq += 1
                n.on_message(0, data(0, seq, msg), now)
        n.flush()
        n.tick(now)
        peak = max(peak, n.core.reservations.owner_count(0))
        assert n.core.reservations.owner_count(0) <= bound
        # Signatures: of what the core keeps (reservations, early releases of the ones it
        # dropped), and of what it forgot since the last pruning (every retention / 2).
        assert len(n._sigs) <= 2 * (bound + limits.max_early_per_host)
    assert peak == bound and n.core.counters.overflow > 0
    # An honest host's reservation still gets in: the bound is per owner.
    lease, outs = node(1).reserve(9, 10**6, now)
    n.on_message(1, outs[0].data, now)
    n.flush()
    assert lease.flow_id in n.core.table()


def test_a_retained_reservation_costs_a_replica_under_3_kb() -> None:
    """What the retained bound means in memory: each reservation a peer can make a replica
    keep, with its release and both signatures kept for relaying, costs under 3 KB (the
    threat model's figure for max_retained_per_host of them)."""
    import gc
    import tracemalloc

    limits = CoreLimits(max_flows_per_host=256)
    n = node(core_limits=limits)
    MAPS(8, 0, 4791)
    gc.collect()
    tracemalloc.start()
    try:
        for k in range(limits.retained_per_host):
            m = Reserve((0, k + 1), 14.9, 0, 9, 4791, k % 4, 49152 + k, 10**6, 1e11, False, 15.9)
            n.on_message(0, encode_envelope(K_DATA, 0, 1, 2 * k + 1, [encode(m), b"s" * 64]), 10.0)
            n.on_message(0, encode_envelope(K_DATA, 0, 1, 2 * k + 2, [encode(Release(m.flow, 14.9)), b"s" * 64]), 10.0)
        n.flush()
        n.core.state_digest(0.0)
        gc.collect()
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n.core.reservations.owner_count(0) == limits.retained_per_host
    assert used / limits.retained_per_host < 3000


def test_destination_ports_are_capped_and_idle_ones_dropped() -> None:
    n = node(core_limits=CoreLimits(max_dports=4))
    for d in range(2000):
        lease, _ = n.reserve(0, 10**6, 10.0, dport=1000 + d)
        n.release(lease.flow_id, 10.0)
    assert len(n.core._dports) <= 4 and len({k[1] for k in n.core._buckets}) <= 4
    leases = [n.reserve(0, 10**6, 10.0, dport=5000 + d)[0] for d in range(4)]  # four dports busy
    with pytest.raises(CoreError, match="^dport: 4 destination ports are in use"):
        n.reserve(0, 10**6, 10.0, dport=6000)
    assert len(leases) == 4


def test_local_flows_are_capped_and_beyond_the_cap_a_lease_is_plain_ecmp_kept_nowhere() -> None:
    n = node(limits=NodeLimits(max_local_flows=50))
    for _ in range(50):
        n.reserve(0, 10**6, 10.0)
    extra = [n.reserve(0, 10**6, 10.0) for _ in range(1000)]
    assert len(n.local_flows()) == 50 and n.counters.untracked == 1000  # nothing more kept
    lease, outs = extra[0]
    assert outs == [] and not lease.reserved and lease.fallback == "cap: 50 live local flows"
    assert MAPS(8, 0, 4791).path_of(lease.src_port) == lease.path
    # Renew, lease and release answer from the id alone; a made-up id is still refused.
    assert n.renew(lease.flow_id, 11.0)[0] == lease._replace(expires=11.0 + 600.0)
    assert n.lease_of(lease.flow_id, 12.0).src_port == lease.src_port and n.more_ports(lease.flow_id, 4) == []
    assert n.release(lease.flow_id, 12.0) == [] and len(n.local_flows()) == 50
    for bad in ((8, 1 << 62 | 8 << 32 | 4791 << 16 | 50000), (0, lease.flow_id[1]), (8, 12345)):
        with pytest.raises(CoreError, match="not an active local flow"):
            n.release(bad, 12.0)


def test_old_reservations_in_a_batch_cost_one_recomputation() -> None:
    """RESERVEs stamped in the past force a re-evaluation each; a batch is evaluated once."""
    n = node(core_limits=CoreLimits(max_flows_per_host=10_000))
    for k in range(200):  # a busy recent past
        m = Reserve((1, k + 1), 9.0 + k * 0.001, 1, 9, 4791, k % 4, 49152 + k, 10**6, 1e11, False, 12.0)
        n.on_message(1, data(1, k + 1, m), 10.0)
    n.flush()
    before = n.core.counters.partial_recomputes + n.core.counters.recomputes
    for k in range(1000):  # a thousand, each 1 s older than the newest
        m = Reserve((0, k + 1), 9.0, 0, 9, 4791, k % 4, 50000 + k, 10**6, 1e11, False, 12.0)
        n.on_message(0, data(0, k + 1, m), 10.0)
    n.flush()
    assert n.core.counters.partial_recomputes + n.core.counters.recomputes - before == 1
    assert n.core.exclusive_conflicts() == []


@given(st.binary(max_size=600))
def test_any_bytes_from_a_listed_peer_are_dropped_without_harm(raw: bytes) -> None:
    n = node()
    before = n.core.digest()
    n.on_message(0, raw, 10.0)
    n.flush()
    assert n.core.digest() == before


@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**63), 2**64 - 1),
                          st.text(max_size=4), st.none(), st.booleans()), min_size=14, max_size=14))
def test_any_reservation_fields_are_checked_before_they_count(fields: list) -> None:
    import msgpack

    fields[:2] = [1, 1]  # a RESERVE, the current version
    n = node()
    before = n.core.digest()
    try:
        raw = msgpack.packb(fields)
    except (OverflowError, ValueError):
        return
    n.on_message(0, encode_envelope(K_DATA, 0, 1, 1, [raw, b""]), 10.0)
    n.flush()
    after = n.core.digest()
    if after != before:  # it was a valid reservation of host 0, within the window and the cap
        (f, (path, _)), = n.core.table().items()
        assert f[0] == 0 and 0 <= path < 4 and math.isfinite(fields[4]) and abs(fields[4] - 10.0) <= 5.0


def test_snapshot_parts_stay_under_the_envelope_limit_with_every_frozen_assignment() -> None:
    """However many messages and frozen assignments a snapshot holds, each part decodes
    (the largest messages, the widest assignments), messages come first and every frozen
    assignment is sent once, from the last part with messages on."""
    from ark.core.envelope import (
        K_SYNC_REP,
        MAX_ENVELOPE_BYTES,
        SYNC_FROZEN_PER_PART,
        SYNC_ITEMS_PER_PART,
        decode_envelope,
        sync_parts,
    )
    from ark.core.messages import MAX_MESSAGE_BYTES

    widest = [2**32 - 1, 2**63 - 1, 65535, True]
    for n_items, n_frozen in [(0, 0), (0, 9000), (SYNC_ITEMS_PER_PART + 1, 10), (2 * SYNC_ITEMS_PER_PART, 3 * SYNC_FROZEN_PER_PART + 1)]:
        items = [(bytes(MAX_MESSAGE_BYTES), bytes(64))] * n_items
        frozen = [list(widest) for _ in range(n_frozen)]
        parts = list(sync_parts(items, frozen))
        got_items = got_frozen = 0
        for part, total, chunk, fchunk in parts:
            assert total == len(parts)
            raw = encode_envelope(K_SYNC_REP, 3, 1, 9, [chunk, 1.0, fchunk, part, total])
            assert len(raw) <= MAX_ENVELOPE_BYTES
            decode_envelope(raw)
            if fchunk and not got_frozen:  # the first assignments ride in the last part with messages
                assert part == max(1, -(-n_items // SYNC_ITEMS_PER_PART)) - 1
            assert not (got_frozen and chunk)  # no message after an assignment
            got_items += len(chunk)
            got_frozen += len(fchunk)
        assert (got_items, got_frozen) == (n_items, n_frozen)
