"""Incremental max-min (FairShares) against progressive filling from scratch."""

from __future__ import annotations

import random

import pytest

from ark.sim.maxmin import FairShares, maxmin_rates


@pytest.mark.parametrize("seed", range(40))
def test_incremental_rates_equal_a_full_recomputation_after_every_change(seed: int) -> None:
    rng = random.Random(seed)
    n_links = rng.randint(2, 30)
    cap = [rng.choice([1.0, 2.0, rng.uniform(0.5, 3.0)]) for _ in range(n_links)]
    shares = FairShares(cap)
    active: dict[int, tuple[int, ...]] = {}
    next_id = 0
    for _ in range(150):
        if rng.random() < 0.55 or not active:
            for _ in range(rng.choice([1, 1, 2, 3])):  # several changes before one update
                links = tuple(rng.sample(range(n_links), rng.randint(1, min(4, n_links))))
                shares.add(next_id, links)
                active[next_id] = links
                next_id += 1
        else:
            gone = rng.choice(list(active))
            shares.remove(gone)
            del active[gone]
        changed = shares.update()
        ids = list(active)
        full = maxmin_rates([active[i] for i in ids], cap)
        assert [shares.rate[i] for i in ids] == pytest.approx(full, rel=1e-9, abs=1e-12)
        assert set(changed) <= set(active)


def test_a_change_in_one_component_leaves_the_other_alone() -> None:
    shares = FairShares([10.0, 10.0, 10.0, 10.0])
    shares.add(0, (0, 1))
    shares.add(1, (2, 3))
    assert shares.update() == {0: 10.0, 1: 10.0}
    shares.add(2, (0,))
    assert shares.update() == {0: 5.0, 2: 5.0}  # flow 1 shares no link: not even looked at
    assert shares.recomputed == 2 + 2


def test_the_ripple_stops_where_rates_stop_changing() -> None:
    # Flow 0 is limited by link 0 (shared with flow 1); flow 2 shares link 1 with flow 0
    # but link 1 is nobody's bottleneck: a change on link 2 reaches flow 2 only.
    shares = FairShares([2.0, 100.0, 50.0])
    shares.add(0, (0, 1))
    shares.add(1, (0,))
    shares.add(2, (1, 2))
    shares.update()
    assert (shares.rate[0], shares.rate[2]) == (1.0, 50.0)
    before = shares.recomputed
    shares.add(3, (2,))
    assert shares.update() == {2: 25.0, 3: 25.0}
    assert shares.recomputed - before == 2
