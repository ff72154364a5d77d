"""The control-plane cost model: placements, scopes, per-agent counts, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ark.sim.control_cost import AgentCost, ControlPlaneError, fabric_for, measure, plan_for


def test_placements_pair_leaves_within_a_pod_across_pods_or_not_at_all() -> None:
    fab = fabric_for(256)  # 2 pods of 4 leaves: leaves 0, 1 and 4, 5 prefill
    pods = {h.index: h.leaf // 4 for h in fab.hosts}
    paired, cross, anyp = plan_for(fab, "paired"), plan_for(fab, "cross-pod"), plan_for(fab, "any")
    assert paired.fixed is not None and cross.fixed is not None and anyp.fixed is None
    assert len(paired.fixed) == len(cross.fixed) == len(anyp.senders) == 128
    assert all(fab.hosts[s].role == "prefill" and fab.hosts[d].role == "decode" for s, d in paired.fixed.items())
    assert all(pods[s] == pods[d] for s, d in paired.fixed.items())
    assert all(pods[s] != pods[d] for s, d in cross.fixed.items())
    assert len(set(paired.fixed.values())) == 128  # each decode GPU takes one prefill GPU's flows
    with pytest.raises(ControlPlaneError, match="cross-pod needs a 3-tier"):
        plan_for(fabric_for(16), "cross-pod")
    for bad in (8, 100, 300):
        with pytest.raises(ControlPlaneError, match="hosts: must be 16 or a multiple of 128"):
            fabric_for(bad)


def test_scoped_agents_hear_their_component_only_and_full_agents_hear_everyone() -> None:
    rows = {r.mode: r for r in measure(1024, "paired", flows=600)}
    full, scoped = rows["full"], rows["scoped"]
    # Paired leaves: a component is one prefill leaf's 32 GPUs; decode hosts need no agent.
    assert (full.agents, full.peers_max) == (1024, 1023) and (scoped.agents, scoped.peers_max) == (512, 31)
    assert scoped.received_per_s_max < full.received_per_s_max / 4
    assert full.cpu_percent_max / scoped.cpu_percent_max >= 4
    assert full.races_per_1000 == scoped.races_per_1000  # one run: the same decisions
    anyr = {r.mode: r for r in measure(256, "any", flows=300)}
    assert anyr["scoped"].peers_max == 127 and anyr["scoped"].received_per_s_max <= anyr["full"].received_per_s_max


def test_the_same_seed_gives_the_same_rows() -> None:
    assert measure(256, "cross-pod", flows=300, seed=3) == measure(256, "cross-pod", flows=300, seed=3)


def test_the_cost_model_adds_its_terms() -> None:
    c = AgentCost(per_message_us=10.0, per_copy_us=2.0, per_peer_heartbeat_us=50.0, base_percent=0.5)
    # 1000 msgs/s x 10 us + 10 sent/s x 7 peers x 2 us + 7 / 0.25 x 50 us = 10,000 + 140 + 1,400 us/s
    assert c.percent(1000.0, 10.0, 7, 0.25) == pytest.approx(0.5 + 11_540 / 1e4)


def test_cli_prints_json_and_refuses_bad_sizes(capsys) -> None:
    from ark.cli import main

    assert main(["bench", "control-plane", "--no-measure", "--hosts", "16,256", "--flows", "200",
                 "--placement", "paired", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {(r["hosts"], r["mode"]) for r in res["rows"]} == {(n, m) for n in (16, 256) for m in ("full", "scoped", "arbiter")}
    assert res["arbiter_targets"] is None and res["arbiter_cost"]["per_request_us"] > 0
    assert res["paired_cpu_cut"]["256"] > 1 and res["cost_source"].startswith("built-in")
    assert main(["bench", "control-plane", "--no-measure", "--hosts", "100"]) == 2
    assert "hosts: must be 16 or a multiple of 128" in capsys.readouterr().err


def _sim_sends(hosts: int, placement: str, flows: int, seed: int) -> tuple[list[int], float, list[int]]:
    """The messages each host sends in the run ``measure`` makes, the run's seconds, and
    the flows each host starts."""
    import numpy as np

    from ark.core.pathmap import PathMapCache
    from ark.sim.control_cost import PAPER_RATE_PER_GPU, flows_for
    from ark.sim.engine import FluidSim

    fab = fabric_for(hosts)
    plan = plan_for(fab, placement)
    seconds = flows / (len(plan.senders) * PAPER_RATE_PER_GPU)
    specs = flows_for(fab, plan, PAPER_RATE_PER_GPU, seconds, np.random.default_rng(seed))
    res = FluidSim(fab, "ark", seed=seed, control_delay_s=20e-6, pathmaps=PathMapCache(fab, capacity=4096)).run(specs)
    started = [sum(f.src == h for f in specs) for h in range(fab.n_hosts)]
    return res.messages_by_host, seconds, started


def test_arbiter_rows_for_every_size_and_placement() -> None:
    for hosts, placements in ((16, ("paired", "any")), (256, ("paired", "cross-pod", "any"))):
        for placement in placements:
            rows = {r.mode: r for r in measure(hosts, placement, flows=200)}
            assert set(rows) == {"full", "scoped", "arbiter"}
            arb, scoped = rows["arbiter"], rows["scoped"]
            assert arb.races_per_1000 == 0.0 and arb.peers_max == 1 and arb.agents == scoped.agents
            assert arb.arbiter_msgs_per_s is not None and arb.arbiter_cpu_percent is not None
            assert arb.agent_msgs_per_s_max is not None and arb.propagation_ms is not None
            assert arb.cpu_percent_max < scoped.cpu_percent_max  # one peer, no replica
            assert all(r.arbiter_msgs_per_s is None and r.arbiter_cpu_percent is None
                       for r in (rows["full"], scoped))


def test_an_arbiter_agent_sends_its_own_operations_and_receives_one_reply_each() -> None:
    from ark.sim.control_cost import ArbiterCost

    sent, seconds, started = _sim_sends(16, "any", 300, 2)
    arb = next(r for r in measure(16, "any", flows=300, seed=2) if r.mode == "arbiter")
    senders = plan_for(fabric_for(16), "any").senders
    # Every flow asks (reserved or not), every broadcast message is a request too: an upper bound.
    req = {h: (sent[h] + started[h]) / seconds for h in senders}
    assert sum(started) > 0
    keep = {h: max(0.0, 1.0 - req[h]) for h in senders}  # keepalive_s = 1
    assert sum(sent) > 0 and sum(sent[h] for h in senders) == sum(sent)  # only senders send
    assert arb.agent_msgs_per_s_max == pytest.approx(max(2 * (req[h] + keep[h]) for h in senders), abs=0.06)
    assert arb.received_per_s_max == pytest.approx(max(req.values()), abs=0.06)
    assert arb.heartbeats_per_s_max == pytest.approx(max(keep.values()), abs=0.06)
    total, keepalives, changes = sum(req.values()), sum(keep.values()), sum(sent) / seconds
    # requests in, replies out, keepalives both ways, one standby copy per change
    assert arb.arbiter_msgs_per_s == pytest.approx(2 * total + changes + 2 * keepalives, abs=0.06)
    assert arb.arbiter_cpu_percent == pytest.approx(ArbiterCost().percent(total, keepalives, changes), abs=6e-4)
    c = AgentCost()
    busiest = max(req[h] + keep[h] for h in senders)
    assert arb.cpu_percent_max == pytest.approx(c.base_percent + busiest * (c.per_copy_us + c.per_message_us) / 1e4,
                                                abs=6e-4)


def test_arbiter_cpu_grows_linearly_with_its_requests_and_races_are_zero() -> None:
    from ark.sim.control_cost import ArbiterCost, Row, _rows

    fab = fabric_for(16)
    senders = plan_for(fab, "any").senders
    arbiter = ArbiterCost(per_request_us=20.0, per_keepalive_us=5.0, per_replica_copy_us=2.0, base_percent=1.0)

    def arbiter_row(rate: float) -> Row:
        sent = [int(rate) if h in senders else 0 for h in range(16)]
        rows = _rows(fab, "any", sent, 1.0, 1000, 7, AgentCost(), 0.25, 20e-6, arbiter, 0.1)
        assert rows[0].races_per_1000 > 0  # broadcast raced in this run; the arbiter cannot
        return next(r for r in rows if r.mode == "arbiter")

    # 8 senders at 100 ops/s, 200, 400: above 1 / keepalive_s, so no keepalives
    rows = [arbiter_row(x) for x in (100, 200, 400)]
    assert all(r.races_per_1000 == 0.0 and r.heartbeats_per_s_max == 0.0 for r in rows)
    work = [(r.arbiter_cpu_percent or 0.0) - arbiter.base_percent for r in rows]
    assert work[0] == pytest.approx(800 * (20.0 + 2.0) / 1e4)
    assert work[1] == pytest.approx(2 * work[0]) and work[2] == pytest.approx(4 * work[0])
    assert [r.arbiter_msgs_per_s for r in rows] == [2400.0, 4800.0, 9600.0]
    # Below 1 / keepalive_s an idle agent's keepalives take over: 8 x 10/s, answered.
    idle = arbiter_row(0)
    assert idle.heartbeats_per_s_max == 10.0 and idle.agent_msgs_per_s_max == 20.0
    assert idle.arbiter_msgs_per_s == 160.0
    assert idle.arbiter_cpu_percent == pytest.approx(1.0 + 80 * 5.0 / 1e4)
    with pytest.raises(ControlPlaneError, match="keepalive_s"):
        measure(16, "any", flows=100, keepalive_s=0.0)


def test_cli_arbiter_cost_file_targets_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import click

    from ark.cli.control_plane import print_table, run_bench

    cost = tmp_path / "arbiter.json"
    cost.write_text(json.dumps({"per_request_us": 30.0, "per_keepalive_us": 9.0, "per_replica_copy_us": 5.0,
                                "base_percent": 0.4}))
    res = run_bench("16", ("any",), 200, 0.25, False, None, None, str(cost))
    assert res["arbiter_cost"]["per_request_us"] == 30.0 and res["arbiter_cost_source"] == str(cost)
    g = res["arbiter_targets"]
    assert g["hosts"] == 16 and g["met"] is True and g["agent_msgs_per_s_max"] <= 100
    json.dumps(res)
    print_table(res)
    text = capsys.readouterr().out
    assert "arbiter mode, any-to-any at 16 hosts" in text and ": met" in text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"per_request_us": 30.0}))
    with pytest.raises(click.BadParameter, match="per_keepalive_us"):
        run_bench("16", ("any",), 200, 0.25, False, None, None, str(bad))
    assert run_bench("16", ("any",), 200, 0.25, False, None, None)["arbiter_cost_source"].startswith("built-in")
