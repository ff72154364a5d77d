from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def ark(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ark", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ark: error:")
    assert "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["reproduce", "--qps", "1,x"], ["--qps"]),
        (["reproduce", "--qps", "-3"], ["--qps"]),
        (["reproduce", "--schemes", "ecmp,drill"], ["--schemes", "ark-balance"]),
        (["reproduce", "--seeds", "0"], ["--seeds"]),
        (["reproduce", "--requests", "0"], ["--requests"]),
        (["reproduce", "--bogus"], ["--bogus"]),
        (["simulate"], ["--config"]),
        (["simulate", "--config", "/nonexistent.toml"], ["config", "/nonexistent.toml"]),
        (["pathmap", "--hash", "md5", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "4"], ["--hash", "crc32"]),
        (["pathmap", "--hash", "crc32", "--src", "10.0.0.999", "--dst", "10.0.1.1", "--paths", "4"], ["src"]),
        (["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "4", "--port-range", "5-1"], ["--port-range"]),
        (["nosuch"], ["nosuch"]),
    ],
)
def test_bad_options_one_line_error(args: list[str], needles: list[str]) -> None:
    one_line_error(ark(*args), *needles)


def test_bad_config_file_one_line_error(tmp_path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[fabric]\nspines = -1\n")
    one_line_error(ark("simulate", "--config", str(f)), "fabric.spines")
    f.write_text("[workload]\nqps = [1, 'a']\n")
    one_line_error(ark("reproduce", "--config", str(f)), "workload.qps")


def test_pathmap_json_format() -> None:
    p = ark("pathmap", "--hash", "murmur3-hpcc", "--seed", "16", "--src", "10.0.0.1", "--dst", "10.0.1.1",
            "--paths", "4", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["hash"] == "murmur3-hpcc" and d["seed"] == 16 and d["paths"] == 4
    ports = sorted(x for k in ("0", "1", "2", "3") for x in d["ports"][k])
    assert ports == list(range(49152, 65536))
    t = ark("pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "2", "--port-range", "0-65535")
    assert t.returncode == 0 and "path" in t.stdout


def test_reproduce_writes_results_and_plots(tmp_path) -> None:
    out = tmp_path / "res"
    p = ark("reproduce", "--qps", "5,25", "--requests", "80", "--seeds", "1", "--jobs", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "ARK vs ECMP" in p.stdout and "ark-balance" in p.stdout
    for name in ("results.json", "results.csv", "fct_vs_qps.png", "ttft_vs_qps.png", "spine_concurrency.png"):
        assert (out / name).stat().st_size > 0, name
    d = json.loads((out / "results.json").read_text())
    assert len(d["records"]) == 8
    assert d["about"]["fabric"]["oversubscription"] == [2.0] and d["about"]["fabric"]["hash"] == "murmur3-hpcc"
    assert [x["qps"] for x in d["about"]["loads"]] == [5.0, 25.0]
    assert all(x["offered_load"] > 0 for x in d["about"]["loads"])
    assert "## Go or no-go" in (out / "results.md").read_text()
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("scheme,qps,seed,requests") and len(csv_lines) == 9
    assert (out / "fct_vs_qps.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_json(tmp_path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[workload]\nqps = 20\nrequests = 60\n[experiment]\nschemes = ["ecmp", "ark"]\nseeds = 1\n')
    p = ark("simulate", "--config", str(f), "--out", str(tmp_path / "o"), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert {r["scheme"] for r in d["summary"]} == {"ecmp", "ark"}


def test_bench_controller_json() -> None:
    p = ark("bench", "controller", "--json", "--hash", "crc32")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for k in ("precompute_ms_per_peer", "hash_ns_per_port", "select_us_k4", "select_us_k1000",
              "decision_us_p50", "decision_us_p99", "decision_lease_us_p50", "decision_lease_us_p99"):
        assert d[k] > 0


def test_ports_engines_table_needs_no_cluster() -> None:
    p = subprocess.run([sys.executable, "-m", "ark", "ports", "--engines"], capture_output=True, text=True, check=False,
                       env={**os.environ, "COLUMNS": "300"})
    assert p.returncode == 0
    for needle in ("MC_MLX5_QP_UDP_SPORTS", "list[i % n]", "USE_MLX5DV=ON", "UCX_IB_ROCE_PATH_FACTOR", "65472",
                   "MORI_MLX5_ENABLE_UDP_SPORT", "UCCL_UDP_SPORT_BASE", "NVSHMEM", "SteeredTransferEngine"):
        assert needle in p.stdout, needle
    p = subprocess.run([sys.executable, "-m", "ark", "ports", "--cluster", "c.toml"], capture_output=True, text=True,
                       check=False)
    assert p.returncode == 2 and p.stderr.strip() == "ark: error: --host, --peer: required (or --engines)"


def test_bench_transport_json() -> None:
    p = ark("bench", "transport", "--messages", "300", "--rate", "2000", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["messages"] == 300 and d["cpu_us_per_message"] > 0


def test_bench_arbiter_prints_its_table_without_json() -> None:
    p = ark("bench", "arbiter", "--rates", "500", "--seconds", "0.5", "--hosts", "4")
    assert p.returncode == 0, p.stderr
    assert "offered/s" in p.stdout and "sustained 500 decisions/s" in p.stdout


def test_bench_lease_json_with_an_old_build_and_the_arbiter() -> None:
    """This checkout stands in for the old build: its agents run from its src/ through
    PYTHONPATH, as an old worktree's would, turn about with this build's and arbiter mode's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = ark("bench", "lease", "--samples", "50", "--cpu-cycles", "100", "--decisions", "2000", "--old", root, "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["floor"]["n"] == 4 * 50 and 0 < d["floor"]["p50_us"] <= d["floor"]["p99_us"]
    assert set(d["builds"]) == {"new", "old", "arbiter"}
    for name, b in d["builds"].items():
        assert b["errors"] == 0, name
        for op in ("reserve", "renew", "release", "reserve4"):
            assert b["ops"][op]["n"] == 50 and b["ops"][op]["p50_us"] > 0, (name, op)
            assert b["x_floor"][op]["p50_us"] == round(b["ops"][op]["p50_us"] / d["floor"]["p50_us"], 2)
    assert d["builds"]["old"]["decision_us_p50"] > 0 and d["builds"]["new"]["agent_cpu_us_per_reserve_release"] > 0
    assert {"reserve_p50_x_floor", "reserve4_p50_x_reserve", "decision_us_p50_x_old"} <= set(d["targets"])
    assert len(d["load_average_before"]) == 3


def test_bench_lease_table_and_a_wrong_old_path() -> None:
    p = ark("bench", "lease", "--samples", "50", "--cpu-cycles", "100", "--decisions", "1000", "--no-arbiter")
    assert p.returncode == 0, p.stderr
    assert "floor: a msgpack echo" in p.stdout and "reserve, 4 parts" in p.stdout and "targets:" in p.stdout
    one_line_error(ark("bench", "lease", "--old", os.path.dirname(os.path.abspath(__file__))), "--old", "src/ark")
