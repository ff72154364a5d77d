"""Transfers of several sub-flows, chunked transfers, skewed clocks and in-band control."""

from __future__ import annotations

import numpy as np
import pytest

from ark.core.flows import FlowSpec
from ark.core.topology import preset
from ark.sim.balancers import SchemeParams, SplitParams
from ark.sim.engine import SCHEMES, FluidSim, SimError
from ark.sim.maxmin import FairShares, maxmin_rates

PAPER = preset("paper")
RATE = 100e9 * PAPER.efficiency / 8


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_lone_chunked_flow_takes_its_bytes_plus_the_gaps(scheme: str) -> None:
    size, chunks, gap = 3_200_000_000, 32, 200e-6
    res = FluidSim(PAPER, scheme, seed=1, chunks=chunks, chunk_gap_s=gap).run([FlowSpec(0, 0, 8, size, 0.5)])
    assert res.flows[0].fct_s == pytest.approx(size / RATE + (chunks - 1) * gap, rel=1e-9)
    assert res.path_mismatches == 0


@pytest.mark.parametrize("scheme", ["ark-split", "ecmp-split"])
def test_sub_flows_drain_one_transfer_together(scheme: str) -> None:
    # Alone, the NIC limits the transfer whatever the paths its parts take.
    sim = FluidSim(PAPER, scheme, seed=2, params=SchemeParams(split=SplitParams(parts=3)))
    res = sim.run([FlowSpec(0, 0, 8, 10**9, 0.0)])
    assert res.flows[0].fct_s == pytest.approx(10**9 / RATE, rel=1e-9) and res.path_mismatches == 0


def test_ark_split_parts_beside_a_long_transfer_run_at_the_nic_rate() -> None:
    """Beside a long transfer whose parts hold three spines, a new transfer's parts take
    the free spine and share the others, and the NIC, not a spine, limits it."""
    flows = [FlowSpec(0, 1, 9, 10**10, 0.0), FlowSpec(1, 0, 8, 10**9, 0.001)]
    ark = FluidSim(PAPER, "ark-split", seed=0).run(flows)
    assert ark.path_mismatches == 0
    assert ark.flows[1].fct_s == pytest.approx(10**9 / RATE, rel=1e-6)


def test_new_schemes_are_deterministic() -> None:
    rng = np.random.default_rng(5)
    flows = [FlowSpec(i, i % 8, 8 + i % 8, int(rng.integers(10**8, 3 * 10**9)), float(i) * 0.03) for i in range(150)]
    for scheme in ("plb", "letflow", "conga", "hedera", "ark-split", "ecmp-split"):
        runs = [FluidSim(PAPER, scheme, seed=9, chunks=4, chunk_gap_s=2e-4).run(flows) for _ in range(2)]
        assert [f.finish_s for f in runs[0].flows] == [f.finish_s for f in runs[1].flows]


def test_skewed_clocks_and_in_band_control_keep_every_reservation_honest() -> None:
    rng = np.random.default_rng(3)
    starts = np.sort(rng.uniform(0, 2.0, 300))
    flows = [FlowSpec(i, i % 8, 8 + (i * 3) % 8, int(rng.integers(10**8, 10**9)), float(t)) for i, t in enumerate(starts)]
    plain = FluidSim(PAPER, "ark", seed=0, control_delay_s=1e-3).run(flows)
    skewed = FluidSim(PAPER, "ark", seed=0, control_delay_s=1e-3, clock_skew_s=50e-3).run(flows)
    for res in (plain, skewed):
        assert res.path_mismatches == 0 and all(np.isfinite(f.fct_s) for f in res.flows)
    assert skewed.races > plain.races  # a host whose clock runs ahead loses races it would have won
    with pytest.raises(SimError, match="shared_table: needs"):
        FluidSim(PAPER, "ark", clock_skew_s=1e-3, shared_table=True)


def test_in_band_control_waits_behind_the_data_queues() -> None:
    """Ten flows from leaf 0 on four spines: shared uplinks hold standing queues, and a
    RESERVE towards leaf 1 crossing one waits queue / capacity there; without data, or on
    a separate network, it takes the plain delay."""
    flows = [FlowSpec(i, i % 8, 8 + i % 8, 2 * 10**9, 0.001 * i) for i in range(10)]
    queue, delay = 1e6, 20e-6
    inband = FluidSim(PAPER, "ark-balance", seed=0, control_on_data=True, data_queue_bytes=queue).run(flows)
    # In band but with no standing queue: every delivery is measured, and each takes the delay.
    unqueued = FluidSim(PAPER, "ark-balance", seed=0, control_on_data=True, data_queue_bytes=0.0).run(flows)
    assert unqueued.control_messages > 0
    assert unqueued.control_delay_max_s == pytest.approx(delay, rel=1e-12)
    assert unqueued.control_delay_mean_s == pytest.approx(delay, rel=1e-9)
    hop = queue / RATE
    assert inband.control_delay_max_s == pytest.approx(delay + hop, rel=1e-9)
    assert delay < inband.control_delay_mean_s < delay + hop
    assert inband.path_mismatches == 0


def test_fair_shares_follow_capacity_changes() -> None:
    r = np.random.default_rng(0)
    for _ in range(300):
        caps = r.uniform(1, 10, 6).tolist()
        fs, flows = FairShares(caps), {}
        for step in range(15):
            op = r.random()
            if op < 0.5 or not flows:
                flows[step] = tuple(sorted(r.choice(6, r.integers(1, 4), replace=False).tolist()))
                fs.add(step, flows[step])
            elif op < 0.75:
                fid = list(flows)[r.integers(len(flows))]
                del flows[fid]
                fs.remove(fid)
            else:
                lk = int(r.integers(6))
                caps[lk] = float(r.uniform(0.5, 10))
                fs.set_capacity(lk, caps[lk])
            fs.update()
            ids = list(flows)
            assert [fs.rate[i] for i in ids] == pytest.approx(maxmin_rates([flows[i] for i in ids], caps), rel=1e-6)
