"""Dropping idle peers' port buckets (and a bounded map cache) changes no decision."""

from __future__ import annotations

import random

import pytest

from ark.core.pathmap import PathMapCache, PathMapError
from ark.core.protocol import ArkCore, CoreError
from ark.core.topology import spine_leaf


def _decisions(max_idle: int | None, capacity: int | None) -> list[tuple[int, int, bool]]:
    fab = spine_leaf(leaves=2, spines=2, gpus_per_leaf=4)
    core = ArkCore(0, fab, PathMapCache(fab, capacity=capacity), max_idle_peers=max_idle, seed=3)
    rng = random.Random(7)
    live: list = []
    out = []
    for step in range(400):
        if live and rng.random() < 0.5:
            core.release(live.pop(rng.randrange(len(live))), float(step))
        else:
            dec = core.request(rng.choice([4, 5, 6, 7]), 10**9, float(step))
            live.append(dec.flow)
            out.append((dec.path, dec.port, dec.fallback))
    return out


def test_evicting_idle_buckets_keeps_every_decision() -> None:
    ref = _decisions(None, None)
    assert any(f for _, _, f in ref)  # fallbacks happen: random ports that must not collide differently
    assert _decisions(0, 1) == ref
    assert _decisions(2, 3) == ref


def test_bad_limits_are_refused() -> None:
    fab = spine_leaf(leaves=2, spines=2, gpus_per_leaf=1)
    with pytest.raises(CoreError, match="max_idle_peers"):
        ArkCore(0, fab, PathMapCache(fab), max_idle_peers=-1)
    with pytest.raises(PathMapError, match="capacity"):
        PathMapCache(fab, capacity=0)
