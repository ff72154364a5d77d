"""``ark-split`` requests, and a reservation table fed a RELEASE later than its grace."""

from __future__ import annotations

import pytest

from ark.core.messages import Release, Reserve
from ark.core.pathmap import PathMapCache
from ark.core.protocol import ArkCore, CoreError
from ark.core.table import ReservationTable
from ark.core.topology import preset

PAPER = preset("paper")


def _core(host: int = 0, policy: str = "ark-split") -> ArkCore:
    return ArkCore(host, PAPER, PathMapCache(PAPER), policy=policy)


def test_split_parts_take_distinct_free_paths_and_hash_onto_them() -> None:
    core = _core()
    decs = core.request_split(8, 3 * 10**9 + 2, 1.0, 3)
    assert [d.path for d in decs] == [0, 1, 2]
    assert [m.nbytes for d in decs for m in d.messages] == [10**9 + 1, 10**9 + 1, 10**9]
    assert all(d.reserved and not d.shared for d in decs)
    pm = PathMapCache(PAPER)(0, 8, 4791)
    assert [pm.path_of(d.port) for d in decs] == [0, 1, 2]
    assert len({d.flow for d in decs}) == 3


def test_split_parts_share_the_least_backlogged_paths_when_none_is_free() -> None:
    core = _core()
    # Another host holds every path: the parts share, each on another path, least backlog first.
    for k, nbytes in enumerate((4, 1, 3, 2)):
        core.receive(Reserve((1, k + 1), 0.0, 1, 9, 4791, k, 49152 + k, nbytes * 10**9, 1e11), 0.0)
    decs = core.request_split(8, 3 * 10**9, 0.001, 3)
    assert [d.path for d in decs] == [1, 3, 2]
    assert all(d.shared for d in decs)
    # More parts than paths: the last one goes back to the least-backlogged path.
    more = core.request_split(8, 5 * 10**9, 0.002, 5)
    assert sorted(d.path for d in more[:4]) == [0, 1, 2, 3] and more[4].path == 1


def test_split_under_ark_takes_free_paths_then_plain_ecmp() -> None:
    core = _core(policy="ark")
    for k in range(3):  # another host holds paths 0-2: one free path is left
        core.receive(Reserve((1, k + 1), 0.0, 1, 9, 4791, k, 49152 + k, 10**9, 1e11), 0.0)
    decs = core.request_split(8, 2 * 10**9, 0.001, 2)
    assert decs[0].reserved and decs[0].path == 3 and not decs[0].shared
    assert not decs[1].reserved and decs[1].fallback and decs[1].why == "no free path"


def test_split_needs_a_sane_part_count() -> None:
    with pytest.raises(CoreError, match="parts: must be 1..64"):
        _core().request_split(8, 10**9, 0.0, 0)


def test_a_receiver_applies_split_parts_like_any_reservation() -> None:
    owner, peer = _core(0), _core(1)
    for d in owner.request_split(8, 2 * 10**9, 1.0, 2):
        for m in d.messages:
            peer.receive(m, 1.0)
    assert peer.table() == owner.table()


def test_a_release_later_than_the_grace_does_not_stall_the_timer() -> None:
    t = ReservationTable(PAPER, policy="ark")
    t.receive(Reserve((1, 1), 0.0, 1, 9, 4791, 0, 49152, 10**9, 1e11))
    t.tick(2.0)  # the grace has passed well beyond 0.5 s
    t.receive(Release((1, 1), 0.5))  # a RELEASE delayed by more than the grace
    now = t.next_deadline()
    assert now <= 2.0
    t.tick(max(now, 2.0))
    assert t.next_deadline() > 2.0
    assert t.table() == {}
