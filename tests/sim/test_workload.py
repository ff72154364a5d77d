from __future__ import annotations

import numpy as np
import pytest

from ark.sim.serving import AffineLatency, Serving, latency_model
from ark.sim.workload import (
    MODELS,
    VidurZipf,
    WorkloadError,
    ZipfWorkload,
    load_trace,
    model_spec,
    split_tokens,
)


def test_kv_bytes_per_token() -> None:
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 131_072
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 327_680
    assert MODELS["llama-3.1-405b"].kv_bytes_per_token == 516_096


def test_vidur_zipf_branches_exactly() -> None:
    z = VidurZipf(1024, 55_000, 0.7)
    assert z.zeta2 == 1.0  # Vidur's sum stops at n-1
    u = np.array([0.0, 0.9 / z.zetan, 1.1 / z.zetan, 0.999999])
    out = z.from_uniform(u)
    assert out[0] == 1024 and out[1] == 1024 and out[2] == 1025
    assert 1025 < out[3] <= 55_000


def test_zipf_prompt_lengths_match_the_brief() -> None:
    reqs = ZipfWorkload(qps=1, requests=200_000).generate(np.random.default_rng(7))
    p = np.array([r.prefill_tokens for r in reqs])
    assert p.min() == 975 and p.max() <= 52_380
    assert p.mean() == pytest.approx(13_274, rel=0.01)
    assert np.median(p) == pytest.approx(6_700, rel=0.03)
    kv = p * 131_072
    assert kv.min() / 1e6 == pytest.approx(127.8, rel=0.01)  # ~125 "MB" of KiB/1000


def test_split_tokens_like_vidur() -> None:
    pre, dec = split_tokens(np.array([1024, 55_000]), 20)
    assert pre.tolist() == [975, 52_380] and dec.tolist() == [49, 2_620]


def test_poisson_arrivals_rate() -> None:
    reqs = ZipfWorkload(qps=25, requests=20_000).generate(np.random.default_rng(1))
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert len(reqs) / span == pytest.approx(25, rel=0.03)
    assert reqs[0].arrival_s == 0.0


def test_trace_replay_azure_format(tmp_path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,4808,10\n"
        "2023-11-16 18:15:50.9951690,3180,8\n"
        "2023-11-16 18:15:51.2096750,110,27\n"
    )
    reqs = load_trace(f)
    assert [r.prefill_tokens for r in reqs] == [4808, 3180, 110]
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    fast = load_trace(f, rate_scale=2.0)
    assert fast[1].arrival_s == pytest.approx(reqs[1].arrival_s / 2)
    g = tmp_path / "bad.csv"
    g.write_text("when,ctx\n1,2\n")
    with pytest.raises(WorkloadError, match="workload.trace"):
        load_trace(g)


def test_latency_presets() -> None:
    lat = latency_model("llama-3-8b")
    assert lat.prefill_s(13_300) == pytest.approx(0.887, abs=0.002)
    assert lat.decode_step_s() == 0.010
    h = latency_model("llama-3-8b", "h100")
    assert h.prefill_s(13_300) < lat.prefill_s(13_300) / 1.9
    big = latency_model("llama-3-70b", tp=8)
    assert big.prefill_s(1000) > 0
    with pytest.raises(WorkloadError, match="serving.gpu"):
        latency_model("llama-3-8b", "tpu")
    with pytest.raises(WorkloadError, match="workload.model"):
        model_spec("gpt-5")


def test_serving_paper_and_queued_modes() -> None:
    from ark.sim.workload import Request

    lat = AffineLatency(0.1, 0.0, 0.01)
    reqs = [Request(0, 0.0, 100, 50), Request(1, 0.05, 100, 50)]
    paper = Serving(MODELS["llama-3-8b"], lat)
    placed = paper.place(reqs, [0], [1], np.random.default_rng(0))
    assert [p.kv_start_s for p in placed] == pytest.approx([0.1, 0.15])
    t = paper.timings(placed, [0.2, 0.2])
    assert t[0].ttft_s == pytest.approx(0.1 + 0.2 + 0.01)
    q = Serving(MODELS["llama-3-8b"], lat, mode="queued", decode_slots=1)
    placed = q.place(reqs, [0], [1], np.random.default_rng(0))
    assert placed[1].prefill_wait_s == pytest.approx(0.05)  # waits for the single prefill GPU
    t = q.timings(placed, [0.2, 0.2])
    # Second request's KV lands at 0.4 but the one decode slot is busy until 0.3 + 50 * 0.01.
    assert t[1].decode_wait_s == pytest.approx(0.4)
    assert t[1].ttft_s == pytest.approx(0.05 + 0.1 + 0.2 + 0.4 + 0.01)
    with pytest.raises(WorkloadError, match="serving.mode"):
        Serving(MODELS["llama-3-8b"], lat, mode="batch")
