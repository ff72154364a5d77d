"""The pieces of the vLLM integration that need no vLLM: its settings, the mode file, the
transfer log, the local model's shape and prompts, the testbed's request plan and summary."""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

import pytest

from ark.core.node import Lease
from ark.core.schema import ConfigError
from ark.integrations.mooncake import Transfer
from ark.integrations.preload import Connection
from ark.integrations.vllm import ArkVllmSettings, ModeFollower, TransferLog
from ark.integrations.vllm_model import ModelShape, prompt


def test_settings_take_the_ark_keys_and_name_a_bad_one() -> None:
    s = ArkVllmSettings.from_extra({"mooncake_protocol": "tcp", "ark_cluster": "c.toml", "ark_host": "gpu0",
                                    "ark_parts": 0, "ark_hosts": {"10.0.0.9": "gpu9"}})
    assert (s.cluster, s.host, s.parts, s.hosts, s.steer) == ("c.toml", "gpu0", 0, {"10.0.0.9": "gpu9"}, True)
    assert ArkVllmSettings.from_extra(None) == ArkVllmSettings()
    assert ArkVllmSettings.from_extra({"ark_idle_step_s": 0.01}).idle_step_s == 0.01
    assert ArkVllmSettings().idle_step_s == 0.0  # vLLM's own pace
    assert ArkVllmSettings.from_extra({"ark_poll_s": 0.002}).poll_s == 0.002
    assert ArkVllmSettings().poll_s == 0.0  # the engine's own synchronous write
    for extra, why in (({"ark_parts": 17}, "parts"), ({"ark_parts": "2"}, "parts"), ({"ark_steer": "no"}, "steer"),
                       ({"ark_idle_step_s": 0.5}, "idle_step_s"), ({"ark_idle_step_s": float("nan")}, "idle_step_s"),
                       ({"ark_poll_s": 0.5}, "poll_s"), ({"ark_poll_s": -1e-3}, "poll_s"),
                       ({"ark_poll_s": float("inf")}, "poll_s"), ({"ark_poll_s": "fast"}, "poll_s"),
                       ({"ark_cluster": "c.toml"}, "ark_cluster: give ark_cluster and ark_host together"),
                       ({"ark_bogus": 1}, "bogus")):
        with pytest.raises(ConfigError, match=why):
            ArkVllmSettings.from_extra(extra)


class EngineStandIn:
    """What ModeFollower drives: a steered engine's switches and its one call."""

    def __init__(self, agent: str | None) -> None:
        self.agent, self.observing, self.parts = agent, agent is None, None
        self.calls: list[tuple[bool, int | None]] = []

    def batch_transfer_sync_write(self, *args: Any) -> int:
        self.calls.append((self.observing, self.parts))
        return 0


def test_a_mode_file_switches_steering_between_pushes_and_a_bad_one_keeps_the_last(tmp_path) -> None:
    f = tmp_path / "mode.json"
    eng = EngineStandIn("ipc:///agent.sock")
    follower = ModeFollower(eng, str(f))  # type: ignore[arg-type]
    follower.batch_transfer_sync_write("t", [], [], [])  # no file yet: as configured
    for mode in ({"steer": False, "parts": None}, {"steer": True, "parts": 0}, {"steer": True, "parts": None}):
        f.write_text(json.dumps(mode))
        os.utime(f, ns=(time.time_ns(), time.time_ns()))
        follower.batch_transfer_sync_write("t", [], [], [])
    f.write_text('{"steer": "maybe"}')
    os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    follower.batch_transfer_sync_write("t", [], [], [])
    assert eng.calls == [(False, None), (True, None), (False, 0), (False, None), (False, None)]
    # Without an agent, steering cannot be switched on.
    lone = EngineStandIn(None)
    f.write_text(json.dumps({"steer": True, "parts": 2}))
    ModeFollower(lone, str(f)).batch_transfer_sync_write("t", [], [], [])  # type: ignore[arg-type]
    assert lone.calls == [(True, 2)]


def test_the_transfer_log_writes_one_line_per_push_with_each_connections_part(tmp_path) -> None:
    t = Transfer("10.0.1.1:15100", "gpu8", 1 << 20, dport=15101, t0=1.0, t1=2.0)
    t.leases = [Lease((0, 1), 8, 1, 20001, None, 9.0, True), Lease((0, 2), 8, 3, 20003, None, 9.0, True)]
    t.lease = t.leases[0]
    t.port_paths, t.port_parts = {20001: 1, 20003: 3}, {20001: 0, 20003: 1}
    t.connections = [Connection(20001, 15101, True), Connection(20003, 15101, True), Connection(40000, 15101, False)]
    log = TransferLog(str(tmp_path / "t.jsonl"))
    log(t)
    log(t)
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["bytes"] == 1 << 20 and [le["path"] for le in lines[0]["leases"]] == [1, 3]
    assert [(c["sport"], c["part"], c["path"]) for c in lines[0]["connections"]] == \
        [(20001, 0, 1), (20003, 1, 3), (40000, None, None)]


def test_the_local_models_kv_size_and_prompts() -> None:
    shape = ModelShape()
    assert shape.head_dim == 64 and shape.kv_bytes_per_token == 16 * 1024
    assert len(shape.words()) == shape.vocab - 3 and len(set(shape.words())) == len(shape.words())
    p = prompt(300, 7)
    assert p == prompt(300, 7) != prompt(300, 8) and len(p.split()) == 300 and set(p.split()) <= set(shape.words())


def test_the_testbed_request_plan_is_seeded_and_its_summary_counts_mismatches() -> None:
    from ark.testbed.vllm import requests_for, summarize_requests

    a, b = requests_for(3, 20, 10.0), requests_for(3, 20, 10.0)
    assert a == b and a != requests_for(4, 20, 10.0)
    assert [r.id for r in a] == list(range(20)) and all(200 <= r.tokens <= 1000 for r in a)
    assert a[0].start_s == 0.0 and all(x.start_s < y.start_s for x, y in itertools.pairwise(a))
    recs = [{"id": 0, "error": None, "match": True, "ttft_s": 0.2, "tpot_s": 0.01, "e2e_s": 0.4},
            {"id": 1, "error": None, "match": False, "ttft_s": 0.4, "tpot_s": 0.03, "e2e_s": 0.8},
            {"id": 2, "error": "HTTP 502", "match": False}]
    s = summarize_requests(recs)
    assert (s["vllm_requests"], s["vllm_errors"], s["output_mismatches"], s["mismatched_ids"]) == (3, 1, 2, [1, 2])
    assert s["ttft_mean_s"] == pytest.approx(0.3) and s["tpot_p50_s"] == pytest.approx(0.02)
