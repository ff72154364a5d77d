"""Is a run long enough to be steady? Its warm-up and drain, measured on its own requests.

A request keeps the fabric busy from its arrival until its KV cache has arrived: its
prefill (and any wait for a prefill GPU), then its KV flow. Call that its *sojourn*. A
request that arrives within one sojourn of a run's first arrival meets fewer flows than it
would in the middle of a long run (the warm-up); one that arrives within a sojourn of the
last arrival meets fewer too, as arrivals stop (the drain). A run's *edge* is the P95
sojourn of its requests, and its *steady part* the requests that arrive at least one edge
after the first arrival and one edge before the last.

Measured: with a long prefill (a 70B model's is seconds per request) the edge can outlast a
short run, and a run of a few hundred requests is then warm-up and drain only: its
verdicts shrink towards "no difference" and grow with run length (docs/simulator.md).

A sweep point (one QPS) is *steady* when every run's steady part holds at least
:data:`STEADY_SHARE` of its requests and the mean FCT does not rise through the steady part
in every run (a fabric that cannot carry the load: FCTs grow for as long as the run lasts).
A run is long enough at ``QPS x (span) >= 2 x QPS x edge / (1 - STEADY_SHARE)`` requests,
``4 x QPS x edge`` with a steady half: :func:`check` names that count (measured edge,
rounded up) when a point is not steady. The edge itself grows as congestion builds, so a
count named from a far too short run can be short again: the next run says so.

Pure: numpy only; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

EDGE_PERCENTILE = 95
STEADY_SHARE = 0.5  # of a run's requests, at least, in its steady part
RISE = 0.25  # mean FCT up by more than this from the steady part's first half to its second: rising
MIN_STEADY = 20  # fewer steady requests than this: no rise measured
RUN_KEYS = ("arrival_span_s", "edge_s", "steady_share", "steady_rise")


def run_fields(arrivals: Sequence[float], kv_starts: Sequence[float],
               fcts: Sequence[float]) -> dict[str, float | None]:
    """One run's span of arrivals, edge, steady share and rise (:data:`RUN_KEYS`; the rise is
    None with fewer than :data:`MIN_STEADY` steady requests), from its requests in arrival
    order: arrival, KV-flow start and FCT of each."""
    a = np.asarray(arrivals, float)
    if len(a) == 0:
        return {"arrival_span_s": 0.0, "edge_s": 0.0, "steady_share": 0.0, "steady_rise": None}
    f = np.asarray(fcts, float)
    a = a - a.min()
    span = float(a.max())
    edge = float(np.percentile(np.asarray(kv_starts, float) - np.asarray(arrivals, float) + f, EDGE_PERCENTILE))
    steady = f[(a >= edge) & (a <= span - edge)]
    rise = None
    if len(steady) >= MIN_STEADY:
        h = len(steady) // 2
        first = float(steady[:h].mean())
        rise = round(float(steady[h:].mean()) / first - 1.0, 6) if first > 0 else None
    return {"arrival_span_s": round(span, 6), "edge_s": round(edge, 6),
            "steady_share": round(len(steady) / len(a), 6), "steady_rise": rise}


@dataclass(frozen=True)
class Steadiness:
    """One QPS of a sweep: its runs' worst edge and steady share, whether FCTs rise through
    every run, and the request count that would do (None: steady, or no count would)."""

    qps: float
    requests: int
    offered_load: float
    edge_s: float
    share: float
    rising: bool
    needed: int | None

    @property
    def overloaded(self) -> bool:
        return self.rising or self.offered_load >= 1.0

    @property
    def steady(self) -> bool:
        return self.share >= STEADY_SHARE and not self.overloaded

    def as_dict(self) -> dict[str, Any]:
        return {"qps": self.qps, "requests": self.requests, "offered_load": self.offered_load, "edge_s": self.edge_s,
                "steady_share": self.share, "rising": self.rising, "overloaded": self.overloaded,
                "steady": self.steady, "requests_needed": self.needed}


def _round_up(n: float) -> int:
    """Up to two significant digits: 4046 -> 4100."""
    if n <= 100:
        return max(1, math.ceil(n))
    step = 10 ** (int(math.log10(n)) - 1)
    return int(math.ceil(n / step) * step)


def check(records: Sequence[dict[str, Any]]) -> list[Steadiness]:
    """Per QPS of a sweep's records (each with :data:`RUN_KEYS`, ``offered_load`` and
    ``requests``), in QPS order."""
    by: dict[float, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["qps"], []).append(r)
    out = []
    for q in sorted(by):
        rs = by[q]
        edge = max(r["edge_s"] for r in rs)
        share = min(r["steady_share"] for r in rs)
        rises = [r["steady_rise"] for r in rs]
        rising = all(x is not None and x > RISE for x in rises)
        load = float(np.mean([r["offered_load"] for r in rs]))
        n = max(r["requests"] for r in rs)
        st = Steadiness(q, n, round(load, 4), round(edge, 3), round(share, 4), rising, None)
        if not st.steady and not st.overloaded:
            # A steady half at this edge: span >= 4 x edge, and requests = QPS x span.
            st = Steadiness(q, n, st.offered_load, st.edge_s, st.share, rising, max(_round_up(4 * q * edge), n + 1))
        out.append(st)
    return out


def warning(checks: Sequence[Steadiness]) -> str | None:
    """One line about the points that are not steady (None when all are)."""
    short = [c for c in checks if not c.steady and not c.overloaded]
    over = [c for c in checks if c.overloaded]
    parts = []
    if short:
        n = max(c.requests for c in short)
        need = max(c.needed or 0 for c in short)
        qs = ", ".join(f"{c.qps:g}" for c in short)
        edge = max(c.edge_s for c in short)
        share = min(c.share for c in short)
        parts.append(f"runs of {n:,} requests are too short to be steady at QPS {qs} (warm-up and drain each last "
                     f"about {edge:.0f} s of arrivals, leaving {share:.0%} of the requests steady): the figures "
                     f"there change with run length; use --requests {need:,} or more")
    if over:
        qs = ", ".join(f"{c.qps:g} (offered load {c.offered_load:.2f})" for c in over)
        parts.append(f"at QPS {qs} the fabric is overloaded (FCTs rise through every run, or the offered load is 1 "
                     "or more): figures there grow with run length whatever the request count")
    return "; ".join(parts) if parts else None
