"""Clock offsets between hosts, measured by each host itself, and when to stop reserving.

Every HELLO carries its sender's clock at sending (``sent_at``) and, for a few peers it
heard lately, an *echo*: that peer's last ``sent_at`` and the sender's clock when it
arrived. A host that finds its own ``sent_at`` echoed back has the four timestamps of a
round trip (NTP's ``t1 .. t4``, two on each clock) and measures the peer's offset
itself::

    theta = ((t2 - t1) + (t3 - t4)) / 2      peer clock - own clock
    delta = (t4 - t1) - (t3 - t2)            round-trip delay: |error of theta| <= delta / 2

``t1`` must be one of the host's own recent heartbeats and ``t4 - t1`` is read on its own
clock, so a peer chooses only ``t2`` and ``t3``: its own clock readings. A lying peer can
therefore misstate *its own* offset, and nothing else. Between round trips, the plain
heartbeat ``now - sent_at = own - peer + delay`` bounds ``theta`` from below (delay only
adds), which proves a peer ahead of us at once.

Each peer is one vote. A peer is *ahead* when every measurement leaves ``theta > bound``
and *behind* when they leave ``theta < -bound``. A host is *skewed* when more than half of
its recently heard peers are ahead of it, or more than half behind it. No peer's claim
about a third host is used, so with fewer than half of a host's peers lying:

* an honest host (clock within the bound of the honest majority) is never fenced: the
  liars are too few to make a majority, and honest peers measure it within the bound;
* a host whose clock is off by more than the bound (plus the measurement error) is
  fenced within two heartbeats: the honest majority measures it off.

Receivers also judge a peer's reservations by their own measurement of that peer
(:meth:`ClockWatch.off`, beyond twice the bound: two honest hosts may each be within the
bound of the majority and up to twice the bound apart), so a skewed host's reservations
are refused where they land, whatever that host believes. With two hosts there is no majority of one: both stop, which
is safe.

Lease times are judged without a vote: :meth:`ClockWatch.behind` is how far a peer's clock
runs behind ours by our own measurement, rounded to the bound (0 within it), and a replica
holds a reservation against a later one of another owner until its stated end plus how
far its owner runs behind that owner (:meth:`ark.core.table.ReservationTable.set_clock`),
so a skewed owner's flows end no earlier than they really do, whoever vouches for it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 4  # per peer: a clock step is seen within this many heartbeats
OWN_HELLOS = 8  # own recent send times an echo may name
ECHOES_PER_HELLO = 16  # echoes one HELLO carries (rotating over the peers heard)


@dataclass
class _PeerClock:
    # (arrival, lo, hi) for theta = peer - own: a heartbeat gives [-(own - peer + delay),
    # inf), a round trip [theta - delta / 2, theta + delta / 2]. Kept apart, so that the
    # round trips, which come once every few heartbeats in a large cluster (the echoes
    # rotate), are not pushed out by the heartbeats in between.
    one_way: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    round_trips: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    heard: float = -math.inf
    last_sent_at: float = 0.0  # the peer's last HELLO, to echo ...
    last_arrival: float = 0.0  # ... with our clock when it arrived

    def bounds(self) -> tuple[float, float]:
        """[lo, hi] for theta: the intersection of the recent intervals, newest first,
        stopping at the first that contradicts the newer ones (a clock step since)."""
        lo, hi = -math.inf, math.inf
        for _t, a, b in sorted([*self.one_way, *self.round_trips], reverse=True):
            if max(lo, a) > min(hi, b):
                break
            lo, hi = max(lo, a), min(hi, b)
        return lo, hi


class ClockWatch:
    """One host's measured offsets to its peers, and the majority verdict."""

    def __init__(self, bound_s: float, fresh_s: float) -> None:
        self.bound_s = bound_s  # offsets beyond this stop reservations
        self.fresh_s = fresh_s  # peers heard within this long take part in the verdict
        self._peers: dict[int, _PeerClock] = {}
        self._sent: deque[float] = deque(maxlen=OWN_HELLOS)
        self._rotation = 0
        self.bad_echoes = 0  # echoes that named no heartbeat of ours or gave a negative delay

    # ------------------------------------------------------------------ heartbeats
    def sent(self, now: float) -> None:
        """Our heartbeat leaves with ``now`` as its ``sent_at``."""
        self._sent.append(now)

    def echoes(self, now: float) -> list[list[float | int]]:
        """``[peer, its sent_at, our arrival time]`` for up to :data:`ECHOES_PER_HELLO` peers
        heard lately, rotating, so that every peer gets a round trip within a few heartbeats."""
        heard = sorted(p for p, pc in self._peers.items() if now - pc.heard <= self.fresh_s)
        if not heard:
            return []
        k = min(ECHOES_PER_HELLO, len(heard))
        start = self._rotation % len(heard)
        self._rotation = start + k
        picked = [heard[(start + i) % len(heard)] for i in range(k)]
        return [[p, self._peers[p].last_sent_at, self._peers[p].last_arrival] for p in picked]

    def hello(self, peer: int, now: float, sent_at: float, echoes: list[tuple[int, float, float]], me: int) -> None:
        """A peer's heartbeat: a one-way sample, and a round trip if it echoes ours."""
        pc = self._peers.get(peer)
        if pc is None:
            pc = self._peers[peer] = _PeerClock()
        pc.one_way.append((now, sent_at - now, math.inf))
        pc.heard, pc.last_sent_at, pc.last_arrival = now, sent_at, now
        for host, t1, t2 in echoes:
            if host == me:
                self._round_trip(pc, t1, t2, sent_at, now)
                break

    def _round_trip(self, pc: _PeerClock, t1: float, t2: float, t3: float, t4: float) -> None:
        if t1 not in self._sent:
            self.bad_echoes += 1  # not a heartbeat of ours: nothing to measure
            return
        delta = (t4 - t1) - (t3 - t2)
        if not (math.isfinite(delta) and delta >= 0):
            self.bad_echoes += 1
            return
        theta = ((t2 - t1) + (t3 - t4)) / 2
        pc.round_trips.append((t4, theta - delta / 2, theta + delta / 2))

    # ------------------------------------------------------------------ judgement
    def off(self, peer: int, factor: float = 1.0) -> bool:
        """Is the peer's clock provably further than ``factor`` x the bound from ours?"""
        pc = self._peers.get(peer)
        if pc is None:
            return False
        lo, hi = pc.bounds()
        return lo > factor * self.bound_s or hi < -factor * self.bound_s

    def behind(self, peer: int, cap: float) -> float:
        """How far the peer's clock runs behind ours, by our own measurement (negative:
        ahead): 0 while it may be within the bound, else our estimate rounded to a multiple
        of the bound and within ``cap`` either way. The rounding makes two hosts that
        measured the same clock agree on the figure, unless it lies near half a step; a
        receiver adds the bound again to any positive difference between two owners (see
        :meth:`ark.core.table.ReservationTable.lag`), so a skewed owner's reservations hold
        no shorter than they really last, whatever anyone votes."""
        est = self.offset(peer)
        if est is None or not math.isfinite(est) or abs(est) <= self.bound_s:
            return 0.0
        est = max(-cap, min(cap, est))
        grain = self.bound_s if self.bound_s > 0 else 0.0
        return max(-cap, min(cap, round(est / grain) * grain if grain else est))

    def offset(self, peer: int) -> float | None:
        """Our clock minus the peer's: the middle of the measured interval, or its one
        finite end (a heartbeat alone bounds it from one side); None before a sample."""
        pc = self._peers.get(peer)
        if pc is None or not (pc.one_way or pc.round_trips):
            return None
        lo, hi = pc.bounds()
        return -(lo + hi) / 2 if math.isfinite(hi) else -lo

    def ahead_of_us(self) -> list[int]:
        """Peers whose clocks are provably ahead of ours by more than the bound."""
        return sorted(p for p, pc in self._peers.items() if pc.bounds()[0] > self.bound_s)

    def behind_us(self) -> list[int]:
        """Peers whose clocks are provably behind ours by more than the bound."""
        return sorted(p for p, pc in self._peers.items() if pc.bounds()[1] < -self.bound_s)

    def verdict(self, now: float) -> tuple[bool, str] | None:
        """(skewed, why) from the peers heard recently; None when none was (no evidence)."""
        fresh = {p for p, pc in self._peers.items() if now - pc.heard <= self.fresh_s}
        if not fresh:
            return None
        need = len(fresh) // 2 + 1
        ahead = [p for p in self.ahead_of_us() if p in fresh]
        behind = [p for p in self.behind_us() if p in fresh]
        if len(ahead) >= need:
            return True, f"clock behind {len(ahead)} of {len(fresh)} peers by more than {self.bound_s} s"
        if len(behind) >= need:
            return True, f"clock ahead of {len(behind)} of {len(fresh)} peers by more than {self.bound_s} s"
        return False, ""

    def trusted(self, now: float) -> bool:
        """Do more than half of the peers heard lately measure within the bound of us? Only
        then does this host judge others' clocks by its own (a host that has not measured
        its peers yet, or is itself off, must not refuse what they take)."""
        fresh = [pc for pc in self._peers.values() if now - pc.heard <= self.fresh_s]
        close = 0
        for pc in fresh:
            lo, hi = pc.bounds()
            close += -self.bound_s <= lo and hi <= self.bound_s
        return 2 * close > len(fresh)

    def estimate(self) -> float | None:
        """Median over peers of our offset to each: roughly our clock minus the cluster's."""
        vals = sorted(v for p in self._peers if (v := self.offset(p)) is not None)
        if not vals:
            return None
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2

    def forget(self, peer: int) -> None:
        self._peers.pop(peer, None)
