"""The connection schemes (ark.sim.connections): long-lived connections per peer pair,
placed by ARK when they open (``ark-conn``) or hashed from random ports (``ecmp-conn``)."""

from __future__ import annotations

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.pathmap import PathMapCache
from ark.core.topology import preset
from ark.sim.balancers import ConnParams, SchemeParams
from ark.sim.config import from_dict
from ark.sim.connections import Connections
from ark.sim.engine import FluidSim
from ark.sim.experiment import RunSpec, run_one

PAPER = preset("paper")


def _pool(scheme: str, per_pair: int, idle_s: float = 1.0) -> Connections:
    rng = np.random.default_rng(0)
    return Connections(PAPER, scheme, PathMapCache(PAPER, lazy=True), 4791, per_pair=per_pair, idle_s=idle_s,
                       random_port=lambda: int(rng.integers(49152, 65536)))


def _paths(src: int, dst: int, ports: list[int]) -> list[int]:
    from ark.core.pathmap import switch_path

    return [switch_path(PAPER, src, dst, p, 4791) for p in ports]


def test_a_pairs_connections_sit_on_distinct_paths_and_the_fabrics_stay_level() -> None:
    pool = _pool("ark-conn", 2)
    for src in range(8):  # every host of leaf 0 to one host of leaf 1
        ports = pool.take(src, 8 + src, 0.0)
        assert len(set(_paths(src, 8 + src, ports))) == 2  # the switches hash each port onto its own path
    load = pool.load()
    ups = [load.get(PAPER.uplink(0, k), 0) for k in range(PAPER.n_spines)]
    assert sum(ups) == 16 and max(ups) - min(ups) == 0  # 16 connections over 4 uplinks: 4 each


def test_ecmp_connections_are_hashed_and_pile_up_somewhere() -> None:
    pool = _pool("ecmp-conn", 2)
    per_path = [0] * PAPER.n_spines
    for src in range(8):
        for p in _paths(src, 8 + src, pool.take(src, 8 + src, 0.0)):
            per_path[p] += 1
    assert sum(per_path) == 16 and max(per_path) - min(per_path) >= 2  # this seed's draw: uneven
    assert pool.load() == {}


def test_idle_connections_close_and_the_next_transfer_opens_new_ones() -> None:
    pool = _pool("ark-conn", 2, idle_s=0.5)
    first = pool.take(0, 8, 0.0)
    assert pool.take(0, 8, 0.1) == first  # a second transfer at once shares them
    pool.release(0, 8, 0.2)
    pool.release(0, 8, 0.3)
    assert pool.take(0, 8, 0.7) == first and pool.closed == 0  # idle 0.4 s: kept
    pool.release(0, 8, 0.7)
    pool.take(1, 9, 1.3)  # idle 0.6 s by now: (0, 8) closes and its paths count free
    assert pool.closed == 2 and pool.opened == 4
    assert sum(pool.load().values()) == 2 * 2  # (1, 9)'s two connections, two reservable links each


def test_every_transfer_stripes_over_its_pairs_connections() -> None:
    params = SchemeParams(conn=ConnParams(connections=3))
    flows = [FlowSpec(i, i % 8, 8 + i % 8, 50_000_000, 0.001 * i) for i in range(40)]
    sim = FluidSim(PAPER, "ark-conn", params=params, seed=3)
    res = sim.run(flows)
    assert all(r.finish_s is not None and r.finish_s > r.start_s for r in res.flows)
    assert sim._conns is not None and sim._conns.opened == 8 * 3  # one set per pair, kept between its transfers


def test_placed_connections_beat_hashed_ones_and_runs_are_deterministic() -> None:
    cfg = from_dict({"workload": {"requests": 300}})
    ark = [run_one(cfg, RunSpec("ark-conn", 25.0, s)).record for s in (0, 1)]
    ecmp = [run_one(cfg, RunSpec("ecmp-conn", 25.0, s)).record for s in (0, 1)]
    assert np.mean([r["fct_mean_s"] for r in ark]) < 0.95 * np.mean([r["fct_mean_s"] for r in ecmp])
    again = run_one(cfg, RunSpec("ark-conn", 25.0, 0)).record
    assert again == ark[0]
