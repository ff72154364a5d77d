"""A leaf-spine link that fails or degrades mid-run: routes, maps, and every scheme on it."""

from __future__ import annotations

import numpy as np
import pytest

from ark.core.flows import FlowSpec
from ark.core.pathmap import ROCE_PORT_RANGE, switch_path
from ark.core.topology import preset, spine_leaf
from ark.sim.config import ConfigError, from_dict
from ark.sim.engine import FluidSim
from ark.sim.experiment import RunSpec, run_one
from ark.sim.failure import FailedRoutes, FailureError, LinkChange, parse_link_change

PAPER = preset("paper")
FOUR = spine_leaf(leaves=4, spines=4, gpus_per_leaf=2)
RATE = 100e9 * PAPER.efficiency / 8


def test_failed_groups_shrink_and_the_hash_never_picks_the_dead_spine() -> None:
    routes = FailedRoutes(FOUR, LinkChange(leaf=1, spine=2))
    assert routes.group(2, 6) == (0, 1, 3)  # from leaf 1
    assert routes.group(0, 2) == (0, 1, 3)  # towards leaf 1
    assert routes.group(0, 6) == (0, 1, 2, 3)  # leaves 0 -> 3 do not touch it
    assert routes.group(2, 3) == (0,)  # within the failed leaf: one path, no spine
    ports = range(ROCE_PORT_RANGE[0], ROCE_PORT_RANGE[0] + 4000)
    moved = sum(routes.switch_path(0, 2, p, 4791) != switch_path(FOUR, 0, 2, p, 4791) for p in ports)
    assert all(routes.switch_path(0, 2, p, 4791) != 2 for p in ports)
    assert moved > 2000  # modulo 3 instead of 4: most ports move, not only the dead spine's
    assert all(routes.switch_path(0, 6, p, 4791) == switch_path(FOUR, 0, 6, p, 4791) for p in ports)


def test_rebuilt_maps_agree_with_the_failed_switches() -> None:
    routes = FailedRoutes(FOUR, LinkChange(leaf=0, spine=1))
    pm = routes.pathmap(0, 6, 4791, ROCE_PORT_RANGE)
    assert pm.counts()[1] == 0 and sum(pm.counts()) == ROCE_PORT_RANGE[1] - ROCE_PORT_RANGE[0] + 1
    rng = np.random.default_rng(0)
    for p in rng.integers(*ROCE_PORT_RANGE, 300).tolist():
        assert pm.path_of(p) == routes.switch_path(0, 6, p, 4791)


def test_link_change_specs_and_checks() -> None:
    assert parse_link_change("0:2@20") == {"leaf": 0, "spine": 2, "at_s": 20.0, "fraction": 0.0}
    assert parse_link_change("1:3@7.5:0.25") == {"leaf": 1, "spine": 3, "at_s": 7.5, "fraction": 0.25}
    with pytest.raises(FailureError, match=r"^--fail-link: expected LEAF:SPINE@SECONDS\[:FRACTION\]"):
        parse_link_change("0-2@20")
    with pytest.raises(ConfigError, match=r"^failure.spine: must be 0..3; got 4$"):
        from_dict({"failure": {"spine": 4}})
    with pytest.raises(ConfigError, match=r"^failure.fraction: must be < 1"):
        from_dict({"failure": {"fraction": 1.5}})
    with pytest.raises(FailureError, match="2-tier"):
        LinkChange().check(preset("scale"))


def test_a_link_the_command_line_fails_is_down_whatever_the_file_says() -> None:
    degraded = from_dict({"failure": {"leaf": 1, "spine": 1, "at_s": 3.0, "fraction": 0.25}})
    down = degraded.with_overrides(failure=parse_link_change("0:2@20"))
    assert (down.failure.leaf, down.failure.spine, down.failure.at_s, down.failure.fraction) == (0, 2, 20.0, 0.0)


def test_a_degraded_link_slows_only_its_flows() -> None:
    change = LinkChange(leaf=0, spine=0, at_s=0.0, fraction=0.25)
    flows = [FlowSpec(0, 0, 8, 10**9, 0.1)]
    for scheme in ("ecmp", "ark"):
        res = FluidSim(PAPER, scheme, seed=0, change=change).run(flows)
        f = res.flows[0]
        expect = 10**9 / RATE / (0.25 if f.path == 0 else 1.0)
        assert f.fct_s == pytest.approx(expect, rel=1e-9)
    spray = FluidSim(PAPER, "spray", seed=0, change=change).run(flows).flows[0]
    assert spray.fct_s == pytest.approx(10**9 / RATE)  # the NIC still limits it


def test_ark_repaths_its_reservations_when_the_maps_are_rebuilt() -> None:
    """Fail the spine ARK's first flows sit on: the switches move them at once, the hosts
    rebuild their maps later and reserve again; afterwards every reservation is honest."""
    change = LinkChange(leaf=0, spine=0, at_s=0.5, detect_s=0.2)
    flows = [FlowSpec(i, i, 8 + i, 10**10, 0.01 * i) for i in range(6)]
    flows += [FlowSpec(6 + i, i, 8 + i, 10**9, 1.0 + 0.01 * i) for i in range(6)]
    for scheme in ("ark", "ark-balance", "ark-split"):
        res = FluidSim(PAPER, scheme, seed=1, change=change).run(flows)
        assert res.stale > 0 and res.rebuild_repathed > 0
        assert res.mismatches_after_rebuild == 0
        assert all(np.isfinite(f.fct_s) for f in res.flows)
        assert all(f.path != 0 for f in res.flows[6:])  # no flow after the failure crosses the dead spine


def test_every_scheme_sees_the_same_failure_and_reports_its_phases() -> None:
    cfg = from_dict({"workload": {"requests": 300}, "failure": {"leaf": 0, "spine": 1, "at_s": 6.0, "window_s": 1.0}})
    recs = {s: run_one(cfg, RunSpec(s, 20.0, 0)).record for s in ("ecmp", "plb", "letflow", "conga", "hedera",
                                                                    "ecmp-split", "ark", "ark-split", "oracle-path",
                                                                    "spray")}
    counts = {(r["flows_before"], r["flows_during"], r["flows_after"]) for r in recs.values()}
    assert len(counts) == 1 and min(next(iter(counts))) > 10
    for s, r in recs.items():
        assert r["fct_after_s"] > r["fct_before_s"], s  # a quarter of leaf 0's uplink capacity is gone
        assert r["path_mismatches"] == 0 or s.startswith("ark"), s
        if s.startswith("ark"):
            assert r["mismatches_after_rebuild"] == 0


@pytest.mark.parametrize("scheme", ["ecmp", "plb", "letflow", "conga", "hedera", "ecmp-split", "ark", "ark-balance",
                                    "ark-split", "oracle-path"])
def test_no_flow_crosses_the_dead_spine_after_the_failure(scheme: str) -> None:
    rng = np.random.default_rng(4)
    flows = [FlowSpec(i, i % 8, 8 + (i * 5) % 8, int(rng.integers(10**8, 2 * 10**9)), 0.02 * i) for i in range(120)]
    change = LinkChange(leaf=0, spine=1, at_s=0.5, detect_s=0.0)
    res = FluidSim(PAPER, scheme, seed=2, change=change).run(flows)
    late = [f for f in res.flows if f.finish_s > 0.5]
    assert late and all(f.path != 1 for f in late), [f.id for f in late if f.path == 1]
