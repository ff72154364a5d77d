"""The placement rule of connection-level leases (ark.core.connections)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ark.core.connections import MAX_CONNECTIONS, place_connections
from ark.core.table import CoreError


def test_one_pairs_connections_take_distinct_paths_before_any_repeats() -> None:
    paths = [(10,), (11,), (12,), (13,)]
    assert place_connections(paths, {}, 4) == [0, 1, 2, 3]
    assert place_connections(paths, {}, 6) == [0, 1, 2, 3, 0, 1]
    assert place_connections([(1,), (2,)], {}, 5) == [0, 1, 0, 1, 0]
    assert place_connections([()], {}, 3) == [0, 0, 0]  # one leaf: one path


def test_the_least_loaded_links_win_most_loaded_link_first() -> None:
    # Path 0's worst link carries 3, path 1's 2, path 2's 1 (but its sum is the largest of those two).
    paths = [(1, 4), (2, 5), (3, 6)]
    load = {1: 3, 2: 2, 5: 0, 3: 1, 6: 1}
    assert place_connections(paths, load, 1) == [2]
    assert place_connections(paths, load, 2) == [2, 1]
    assert load == {1: 3, 2: 2, 5: 0, 3: 1, 6: 1}  # the caller counts what it opens


@given(st.lists(st.integers(0, 20), min_size=2, max_size=8), st.integers(1, 16))
def test_the_chosen_paths_level_the_load(base: list[int], k: int) -> None:
    """Each pick goes to a path whose load, counting the picks before it, is the lowest of
    the paths still free in its round: the spread never grows beyond what the load was."""
    paths = [(i,) for i in range(len(base))]
    load = dict(enumerate(base))
    picks = place_connections(paths, load, k)
    n = len(paths)
    for r in range(0, k, n):
        rnd = picks[r:r + n]
        assert len(set(rnd)) == len(rnd)
    now = dict(load)
    for i in picks:
        now[i] += 1
    assert max(now.values()) - min(now.values()) <= max(1, max(base) - min(base))


@pytest.mark.parametrize("k", [0, MAX_CONNECTIONS + 1])
def test_counts_out_of_range_are_one_line(k: int) -> None:
    with pytest.raises(CoreError, match=rf"^connections: must be 1..{MAX_CONNECTIONS}; got {k}$"):
        place_connections([(1,)], {}, k)
    with pytest.raises(CoreError, match="^paths: a pair has at least one path$"):
        place_connections([], {}, 1)
