"""The commands of the 3-tier, scale and sweep work: JSON keys and one-line errors."""

from __future__ import annotations

import json

from tests.cli.test_cli import ark, one_line_error


def test_bench_scale_json_keys() -> None:
    p = ark("bench", "scale", "--scheme", "ark", "--requests", "300", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for k in ("gpus", "requests", "scheme", "wall_s", "peak_rss_mb", "events_per_s", "cpu_s", "baseline_s"):
        assert k in r
    assert (r["gpus"], r["requests"], r["scheme"], r["path_mismatches"]) == (1024, 300, "ark", 0)
    assert 0 < r["peak_rss_mb"] < 4096 and r["events_per_s"] > 0
    assert r["flows_cross_pod"] >= 0.4 * 300  # a global scheduler's pairs cross the core


def test_bench_scale_at_other_sizes_shows_progress() -> None:
    p = ark("bench", "scale", "--scheme", "ecmp", "--gpus", "256", "--requests", "200", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert (r["gpus"], r["requests"], r["qps"]) == (256, 200, 350.0)
    assert "200/200 flows finished" in p.stderr and "peak" in p.stderr
    one_line_error(ark("bench", "scale", "--gpus", "200"), "gpus", "multiple of 128")
    one_line_error(ark("bench", "scaling", "--gpus", "128,300"), "gpus", "multiple of 128")


def test_bench_scaling_fits_and_plots(tmp_path) -> None:
    plot = tmp_path / "scaling.png"
    p = ark("bench", "scaling", "--scheme", "ecmp", "--gpus", "128,256", "--requests", "100,200", "--at-gpus", "128",
            "--plot", str(plot), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert sorted((x["gpus"], x["requests"]) for x in r["runs"]) == [(128, 100), (128, 200), (256, 100)]
    assert {(f["against"], f["points"]) for f in r["exponents"]} == {("gpus", 2), ("requests", 2)}
    assert plot.exists()


def test_scaling_exponents_are_log_log_slopes() -> None:
    from ark.sim.bench import scaling_exponents

    rows = [{"scheme": "ark", "gpus": g, "requests": 10, "wall_s": 3.0 * g**1.5, "cpu_s": 2.0 * g, "peak_rss_mb": 50.0}
            for g in (128, 256, 1024)]
    (fit,) = scaling_exponents(rows)
    assert fit["against"] == "gpus" and abs(fit["wall_exponent"] - 1.5) < 1e-9
    assert abs(fit["cpu_exponent"] - 1.0) < 1e-9 and abs(fit["memory_exponent"]) < 1e-9


def test_polarisation_json(tmp_path) -> None:
    p = ark("polarisation", "--pairs", "2", "--qps", "20", "--requests", "40", "--seeds", "1", "--out", str(tmp_path),
            "--jobs", "1", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    shares = {(x["hash"], x["seeding"]): x["mean"] for x in r["reachability"]}
    assert shares[("murmur3-hpcc", "one hash, one seed on every switch")] == 0.25
    assert {x["fabric"] for x in r["fct"]} == {"polarised", "seed per switch"}
    assert (tmp_path / "polarisation.png").exists() and (tmp_path / "polarisation.json").exists()


def test_sweep_errors_are_one_line(tmp_path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text('[fabric]\npods = 2\nspines = 4\n')
    one_line_error(ark("sweep", "--config", str(cfg), "--out", str(tmp_path / "o")), "fabric.pods", "3-tier")
    one_line_error(ark("sweep", "--config", str(cfg), "--config", str(cfg), "--out", str(tmp_path / "o")),
                   "fabric.pods")
    ok = tmp_path / "b.toml"
    ok.write_text('[workload]\nrequests = 5\nqps = [5]\n[experiment]\nschemes = ["ecmp"]\nseeds = 1\n')
    one_line_error(ark("sweep", "--config", str(ok), "--config", str(ok), "--out", str(tmp_path / "o")),
                   "two configs share a name")
