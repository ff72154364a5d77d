"""The control-plane cost model: placements, scopes, per-agent counts, the CLI."""

from __future__ import annotations

import json

import pytest

from ark.sim.control_plane import AgentCost, ControlPlaneError, fabric_for, measure, plan_for


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
    assert {(r["hosts"], r["mode"]) for r in res["rows"]} == {(16, "full"), (16, "scoped"), (256, "full"), (256, "scoped")}
    assert res["paired_cpu_cut"]["256"] > 1 and res["cost_source"].startswith("built-in")
    assert main(["bench", "control-plane", "--no-measure", "--hosts", "100"]) == 2
    assert "hosts: must be 16 or a multiple of 128" in capsys.readouterr().err
