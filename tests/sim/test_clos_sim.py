"""The simulator on a 3-tier Clos: switches hash hop by hop, ARK inverts every hop."""

from __future__ import annotations

import numpy as np
import pytest

from ark.core.clos import clos3
from ark.core.flows import FlowSpec
from ark.sim.engine import FluidSim

FAB = clos3(pods=4, leaves_per_pod=2, aggs_per_pod=4, cores_per_plane=2, gpus_per_leaf=8, oversubscription=(2.0, 1.0))


def _workload(n: int, rate: float, seed: int) -> list[FlowSpec]:
    rng = np.random.default_rng(seed)
    pre, dec = FAB.role_hosts("prefill"), FAB.role_hosts("decode")
    starts = np.cumsum(rng.exponential(1 / rate, n))
    return [FlowSpec(i, int(rng.choice(pre)), int(rng.choice(dec)), int(rng.integers(10**8, 2 * 10**9)),
                     float(starts[i])) for i in range(n)]


@pytest.fixture(scope="module")
def runs() -> dict[str, object]:
    flows = _workload(800, 60.0, 4)
    return {s: FluidSim(FAB, s, seed=1, control_delay_s=100e-6).run(flows) for s in ("ecmp", "ark", "ark-balance", "spray")}


def test_no_path_mismatch_with_a_seed_per_switch(runs) -> None:
    for s in ("ark", "ark-balance"):
        assert runs[s].path_mismatches == 0
        reserved = [f for f in runs[s].flows if f.reserved]
        assert len(reserved) > 400


def test_schemes_order_as_on_two_tiers(runs) -> None:
    mean = {s: float(np.mean([f.fct_s for f in r.flows])) for s, r in runs.items()}
    assert mean["spray"] <= mean["ark-balance"] * 1.001
    assert mean["ark"] < mean["ecmp"]
    assert mean["ark-balance"] <= mean["ark"] * 1.01


def test_core_switch_counts_cover_cross_pod_flows_only(runs) -> None:
    ecmp = runs["ecmp"]
    assert len(ecmp.max_concurrent_per_spine) == 8  # the core switches
    cross = [f for f in ecmp.flows if FAB.pod_of(f.src) != FAB.pod_of(f.dst)]
    assert 0 < len(cross) < len(ecmp.flows)
    assert sum(ecmp.max_concurrent_per_spine) >= max(ecmp.max_concurrent_per_spine) > 0


def test_a_lone_cross_pod_flow_runs_at_line_rate() -> None:
    size = 10**9
    rate = min(FAB.link_bps, FAB.core_link_bps, FAB.hosts[0].nic_bps) * FAB.efficiency / 8
    far = FAB.n_hosts - 1
    for s in ("ecmp", "ark", "spray"):
        res = FluidSim(FAB, s, seed=2).run([FlowSpec(0, 0, far, size, 0.0)])
        assert res.flows[0].fct_s == pytest.approx(size / rate, rel=1e-9)
