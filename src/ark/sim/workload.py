"""Requests: model shapes, Vidur's Zipf length generator, Poisson arrivals, trace replay."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """Invalid workload parameters or trace file."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    params: float  # parameter count, for the roofline latency scaling

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 8, 128, 2, 8.03e9),
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8, 128, 2, 70.6e9),
    "llama-3.1-405b": ModelSpec("llama-3.1-405b", 126, 8, 128, 2, 405.9e9),
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise WorkloadError(f"workload.model: must be one of {', '.join(MODELS)}; got {name!r}") from None


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prefill_tokens: int
    decode_tokens: int


class VidurZipf:
    """Vidur's ``ZipfGenerator`` (vidur/utils/zipf_generator.py), reproduced exactly.

    ``zeta(n)`` sums ``i^-theta`` for i in 1..n-1, as Vidur's does.
    """

    def __init__(self, min_tokens: int, max_tokens: int, theta: float) -> None:
        if not 0 < theta < 1:
            raise WorkloadError(f"workload.theta: must be in (0, 1); got {theta}")
        if not 1 <= min_tokens <= max_tokens:
            raise WorkloadError(
                f"workload.min_tokens/max_tokens: need 1 <= min <= max; got {min_tokens}, {max_tokens}"
            )
        self.min, self.max, self.theta = min_tokens, max_tokens, theta
        self.items = max_tokens - min_tokens + 1
        self.alpha = 1.0 / (1.0 - theta)
        self.zetan = self._zeta(self.items)
        self.zeta2 = self._zeta(2)
        self.eta = (1 - (2.0 / self.items) ** (1 - theta)) / (1 - self.zeta2 / (self.zetan + 1e-8))

    def _zeta(self, count: int) -> float:
        return float(np.sum(1.0 / np.power(np.arange(1, count, dtype=np.float64), self.theta)))

    def from_uniform(self, u: np.ndarray) -> np.ndarray:
        uz = u * self.zetan
        tail = self.min + (self.items * np.power(self.eta * u - self.eta + 1, self.alpha)).astype(np.int64)
        out = np.where(uz < 1, self.min, np.where(uz < 1 + 0.5**self.theta, self.min + 1, tail))
        return out.astype(np.int64)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.from_uniform(rng.random(n))


def split_tokens(total: np.ndarray, pd_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Vidur: decode = ceil(total / (1 + ratio)), prefill = total - decode."""
    decode = np.ceil(total / (1.0 + pd_ratio)).astype(np.int64)
    return total - decode, decode


@dataclass(frozen=True)
class ZipfWorkload:
    qps: float
    requests: int
    theta: float = 0.7
    min_tokens: int = 1024
    max_tokens: int = 55_000
    pd_ratio: float = 20.0

    def generate(self, rng: np.random.Generator) -> list[Request]:
        if not (self.qps > 0 and math.isfinite(self.qps)):
            raise WorkloadError(f"workload.qps: must be > 0; got {self.qps}")
        if self.requests < 1:
            raise WorkloadError(f"workload.requests: must be >= 1; got {self.requests}")
        if self.pd_ratio < 0:
            raise WorkloadError(f"workload.pd_ratio: must be >= 0; got {self.pd_ratio}")
        gaps = rng.exponential(1.0 / self.qps, self.requests)
        arrivals = np.cumsum(gaps) - gaps[0]  # first request at t = 0
        total = VidurZipf(self.min_tokens, self.max_tokens, self.theta).sample(self.requests, rng)
        prefill, decode = split_tokens(total, self.pd_ratio)
        return [
            Request(i, float(arrivals[i]), int(prefill[i]), int(decode[i]))
            for i in range(self.requests)
        ]


def _parse_time(text: str) -> float | datetime:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    # Azure traces carry 7 fractional digits; datetime takes at most 6.
    if "." in text:
        head, frac = text.split(".", 1)
        digits = "".join(c for c in frac if c.isdigit())
        text = f"{head}.{digits[:6]}"
    return datetime.fromisoformat(text)


def load_trace(path: str | Path, rate_scale: float = 1.0, limit: int | None = None) -> list[Request]:
    """Replay a CSV with columns TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM traces).

    TIMESTAMP is a date-time or seconds; arrivals start at 0. ``rate_scale`` multiplies the
    arrival rate (2.0 halves every gap).
    """
    if not rate_scale > 0:
        raise WorkloadError(f"workload.rate_scale: must be > 0; got {rate_scale}")
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as e:
        raise WorkloadError(f"workload.trace: cannot open {path}: {e.strerror}") from None
    with fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise WorkloadError(
                f"workload.trace: {path} needs columns TIMESTAMP,ContextTokens,GeneratedTokens"
            )
        rows: list[tuple[float | datetime, int, int]] = []
        for n, row in enumerate(reader, start=2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                rows.append(
                    (_parse_time(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
                )
            except (ValueError, TypeError):
                raise WorkloadError(f"workload.trace: {path} line {n}: bad value") from None
    if not rows:
        raise WorkloadError(f"workload.trace: {path} has no requests")
    t0 = rows[0][0]
    out = []
    for i, (t, ctx, gen) in enumerate(rows):
        if isinstance(t, datetime) and isinstance(t0, datetime):
            dt = (t - t0).total_seconds()
        elif isinstance(t, float) and isinstance(t0, float):
            dt = t - t0
        else:
            raise WorkloadError(f"workload.trace: {path}: mixed timestamp formats")
        if ctx < 1 or gen < 0:
            raise WorkloadError(f"workload.trace: {path} request {i}: tokens must be positive")
        out.append(Request(i, dt / rate_scale, ctx, gen))
    out.sort(key=lambda r: (r.arrival_s, r.id))
    return out
