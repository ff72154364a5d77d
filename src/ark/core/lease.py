"""The lease formula: how long a reservation lasts unless its owner renews it.

``lease(nbytes, rate) = min(max_s, min_s + slack x nbytes x 8 / rate)``. The owner grants
exactly what its peers accept: a receiver drops any reservation or renewal whose lease
is longer than ``max_s`` (so a 4 TB transfer gets ``max_s`` and renews, it is never
held at its owner alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ark.core.protocol import CoreError

DEFAULT_MAX_LEASE_S = 600.0


@dataclass(frozen=True)
class LeasePolicy:
    min_s: float = 1.0
    slack: float = 2.0
    max_s: float = DEFAULT_MAX_LEASE_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_s) and self.min_s > 0):
            raise CoreError(f"lease.min_s: must be > 0; got {self.min_s}")
        if not (math.isfinite(self.slack) and self.slack >= 1):
            raise CoreError(f"lease.slack: must be >= 1; got {self.slack}")
        if not (math.isfinite(self.max_s) and self.max_s > self.min_s):
            raise CoreError(f"lease.max_s: must be > lease.min_s ({self.min_s}); got {self.max_s}")

    def __call__(self, nbytes: int, rate_bps: float) -> float:
        return min(self.max_s, self.min_s + self.slack * nbytes * 8.0 / rate_bps)

    def accepts(self, ts: float, expires: float) -> bool:
        """Would a receiver take a lease from ``ts`` to ``expires``?"""
        return ts <= expires <= ts + self.max_s
