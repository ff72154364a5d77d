"""``ark compare`` and ``ark race-window`` from the command line."""

from __future__ import annotations

import json

import pytest

from ark.cli.common import apply_sets
from ark.sim.config import default
from ark.sim.racewindow import halving_delay
from tests.cli.test_cli import ark, one_line_error


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["compare", "--fail-link", "0-2@20"], ["--fail-link", "LEAF:SPINE@SECONDS"]),
        (["compare", "--fail-link", "0:9@20"], ["failure.spine", "0..3"]),
        (["compare", "--fail-link", "0:1@20:1.5"], ["failure.fraction"]),
        (["compare", "--schemes", "ecmp,drill"], ["--schemes"]),
        (["race-window", "--delays", "1,x"], ["--delays"]),
        (["race-window", "--delays", "0,10"], ["--delays", "> 0"]),
        (["race-window", "--schemes", "ecmp"], ["--schemes"]),
        (["race-window", "--delays", ""], ["--delays"]),
        (["race-window", "--jitters", "nan"], ["--jitters", "finite"]),
        (["race-window", "--set", "workload.qps=[5, 10]"], ["--set", "workload.qps", "--qps"]),
        (["race-window", "--set", "network.control_delay_us=5"], ["--set", "--delays"]),
        (["race-window", "--arbiter-rtt", "-5"], ["--arbiter-rtt", ">= 0"]),
        (["race-window", "--set", 'network.control="arbiter"'], ["--set", "--arbiter-rtt"]),
        (["compare", "--set", 'fabric.preset="clos3-small"', "--schemes", "conga,ecmp"],
         ["experiment.schemes", "conga", "2-tier"]),
        (["compare", "--qps", "5,inf"], ["--qps", "finite"]),
    ],
)
def test_bad_compare_options_one_line_error(args: list[str], needles: list[str]) -> None:
    one_line_error(ark(*args), *needles)


def test_compare_writes_results_summary_and_figures(tmp_path) -> None:
    out = tmp_path / "cmp"
    p = ark("compare", "--schemes", "ecmp,letflow,ark-split,spray", "--qps", "5,20", "--requests", "60",
            "--seeds", "1", "--jobs", "1", "--fail-link", "0:1@1.5", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "which scheme at which load" in p.stdout and "link change: leaf0-spine1 down at 1.5 s" in p.stdout
    assert "paired over seeds: one seed, no interval" in p.stdout
    warnings = [x for x in p.stderr.splitlines() if x.startswith("ark: warning:")]
    assert len(warnings) == 1 and "too short to be steady at QPS 20 " in warnings[0] and "--requests" in warnings[0]
    assert "go/no-go at QPS 20:" in p.stdout and "provisional: runs not steady, one seed" in p.stdout
    for name in ("results.json", "results.csv", "compare.json", "results.md", "compare_fct.png", "fct_cdf.png",
                 "slowdown.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(json.loads((out / "results.json").read_text())["records"]) == 8
    d = json.loads((out / "compare.json").read_text())
    assert {r["scheme"] for r in d["failure"]} == {"ecmp", "letflow", "ark-split", "spray"}
    assert all(r["mismatches_after_rebuild"] == 0 for r in d["failure"])
    assert "## Link change" in (out / "results.md").read_text()


def test_race_window_json(tmp_path) -> None:
    p = ark("race-window", "--delays", "10,100000", "--jitters", "", "--skews", "100", "--queues", "", "--arbiter-rtt",
            "200", "--requests", "60", "--seeds", "1", "--jobs", "1", "--schemes", "ark", "--out", str(tmp_path / "rw"),
            "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert {r["sweep"] for r in d["rows"]} == {"ecmp", "reference", "delay", "skew", "arbiter"}
    assert d["halving_delay_us"] == {"ark": halving_delay(d["rows"], "ark")}
    assert (tmp_path / "rw" / "race_window.png").stat().st_size > 0


def test_set_overrides_a_config_value(tmp_path) -> None:
    p = ark("compare", "--schemes", "ecmp,ark-split", "--qps", "10", "--requests", "30", "--seeds", "1", "--jobs", "1",
            "--set", "serving.kv_transfer=per-layer", "--set", "params.split.parts=2", "--no-plots", "--json",
            "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "o" / "results.md").read_text()
    assert "KV transfer `per-layer`" in md
    (row,) = json.loads(p.stdout)["paired"]
    assert (row["scheme"], row["baseline"], row["n"], row["verdict"]) == ("ark-split", "ecmp", 1, "one seed: no interval")
    assert apply_sets(default(), ("params.split.parts=2",)).params.split.parts == 2
    one_line_error(ark("compare", "--set", "params.split.parts=0", "--qps", "5"), "params.split.parts")
    one_line_error(ark("compare", "--set", "nokey", "--qps", "5"), "--set")
