"""Clock offsets between hosts, measured from heartbeats, and when to stop reserving.

Every HELLO carries its sender's clock at sending. A receiver's sample is
``now - sent_at = (own clock - peer clock) + one-way delay``. Delay only adds, so the
minimum of recent samples is an upper bound on how far our clock is ahead of the peer's,
and a minimum below ``-bound`` proves the peer's clock is ahead of ours by more than the
bound, whatever the delay. Each host lists such peers in its own HELLO (``ahead``).

A host is *skewed* when most of its peers prove it wrong: a majority of them are ahead
of it (it is behind), or a majority list it as ahead of them (it is ahead). A skewed
host's leases would end early or late on its peers' clocks, so it stops reserving (its
flows fall back to plain ECMP) until the majority agrees with it again. With two hosts
there is no majority of one: both stop, which is safe.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 4  # per peer: a clock step is seen within this many heartbeats


@dataclass
class _PeerClock:
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    heard: float = -math.inf
    lists_us_ahead: bool = False  # its last HELLO said our clock is ahead of its own


class ClockWatch:
    """Per-peer offset bounds and the majority verdict, for one host."""

    def __init__(self, bound_s: float, fresh_s: float) -> None:
        self.bound_s = bound_s  # offsets beyond this stop reservations
        self.fresh_s = fresh_s  # peers heard within this long take part in the verdict
        self._peers: dict[int, _PeerClock] = {}

    def hello(self, peer: int, now: float, sent_at: float, ahead: list[int], me: int) -> None:
        pc = self._peers.get(peer)
        if pc is None:
            pc = self._peers[peer] = _PeerClock()
        pc.samples.append(now - sent_at)
        pc.heard = now
        pc.lists_us_ahead = me in ahead

    def offset(self, peer: int) -> float | None:
        """Upper bound of (our clock - the peer's), delay included; None before a sample."""
        pc = self._peers.get(peer)
        return min(pc.samples) if pc is not None and pc.samples else None

    def ahead_of_us(self) -> list[int]:
        """Peers whose clocks are provably ahead of ours by more than the bound."""
        return sorted(p for p, pc in self._peers.items() if pc.samples and min(pc.samples) < -self.bound_s)

    def verdict(self, now: float) -> tuple[bool, str]:
        """(skewed, why) from the peers heard recently."""
        fresh = [p for p, pc in self._peers.items() if pc.samples and now - pc.heard <= self.fresh_s]
        if not fresh:
            return False, ""
        behind = [p for p in fresh if min(self._peers[p].samples) < -self.bound_s]
        ahead = [p for p in fresh if self._peers[p].lists_us_ahead]
        need = len(fresh) // 2 + 1
        if len(behind) >= need:
            return True, f"clock behind {len(behind)} of {len(fresh)} peers by more than {self.bound_s} s"
        if len(ahead) >= need:
            return True, f"clock ahead of {len(ahead)} of {len(fresh)} peers by more than {self.bound_s} s"
        return False, ""

    def estimate(self) -> float | None:
        """Median over peers of the offset bound: roughly our clock minus the cluster's."""
        vals = sorted(v for p in self._peers if (v := self.offset(p)) is not None)
        if not vals:
            return None
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2

    def forget(self, peer: int) -> None:
        self._peers.pop(peer, None)
