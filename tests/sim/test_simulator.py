from __future__ import annotations

import math

import numpy as np
import pytest

from ark.core.flows import FlowSpec
from ark.core.topology import preset, spine_leaf
from ark.sim.engine import FluidSim, SimError
from ark.sim.maxmin import maxmin_rates


def test_maxmin_hand_cases() -> None:
    # Two flows on one 10-unit link: 5 each.
    assert maxmin_rates([(0,), (0,)], [10.0]) == [5.0, 5.0]
    # Classic: A uses links 0,1; B uses 0; C uses 1. cap0=10, cap1=4 -> A=2, C=2, B=8.
    assert maxmin_rates([(0, 1), (0,), (1,)], [10.0, 4.0]) == pytest.approx([2.0, 8.0, 2.0])
    # Three flows through a 9-link, one also through a 1-link: 1, 4, 4.
    assert maxmin_rates([(0, 1), (0,), (0,)], [9.0, 1.0]) == pytest.approx([1.0, 4.0, 4.0])
    # Parking lot: long flow over links 0,1,2, a short flow on each: all 0.5.
    r = maxmin_rates([(0, 1, 2), (0,), (1,), (2,)], [1.0, 1.0, 1.0])
    assert r == pytest.approx([0.5, 0.5, 0.5, 0.5])


@pytest.mark.parametrize("scheme", ["ecmp", "ark", "ark-balance", "spray"])
def test_lone_flow_fct_is_size_over_rate(scheme: str) -> None:
    fab = preset("paper")
    size = 2_000_000_000
    res = FluidSim(fab, scheme, seed=1).run([FlowSpec(0, 0, 8, size, 0.5)])
    rate = 100e9 * fab.efficiency / 8
    assert res.flows[0].fct_s == pytest.approx(size / rate, rel=1e-9)
    assert res.path_mismatches == 0


def test_two_flows_same_spine_share_and_ark_separates_them() -> None:
    fab = preset("paper")
    one = 10**9 / (100e9 * fab.efficiency / 8)
    flows = [FlowSpec(0, 0, 8, 10**9, 0.0), FlowSpec(1, 1, 9, 10**9, 0.001)]
    ark = FluidSim(fab, "ark", seed=0).run(flows)
    assert [f.path for f in ark.flows] == [0, 1] and ark.races == 0
    assert all(f.fct_s == pytest.approx(one, rel=1e-9) for f in ark.flows)
    # Same instant on two hosts: both take spine 0, share it for one control-plane delay,
    # then the larger key is re-pathed.
    flows = [FlowSpec(0, 0, 8, 10**9, 0.0), FlowSpec(1, 1, 9, 10**9, 0.0)]
    ark = FluidSim(fab, "ark", seed=0, control_delay_s=20e-6).run(flows)
    assert sorted(f.path for f in ark.flows) == [0, 1] and ark.races == 1
    assert ark.flows[1].repaths == 1 and ark.path_mismatches == 0
    assert ark.flows[0].fct_s == pytest.approx(one + 10e-6, rel=1e-6)
    # Under ECMP both may hash onto one spine and then each gets half of it.
    same = FluidSim(fab, "spray", seed=0).run(flows)
    assert all(f.fct_s == pytest.approx(one) for f in same.flows)


def test_ark_paths_match_switch_hash_and_races_happen_with_slow_control_plane() -> None:
    fab = preset("paper")
    rng = np.random.default_rng(3)
    starts = np.sort(rng.uniform(0, 2.0, 300))
    flows = [FlowSpec(i, i % 8, 8 + (i * 3) % 8, int(rng.integers(10**8, 10**9)), float(t)) for i, t in enumerate(starts)]
    res = FluidSim(fab, "ark", seed=0, control_delay_s=5e-3).run(flows)
    assert res.path_mismatches == 0
    assert res.races > 0  # a 5 ms control plane makes concurrent requests collide
    assert all(math.isfinite(f.fct_s) and f.fct_s > 0 for f in res.flows)


def test_simulator_is_deterministic() -> None:
    fab = preset("paper")
    rng = np.random.default_rng(5)
    flows = [FlowSpec(i, i % 8, 8 + i % 8, int(rng.integers(10**8, 3 * 10**9)), float(i) * 0.05) for i in range(200)]
    for scheme in ("ecmp", "ark-balance"):
        a = FluidSim(fab, scheme, seed=9).run(flows)
        b = FluidSim(fab, scheme, seed=9).run(flows)
        assert [f.finish_s for f in a.flows] == [f.finish_s for f in b.flows]
        assert [f.port for f in a.flows] == [f.port for f in b.flows]


def test_bad_scheme() -> None:
    with pytest.raises(SimError, match="scheme: must be one of ecmp, ark, ark-balance, spray, plb"):
        FluidSim(preset("paper"), "flowbender")


# ---------------------------------------------------------------------------------------
# Queueing theory: M/G/K processor sharing (spray) and M/G/1-PS per path (ECMP)
# ---------------------------------------------------------------------------------------
def _erlang_c(k: int, a: float) -> float:
    s = sum(a**i / math.factorial(i) for i in range(k))
    top = a**k / math.factorial(k) * k / (k - a)
    return top / (s + top)


def _poisson_flows(n: int, lam: float, mean_bytes: float, hosts: int, seed: int) -> list[FlowSpec]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / lam, n))
    size = rng.exponential(mean_bytes, n)
    # One sender and one receiver per flow (round-robin over many GPUs) so that only the
    # fabric, never a shared NIC, limits a flow: the model the formulas assume.
    return [FlowSpec(i, i % hosts, hosts + i % hosts, max(1, int(size[i])), float(t[i])) for i in range(n)]


THEORY_FAB = spine_leaf(leaves=2, spines=4, gpus_per_leaf=250, transport="ideal")
C_BYTES = 100e9 / 8
MEAN = 1e9
K, RHO = 4, 0.6
LAM = RHO * K * C_BYTES / MEAN


def test_spray_matches_mgk_processor_sharing() -> None:
    flows = _poisson_flows(30000, LAM, MEAN, 250, seed=11)
    res = FluidSim(THEORY_FAB, "spray", seed=0).run(flows[:])
    a = LAM * MEAN / C_BYTES
    expect = (MEAN / C_BYTES) * (1 + _erlang_c(K, a) / (K * (1 - RHO)))
    got = float(np.mean([f.fct_s for f in res.flows[1000:]]))
    assert got == pytest.approx(expect, rel=0.05)


def test_random_ecmp_matches_mg1_processor_sharing() -> None:
    flows = _poisson_flows(30000, LAM, MEAN, 250, seed=12)
    res = FluidSim(THEORY_FAB, "ecmp", seed=0).run(flows)
    expect = (MEAN / C_BYTES) / (1 - RHO)
    got = float(np.mean([f.fct_s for f in res.flows[1000:]]))
    assert got == pytest.approx(expect, rel=0.05)
