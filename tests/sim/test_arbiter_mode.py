"""The simulator's arbiter control mode: one real ``Arbiter`` decides for every host, a
request round trip after each flow arrives (``[network] control = "arbiter"``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ark.core.flows import FlowSpec
from ark.core.topology import preset
from ark.sim.arbiter_control import ArbiterControl
from ark.sim.balancers import SchemeParams, SplitParams
from ark.sim.config import ConfigError, from_dict
from ark.sim.engine import FluidSim, SimError
from ark.sim.experiment import RunSpec, run_one, run_sweep, write_results
from ark.sim.failure import LinkChange
from ark.sim.racewindow import markdown, race_config, race_points, run_race_window

PAPER = preset("paper")  # 2 leaves x 8 hosts, 4 spines: 4 paths between leaves
ARBITER = {"control": "arbiter", "arbiter_rtt_us": 200}


def small(network: dict[str, Any], schemes: tuple[str, ...] = ("ark", "ark-split"), requests: int = 80) -> dict[str, Any]:
    return {"workload": {"requests": requests, "qps": [25]}, "experiment": {"schemes": list(schemes), "seeds": 1},
            "network": network}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"network": {"control": "central"}}, "network.control: must be one of broadcast, arbiter; got 'central'"),
        ({"network": {"arbiter_rtt_us": -1}}, "network.arbiter_rtt_us: must be >= 0; got -1"),
        ({"network": {"arbiter_rtt_us": "fast"}}, "network.arbiter_rtt_us: must be a number; got 'fast'"),
        ({"network": {"arbiter_rtt_us": math.inf}}, "network.arbiter_rtt_us: must be <= 1000000000000000; got inf"),
        ({"network": {"control": "arbiter", "control_jitter_us": 5}},
         'network.control: "arbiter" models one request round trip (arbiter_rtt_us) only; set control_jitter_us = 0, '
         'clock_skew_us = 0 and control_path = "separate"'),
        ({"network": ARBITER, "experiment": {"schemes": ["ark-split"]}, "params": {"split": {"parts": 17}}},
         'network.control: "arbiter" grants at most 16 parts per request; params.split.parts is 17'),
        ({"network": ARBITER, "failure": {"leaf": 0, "spine": 1, "at_s": 1.0}},
         'network.control: "arbiter" does not model a link failure (the hosts would ask again); leave [failure] out '
         "or give it a fraction"),
    ],
)
def test_bad_values_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert str(e.value) == message


def test_defaults_and_the_simulators_own_checks() -> None:
    net = from_dict({}).network
    assert (net.control, net.arbiter_rtt_us) == ("broadcast", 200.0)
    # Schemes without a control plane, or a link that only degrades, are fine under the arbiter.
    from_dict({"network": ARBITER, "experiment": {"schemes": ["ecmp"]}, "failure": {"leaf": 0, "spine": 1, "at_s": 1}})
    from_dict({"network": ARBITER, "failure": {"leaf": 0, "spine": 1, "at_s": 1.0, "fraction": 0.5}})
    with pytest.raises(SimError, match=r"^control: must be one of broadcast, arbiter; got 'x'$"):
        FluidSim(PAPER, "ark", control="x")
    with pytest.raises(SimError, match=r"^arbiter_rtt_us: must be a finite number >= 0"):
        FluidSim(PAPER, "ark", control="arbiter", arbiter_rtt_s=math.nan)
    with pytest.raises(SimError, match="link failure"):
        FluidSim(PAPER, "ark", control="arbiter", change=LinkChange(leaf=0, spine=1, at_s=1.0))


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    cfg = from_dict(small(ARBITER))
    files = []
    for k in range(2):
        sweep = run_sweep(cfg)
        out = tmp_path / str(k)
        write_results(out, sweep, cfg)
        files.append(((out / "results.json").read_bytes(), json.dumps(sweep.records).encode()))
        assert {r["control"] for r in sweep.records} == {"arbiter"}
        assert {r["arbiter_rtt_s"] for r in sweep.records} == {200e-6}
    assert files[0] == files[1]


def test_one_decider_never_races() -> None:
    """24 prefill hosts decide concurrently against one decode leaf: broadcast with a slow
    control plane races, the arbiter with a slow round trip does not."""
    base: dict[str, Any] = msgspec.to_builtins(race_config(requests=150, seeds=1))
    bcast = run_one(from_dict({**base, "network": {"control_delay_us": 30_000}}), RunSpec("ark", 25.0, 0)).record
    arb = run_one(from_dict({**base, "network": {"control": "arbiter", "arbiter_rtt_us": 60_000}}),
                  RunSpec("ark", 25.0, 0)).record
    assert bcast["races"] > 0 and bcast["control"] == "broadcast"
    assert arb["races"] == 0 and arb["race_moved"] == 0 and arb["path_mismatches"] == 0
    assert arb["control"] == "arbiter" and arb["control_delay_mean_s"] == pytest.approx(30e-3)
    assert arb["control_messages"] == 2 * arb["requests"] - arb["fallbacks"]  # an Ask each, a Drop each reserved


def test_ark_split_parts_take_distinct_paths() -> None:
    params = SchemeParams(split=SplitParams(parts=3))
    flows = [FlowSpec(0, 0, 8, 10**9, 0.0)]
    res = FluidSim(PAPER, "ark-split", seed=1, params=params, control="arbiter", arbiter_rtt_s=0.0).run(flows)
    assert sorted(res.max_concurrent_per_spine) == [0, 1, 1, 1]  # three parts, three spines
    assert res.control_messages == 2 and res.races == 0 and res.path_mismatches == 0
    # A second transfer while the first holds three paths: its first part takes the fourth.
    both = [*flows, FlowSpec(1, 1, 9, 10**9, 1e-4)]
    res = FluidSim(PAPER, "ark-split", seed=1, params=params, control="arbiter", arbiter_rtt_s=0.0).run(both)
    assert res.flows[1].path == 3 and res.flows[1].reserved
    assert res.max_concurrent_per_spine.count(2) == 2  # 6 parts on 4 spines: two share, none holds 3


@pytest.mark.parametrize("scheme", ["ark", "ark-split"])
def test_zero_round_trip_matches_broadcast_at_zero_delay(scheme: str) -> None:
    recs = [run_one(from_dict(small(net, (scheme,), 150)), RunSpec(scheme, 25.0, 0)).record
            for net in ({"control_delay_us": 0}, {"control": "arbiter", "arbiter_rtt_us": 0})]
    assert [r["control"] for r in recs] == ["broadcast", "arbiter"]
    assert recs[1]["fct_mean_s"] == pytest.approx(recs[0]["fct_mean_s"], rel=0.01)
    assert recs[1]["races"] == 0


def test_the_flow_starts_a_round_trip_after_it_arrives() -> None:
    """The Ask reaches the arbiter rtt/2 after the arrival, which decides then; the flow starts
    when the grant is back (rtt); the Drop lands rtt/2 after the completion."""
    rtt, t0 = 1e-3, 0.5
    flows = [FlowSpec(0, 0, 8, 2 * 10**9, t0)]
    bcast = FluidSim(PAPER, "ark", seed=1).run(flows).flows[0]
    sim = FluidSim(PAPER, "ark", seed=1, control="arbiter", arbiter_rtt_s=rtt)
    arb = sim.run(flows).flows[0]
    assert arb.start_s == bcast.start_s == t0  # FCT counts from the arrival: the wait is in it
    assert arb.fct_s == pytest.approx(bcast.fct_s + rtt, abs=1e-12)
    assert arb.reserved and arb.path == bcast.path == 0
    assert isinstance(sim.control_plane, ArbiterControl)
    table = sim.control_plane.arbiter.table
    (flow,) = table.entries()
    entry = table.get(flow)
    assert entry is not None and entry.msg.ts == pytest.approx(t0 + rtt / 2, abs=1e-12)
    assert entry.released == pytest.approx(arb.finish_s + rtt / 2, abs=1e-12)


def test_a_path_stays_held_until_the_drop_lands() -> None:
    """A's path is free for B once A's Drop has reached the arbiter (A's completion, which
    itself came a round trip late, plus half a round trip), not before."""
    one = 10**9 / (100e9 * PAPER.efficiency / 8)  # A alone on its path
    rtt = 1e-3
    flows = [FlowSpec(0, 0, 8, 10**9, 0.0), FlowSpec(1, 1, 9, 10**9, one + rtt + 1e-5)]
    bcast = FluidSim(PAPER, "ark", seed=0, control_delay_s=0.0).run(flows)
    arb = FluidSim(PAPER, "ark", seed=0, control="arbiter", arbiter_rtt_s=rtt).run(flows)
    assert [f.path for f in bcast.flows] == [0, 0]  # A finished at `one`: path 0 free again
    # A finishes at one + rtt; its Drop lands at one + 1.5 rtt, after B's Ask (one + 1.5 rtt + 10 us): free.
    assert [f.path for f in arb.flows] == [0, 0]
    late = [FlowSpec(0, 0, 8, 10**9, 0.0), FlowSpec(1, 1, 9, 10**9, one + rtt - 1e-5)]
    arb = FluidSim(PAPER, "ark", seed=0, control="arbiter", arbiter_rtt_s=rtt).run(late)
    assert arb.flows[1].path == 1 and arb.flows[1].reserved  # A's Drop (one + 1.5 rtt) is not in yet


def test_the_host_places_a_grant_as_an_agent_does() -> None:
    """Each host's own core places the arbiter's answer (ArkCore.place): with two source
    ports, no host has a port of every path; a granted path with none here goes out as
    plain ECMP and its reservation is dropped at once (before, the flow counted as reserved
    on a path it never took, held there until it ended)."""
    rtt = 1e-4
    flows = [FlowSpec(i, i, 8 + i, 10**9, 0.0) for i in range(4)]  # paths 0-3 granted at once
    sim = FluidSim(PAPER, "ark", seed=1, control="arbiter", arbiter_rtt_s=rtt, port_range=(49152, 49153))
    res = sim.run(flows)
    assert res.path_mismatches == 0
    assert [(f.reserved, f.fallback) for f in res.flows] == [(True, False)] + [(False, True)] * 3
    assert isinstance(sim.control_plane, ArbiterControl)
    table = sim.control_plane.arbiter.table
    entries = [table.get(f) for f in table.entries()]
    dropped = [e for e in entries if e is not None and e.path != 0]
    assert len(dropped) == 3 and all(e.released == pytest.approx(1.5 * rtt) for e in dropped)
    # Within a leaf: path 0's next port, not a fallback, as a broadcast core places it.
    same = [FlowSpec(0, 0, 1, 10**9, 0.0), FlowSpec(1, 0, 1, 10**9, 0.0)]
    arb = FluidSim(PAPER, "ark", seed=1, control="arbiter", arbiter_rtt_s=0.0).run(same)
    bcast = FluidSim(PAPER, "ark", seed=1, control_delay_s=0.0).run(same)
    assert [(f.path, f.reserved, f.fallback) for f in arb.flows] == [(f.path, False, False) for f in bcast.flows]
    assert arb.fallbacks == bcast.fallbacks == 0


def test_schemes_without_a_control_plane_ignore_the_mode() -> None:
    flows = [FlowSpec(0, 0, 8, 10**9, 0.0)]
    a = FluidSim(PAPER, "ecmp", seed=1, control="arbiter").run(flows)
    b = FluidSim(PAPER, "ecmp", seed=1).run(flows)
    assert a.control == b.control == "none" and a.flows[0].fct_s == b.flows[0].fct_s


def test_race_window_arbiter_rows() -> None:
    cfg = race_config(requests=60, seeds=1)
    pts = race_points(delays=(10.0,), jitters=(), skews=(), queues=(), rtts=(0.0, 5000.0))
    rows = run_race_window(cfg, pts, ("ark",))
    arb = {r["rtt_us"]: r for r in rows if r["sweep"] == "arbiter"}
    assert set(arb) == {0.0, 5000.0}
    ref = next(r for r in rows if r["sweep"] == "reference")
    for r in arb.values():
        assert r["control"] == "arbiter" and r["scheme"] == "ark"
        assert r["races_per_1000"] == 0 and r["moved_per_1000"] == 0 and r["mismatches"] == 0
        assert r["fct_change"] == pytest.approx(r["fct_mean_s"] / ref["fct_mean_s"] - 1.0)
        assert r["control_delay_mean_us"] == pytest.approx(r["rtt_us"] / 2)
    assert arb[5000.0]["fct_mean_s"] > arb[0.0]["fct_mean_s"]  # every flow waits 5 ms more
    md = markdown(rows, ("ark",), cfg)
    assert "| arbiter RTT (us) |" in md and "| arbiter | — | 0 | 0 | — | 5000 | ark | 0.0 | 0.0 |" in md
