"""LLM-serving model: compute latency, placement, and per-request timing.

The network decides only the KV-transfer time. Everything else here is a fixed,
pluggable function of (model, GPU, tokens):

* ``paper`` mode (default, as the published experiment): prefill and the first decode
  step are fixed offsets, no compute queueing. TTFT = prefill + KV FCT + decode step.
* ``queued`` mode: each prefill GPU serves one prefill at a time, FCFS; each decode GPU
  has ``decode_slots`` batch slots held for a request's whole decode, FCFS by KV arrival.
  TTFT = prefill wait + prefill + KV FCT + decode-slot wait + decode step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ark.sim.workload import ModelSpec, Request, WorkloadError, model_spec

MODES = ("paper", "queued")
# How requests meet GPUs. "round-robin": the i-th request on the i-th prefill and the i-th
# decode GPU (the published two-server experiment); "random": each request's prefill and
# decode GPU drawn uniformly from the whole pools, as a P/D router that pairs any prefill
# worker with any decode worker spreads them; "auto" (the default): "random" when the
# pools span more than one pod, else "round-robin" (see resolve_placement).
PLACEMENTS = ("auto", "round-robin", "random")
GPUS = ("a100", "h100")


class LatencyModel(Protocol):
    def prefill_s(self, tokens: int) -> float: ...

    def decode_step_s(self) -> float: ...


@dataclass(frozen=True)
class AffineLatency:
    """prefill(n) = base + per_token * n; constant decode step."""

    prefill_base_s: float
    prefill_per_token_s: float
    decode_step: float

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * tokens

    def decode_step_s(self) -> float:
        return self.decode_step


# Calibrated on Vidur's LLaMA-3-8B A100 TP1 profile (prefill 8.8 ms + 0.066 ms/token); H100 ~2x faster
# prefill and ~6 ms decode steps.
_BASE = {
    "a100": AffineLatency(8.8e-3, 0.06604e-3, 10e-3),
    "h100": AffineLatency(4.4e-3, 0.03302e-3, 6e-3),
}
_REF_PARAMS = 8.03e9


def latency_model(model: str | ModelSpec, gpu: str = "a100", tp: int = 1) -> AffineLatency:
    """Affine roofline preset for (model, GPU, tensor parallelism).

    The 8B profile is measured; other models scale by parameter count (prefill is
    compute-bound and decode memory-bound, both ~ proportional to weights) divided by TP.
    """
    spec = model_spec(model) if isinstance(model, str) else model
    if gpu not in _BASE:
        raise WorkloadError(f"serving.gpu: must be one of {', '.join(GPUS)}; got {gpu!r}")
    if tp < 1:
        raise WorkloadError(f"serving.tp: must be >= 1; got {tp}")
    b = _BASE[gpu]
    f = spec.params / _REF_PARAMS / tp
    return AffineLatency(b.prefill_base_s, b.prefill_per_token_s * f, b.decode_step * f)


@dataclass(frozen=True)
class Placed:
    """A request with its GPUs and KV flow start (known before the network runs)."""

    request: Request
    prefill_gpu: int
    decode_gpu: int
    prefill_wait_s: float
    prefill_s: float
    kv_start_s: float
    kv_bytes: int


@dataclass(frozen=True)
class Timing:
    request_id: int
    fct_s: float
    ttft_s: float
    tpot_s: float
    decode_wait_s: float


@dataclass(frozen=True)
class Serving:
    model: ModelSpec
    latency: LatencyModel
    mode: str = "paper"
    placement: str = "round-robin"  # the config's "auto" arrives resolved (for_fabric)
    decode_slots: int = 64

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise WorkloadError(f"serving.mode: must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.placement not in PLACEMENTS:
            raise WorkloadError(
                f"serving.placement: must be one of {', '.join(PLACEMENTS)}; got {self.placement!r}"
            )
        if self.decode_slots < 1:
            raise WorkloadError(f"serving.decode_slots: must be >= 1; got {self.decode_slots}")

    def place(
        self,
        requests: Sequence[Request],
        prefill_gpus: Sequence[int],
        decode_gpus: Sequence[int],
        rng: np.random.Generator,
    ) -> list[Placed]:
        if not prefill_gpus or not decode_gpus:
            raise WorkloadError("fabric: needs at least one prefill and one decode GPU")
        n = len(requests)
        if self.placement == "auto":
            raise WorkloadError("serving.placement: \"auto\" must be resolved against the fabric first "
                                "(resolve_placement)")
        if self.placement == "round-robin":
            pg = [prefill_gpus[i % len(prefill_gpus)] for i in range(n)]
            dg = [decode_gpus[i % len(decode_gpus)] for i in range(n)]
        else:
            pg = [prefill_gpus[int(i)] for i in rng.integers(0, len(prefill_gpus), n)]
            dg = [decode_gpus[int(i)] for i in rng.integers(0, len(decode_gpus), n)]
        free_at: dict[int, float] = {}
        out = []
        for r, p, d in zip(requests, pg, dg, strict=True):
            pre = self.latency.prefill_s(r.prefill_tokens)
            wait = 0.0
            if self.mode == "queued":
                start = max(r.arrival_s, free_at.get(p, 0.0))
                wait = start - r.arrival_s
                free_at[p] = start + pre
            out.append(
                Placed(r, p, d, wait, pre, r.arrival_s + wait + pre,
                       r.prefill_tokens * self.model.kv_bytes_per_token)
            )
        return out

    def for_fabric(self, pods_spanned: int) -> Serving:
        """This serving model with ``placement = "auto"`` resolved (:func:`resolve_placement`)."""
        return replace(self, placement=resolve_placement(self.placement, pods_spanned))

    def timings(self, placed: Sequence[Placed], fcts: Sequence[float]) -> list[Timing]:
        """TTFT and TPOT once the network has produced each KV flow's FCT."""
        step = self.latency.decode_step_s()
        waits = [0.0] * len(placed)
        if self.mode == "queued":
            # Decode slots are taken in KV-arrival order (FCFS).
            order = sorted(range(len(placed)), key=lambda i: (placed[i].kv_start_s + fcts[i], i))
            slots: dict[int, list[float]] = {}
            for i in order:
                pl = placed[i]
                ready = pl.kv_start_s + fcts[i]
                heap = slots.setdefault(pl.decode_gpu, [])
                start = ready
                if len(heap) >= self.decode_slots:
                    start = max(ready, heapq.heappop(heap))
                waits[i] = start - ready
                heapq.heappush(heap, start + max(1, pl.request.decode_tokens) * step)
        return [
            Timing(
                pl.request.id,
                fct,
                pl.prefill_wait_s + pl.prefill_s + fct + waits[i] + step,
                step,
                waits[i],
            )
            for i, (pl, fct) in enumerate(zip(placed, fcts, strict=True))
        ]


def resolve_placement(placement: str, pods_spanned: int) -> str:
    """``"auto"`` becomes ``"random"`` when the prefill and decode pools together span
    ``pods_spanned`` > 1 pods, else ``"round-robin"``; other placements stay.

    Round-robin pairs the i-th prefill GPU with the i-th decode GPU; with both pools laid
    out pod by pod (as every 3-tier preset does) each pair then sits in one pod and no flow
    ever crosses the core, while a real P/D router (Dynamo, llm-d, Mooncake's scheduler)
    pairs any prefill worker with any decode worker, so that most flows cross pods.
    """
    if placement != "auto":
        return placement
    return "random" if pods_spanned > 1 else "round-robin"
