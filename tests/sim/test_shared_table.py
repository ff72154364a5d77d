"""One reservation table shared by every simulated host gives what one replica per host gives.

The shared table receives each message once, when every other host would; each core keeps
its own messages in flight and judges against "table + mine". Race-heavy workloads (slow
control planes, many flows starting at the same instant) on 2- and 3-tier fabrics must
produce the same paths, ports, reservations, re-paths, races and events, and the same
completion times up to float rounding (the order in which simultaneous re-paths reach the
rate computation can differ)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ark.core.clos import clos3
from ark.core.flows import FlowSpec
from ark.core.pathmap import PathMapCache
from ark.core.protocol import CoreError
from ark.core.shared_table import SharedTableCore
from ark.core.table import ReservationTable
from ark.core.topology import preset, spine_leaf
from ark.sim.engine import FluidSim, SimError

FABRICS = [
    preset("paper"),
    clos3(pods=2, leaves_per_pod=2, aggs_per_pod=2, cores_per_plane=2, gpus_per_leaf=4),
    spine_leaf(leaves=3, spines=3, gpus_per_leaf=3),
]


def _flows(seed: int, n_hosts: int) -> tuple[list[FlowSpec], float]:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 300))
    delay = float(rng.choice([20e-6, 1e-3, 5e-3, 2e-2]))
    starts = np.cumsum(rng.exponential(1 / float(rng.choice([20, 100, 400])), n))
    if rng.random() < 0.3:
        starts = np.round(starts, 2)  # many flows at the same instant
    flows = []
    for i in range(n):
        s = int(rng.integers(0, n_hosts))
        d = int(rng.integers(0, n_hosts - 1))
        flows.append(FlowSpec(i, s, d + (d >= s), int(rng.integers(10**6, 2 * 10**9)), float(starts[i])))
    return flows, delay


def _same_runs(seed: int, scheme: str) -> None:
    fab = FABRICS[seed % len(FABRICS)]
    flows, delay = _flows(seed, fab.n_hosts)
    own = FluidSim(fab, scheme, seed=seed, control_delay_s=delay, shared_table=False).run(flows)
    shared = FluidSim(fab, scheme, seed=seed, control_delay_s=delay, shared_table=True).run(flows)
    assert (own.races, own.fallbacks, own.path_mismatches, own.events, own.control_messages) == \
        (shared.races, shared.fallbacks, shared.path_mismatches, shared.events, shared.control_messages)
    assert own.max_concurrent_per_spine == shared.max_concurrent_per_spine
    for a, b in zip(own.flows, shared.flows, strict=True):
        assert (a.path, a.port, a.reserved, a.fallback, a.repaths) == (b.path, b.port, b.reserved, b.fallback, b.repaths)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("scheme", ["ark", "ark-balance"])
def test_shared_table_equals_one_replica_per_host(seed: int, scheme: str) -> None:
    _same_runs(seed, scheme)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 300))
def test_shared_table_equals_one_replica_per_host_many_seeds(seed: int) -> None:
    _same_runs(seed, "ark" if seed % 2 else "ark-balance")


def test_races_happen_in_these_workloads() -> None:
    races = 0
    for seed in range(6):
        fab = FABRICS[seed % len(FABRICS)]
        flows, delay = _flows(seed, fab.n_hosts)
        races += FluidSim(fab, "ark", seed=seed, control_delay_s=delay).run(flows).races
    assert races > 20


def test_a_shared_core_refuses_what_only_a_private_replica_does() -> None:
    fab = preset("paper")
    table = ReservationTable(fab)
    maps = PathMapCache(fab)
    core = SharedTableCore(0, table, maps)
    assert core.policy == table.policy and core.reservations is table
    dec = core.request(8, 10**9, 0.0)
    assert core.pending == 1 and dec.flow not in table
    with pytest.raises(CoreError, match="shares its table"):
        core.receive(dec.messages[0], 0.0)
    with pytest.raises(CoreError, match="not on a shared table"):
        core.unreserve(dec.flow, 0.0)
    assert core.tick(10.0) == [] and core.next_deadline() == math.inf  # the table's owner ticks the table
    with pytest.raises(CoreError, match="not a pending message"):
        core.delivered(dec.messages[0]._replace(ts=1.0))
    # a second host deciding before the first message arrives takes the same path
    other = SharedTableCore(1, table, maps)
    assert other.request(9, 10**9, 0.0).path == dec.path
    table.receive(dec.messages[0])
    assert core.delivered(dec.messages[0]) == [] and core.pending == 0 and dec.flow in table
    with pytest.raises(SimError, match="needs control_jitter_us = 0"):
        FluidSim(fab, "ark", control_jitter_s=1e-6, shared_table=True)
