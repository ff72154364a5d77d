from __future__ import annotations

import json

import pytest

from ark.sim import config as config
from ark.sim.config import ConfigError
from ark.sim.experiment import RECORD_KEYS, run_sweep, summarize, write_results


def small() -> config.ExperimentConfig:
    return config.default().with_overrides(qps=(5.0, 25.0), requests=120, seeds=(0, 1))


def test_records_have_every_field() -> None:
    sw = run_sweep(small())
    assert len(sw.records) == 2 * 4 * 2
    for r in sw.records:
        assert set(RECORD_KEYS) <= set(r)
        assert r["path_mismatches"] == 0
        assert len(r["max_concurrent_per_spine"]) == 4
        assert r["fct_p50_s"] <= r["fct_p95_s"] <= r["fct_p99_s"]
        assert r["ttft_mean_s"] > r["fct_mean_s"]
    assert set(sw.timelines) == {"ecmp", "ark", "ark-balance", "spray"}
    assert sw.timeline_qps == 25.0


def test_same_seed_gives_byte_identical_results(tmp_path) -> None:
    cfg = small()
    a = write_results(tmp_path / "a", run_sweep(cfg, jobs=1), cfg)
    b = write_results(tmp_path / "b", run_sweep(cfg, jobs=2), cfg)
    for x, y in zip(a, b, strict=True):
        assert x.read_bytes() == y.read_bytes(), x.name
    recs = json.loads((tmp_path / "a" / "results.json").read_text())["records"]
    assert recs[0]["scheme"] == "ecmp"


def test_summary_reduction_versus_ecmp() -> None:
    rows = summarize(run_sweep(small()).records)
    ecmp = [r for r in rows if r["scheme"] == "ecmp"]
    assert all(r["fct_mean_reduction"] == 0 for r in ecmp)
    spray = next(r for r in rows if r["scheme"] == "spray" and r["qps"] == 25.0)
    assert spray["fct_mean_reduction"] > 0


def test_config_file_round_trip(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[fabric]\nleaves = 2\nspines = 8\ngpus_per_leaf = 8\nhash = "crc32"\nselection = "threshold"\n'
        '[workload]\nqps = 12\nrequests = 50\nmodel = "llama-3-70b"\n'
        '[serving]\nmode = "queued"\ngpu = "h100"\ntp = 8\n'
        '[network]\ncontrol_delay_us = 100\nport_range = "0-65535"\n'
        '[experiment]\nschemes = ["ecmp", "ark"]\nseeds = [4, 5]\n'
    )
    cfg = config.load(f)
    assert cfg.fabric.build().n_spines == 8 and cfg.workload.qps == (12.0,)
    assert cfg.seeds == (4, 5) and cfg.network.port_range == (0, 65535)
    sw = run_sweep(cfg)
    assert len(sw.records) == 4 and all(len(r["max_concurrent_per_spine"]) == 8 for r in sw.records)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[fabric]\nspines = 0\n", r"fabric.spines: must be >= 1"),
        ("[fabric]\nspine = 4\n", r"fabric.spine: unknown key; accepted: preset, leaves"),
        ('[fabric]\nhash = "md5"\n', r"fabric.hash: must be one of murmur3-hpcc"),
        ('[workload]\nqps = "fast"\n', r"workload.qps: must be a number"),
        ("[workload]\nrequests = 1.5\n", r"workload.requests: must be an integer"),
        ('[experiment]\nschemes = ["ecmp", "drill"]\n', r"experiment.schemes: must be one of"),
        ("[experiment]\nseeds = 0\n", r"experiment.seeds"),
        ('[network]\nport_range = "9-1"\n', r"network.port-range"),
        ("[nonsense]\n", r"nonsense: unknown section"),
        ("[fabric\n", r"not valid TOML"),
        ('[serving]\nmode = "batch"\n', r"serving.mode: must be one of paper, queued"),
        ('[workload]\ntrace = "nope.csv"\n', r"workload.trace: no such file"),
    ],
)
def test_bad_config_files_name_the_field(tmp_path, text: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        config.load(f)


def test_trace_driven_run(tmp_path) -> None:
    t = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{i * 0.1:.3f},{2000 + 37 * i},20" for i in range(60)]
    t.write_text("\n".join(rows) + "\n")
    f = tmp_path / "c.toml"
    f.write_text('[workload]\ntrace = "trace.csv"\nqps = 20\nrequests = 60\n[experiment]\nschemes = ["ecmp", "ark"]\nseeds = 1\n')
    sw = run_sweep(config.load(f))
    assert all(r["requests"] == 60 for r in sw.records)
