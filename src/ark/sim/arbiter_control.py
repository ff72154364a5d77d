"""The simulator's arbiter control plane (``[network] control = "arbiter"``).

Under broadcast control every host runs an :class:`ark.core.protocol.ArkCore` and learns
the others' reservations a one-way delay late, so two hosts deciding within that delay can
race. Here no host keeps a replica: one real :class:`ark.core.arbiter.Arbiter` decides for
everyone, driven through its bytes API exactly as ``ark arbiter`` drives it:

* a KV flow that arrives at ``t`` sends an :class:`~ark.core.arbiter_wire.Ask` (``parts``
  sub-flows under ``ark-split``); it reaches the arbiter at ``t + rtt/2``, which decides
  then, with that instant as its clock;
* the :class:`~ark.core.arbiter_wire.Grant` is back at the host at ``t + rtt``: the host
  picks a source port of each granted path from its own path map (round-robin per path,
  never a port in use towards that peer, as a core does), or a random port for a part
  the arbiter left to plain ECMP, and the flow starts then: its FCT counts the wait.
  Each host draws those random ports from the same seeded stream, the same way, as its
  :class:`~ark.core.protocol.ArkCore` does under broadcast (common random numbers: a
  comparison of the two modes is not a comparison of two sets of ECMP draws);
* when the flow completes the host frees its ports and sends one
  :class:`~ark.core.arbiter_wire.Drop`, applied at the arbiter ``rtt/2`` later (until
  then the paths stay held);
* the arbiter's timers (forgetting released reservations) fire at its own
  :meth:`~ark.core.arbiter.Arbiter.next_deadline`, never by polling.

One decider stamps its decisions in increasing order, so no decision ever moves an earlier
one: there are no races. :attr:`ArbiterControl.races` still checks it, granted path
against the arbiter's table, when each flow ends. Not modelled: arbiter failure and
takeover, request loss, the arbiter's service time and queueing (``ark.sim.control_plane``
costs those), link failures (the hosts would have to ask again).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ark.core import arbiter_wire as w
from ark.core.arbiter import SAME_LEAF, Arbiter, ArbiterLimits, LeaseFn
from ark.core.flows import FlowSpec
from ark.core.messages import FlowId
from ark.core.node import MAX_SPLIT_PARTS
from ark.core.pathmap import PathMap, PathMapError, PortBuckets
from ark.core.topology import Fabric
from ark.sim.transfer import Transfer

CONTROLS = ("broadcast", "arbiter")
MAX_ASK_PARTS = MAX_SPLIT_PARTS  # parts one Ask may carry (the wire format's bound too)
# The simulator measures placement, not admission: no host may be rate limited or capped.
SIM_LIMITS = ArbiterLimits(max_flows_per_host=1 << 20, rate_per_host=1e9, burst_per_host=1 << 20)
# A lone arbiter beats to no other arbiter: a beat would only wake the event loop.
LONE_HEARTBEAT_S = 1e6


def unsupported(*, jitter_s: float, skew_s: float, control_on_data: bool, link_down: bool, parts: int) -> str:
    """Why arbiter control cannot model this run ("" when it can), in words that name the settings."""
    if jitter_s > 0 or skew_s > 0 or control_on_data:
        return ("models one request round trip (arbiter_rtt_us) only; set control_jitter_us = 0, "
                "clock_skew_us = 0 and control_path = \"separate\"")
    if link_down:
        return "does not model a link failure (the hosts would ask again); leave [failure] out or give it a fraction"
    if parts > MAX_ASK_PARTS:
        return f"grants at most {MAX_ASK_PARTS} parts per request; params.split.parts is {parts}"
    return ""


class Part(NamedTuple):
    """One sub-flow as the host starts it."""

    flow: FlowId | None  # the arbiter's id (None: it granted nothing)
    path: int  # the granted path (-1: not reserved, the switches decide)
    port: int
    reserved: bool
    fallback: bool  # no free path: shared (ark-balance, ark-split) or plain ECMP; as a core counts it


class Granted(NamedTuple):
    """A flow whose grant is back at its host: it starts now on these parts."""

    flow: FlowSpec
    parts: list[Part]


class _Ask(NamedTuple):
    flow: FlowSpec
    sent: float  # the flow's arrival at its host
    data: bytes


class _Grant(NamedTuple):
    flow: FlowSpec
    data: bytes


class _Drop(NamedTuple):
    host: int
    data: bytes


class _Tick(NamedTuple):
    pass


Event = _Ask | _Grant | _Drop | _Tick


class ArbiterControl:
    """One arbiter and the hosts' side of it, for one run of :class:`ark.sim.engine.FluidSim`.

    ``schedule(t, event)`` puts an event on the simulator's heap, which hands it back to
    :meth:`on_event` at ``t``; ``pending()`` is the number of flows not yet finished (the
    arbiter's timer is armed only while some remain, or the run would never end).
    """

    def __init__(
        self, fabric: Fabric, policy: str, pathmaps: Callable[[int, int, int], PathMap], *, rtt_s: float, dport: int,
        parts: int, host_seeds: Sequence[int], retention_s: float, lease: LeaseFn | None,
        schedule: Callable[[float, Event], None], pending: Callable[[], int], start_s: float,
    ) -> None:
        self.rtt, self.dport, self.parts = rtt_s, dport, parts
        self._pathmaps, self._schedule, self._pending = pathmaps, schedule, pending
        self.arbiter = Arbiter(fabric, policy=policy, lease=lease, limits=SIM_LIMITS, retention_s=retention_s,
                               heartbeat_s=LONE_HEARTBEAT_S, takeover_s=2 * LONE_HEARTBEAT_S)
        self.arbiter.start(start_s)
        self._seeds = host_seeds
        self._rngs: dict[int, random.Random] = {}  # per host, made when it first draws
        self._buckets: dict[tuple[int, int], PortBuckets] = {}
        self._cursors: dict[tuple[int, int], tuple[int, ...]] = {}  # of pairs with no port in use
        self._granted: dict[FlowId, int] = {}  # reserved flows in flight -> the path granted
        self._rid = 0
        self._epoch = 0  # the highest epoch the hosts have seen
        self._tick_at = math.inf
        self.requests = 0  # Asks and Drops the hosts sent
        self.sent_by_host = [0] * fabric.n_hosts
        self.races = 0  # granted flows whose path the arbiter moved before they ended (0 by construction)

    # ------------------------------------------------------------------ the engine's calls
    def ask(self, f: FlowSpec, now: float) -> None:
        """A flow arrived at its host: its request is on its way to the arbiter."""
        ask = w.Ask(self._next_rid(), self._epoch, f.dst, f.nbytes, self.dport, self.parts)
        self._count(f.src)
        self._schedule(now + self.rtt / 2, _Ask(f, now, w.encode(ask)))

    def on_event(self, ev: Event, now: float) -> Granted | None:
        """Handle one event due now; a flow whose grant arrived is returned, to be started."""
        if isinstance(ev, _Ask):
            self._decide(ev, now)
        elif isinstance(ev, _Grant):
            return self._granted_at_host(ev)
        elif isinstance(ev, _Drop):
            self.arbiter.on_host(ev.host, ev.data, now)
            self._after_arbiter()
        elif now == self._tick_at:  # an earlier deadline superseded any other tick
            self._tick_at = math.inf
            if self._pending():  # after the last flow there is nothing left to keep tidy for
                self.arbiter.tick(now)
                self._after_arbiter()
        return None

    def done(self, t: Transfer, now: float) -> None:
        """``t`` completed: its host frees its ports and drops its reservations."""
        src, dst = t.res.src, t.res.dst
        b = self._buckets[(src, dst)]
        dropped: list[tuple[int, int]] = []
        for sub in t.subs:
            b.give(sub.port)
            if sub.core_flow is None:
                continue
            path = self._granted.pop(sub.core_flow, None)
            if path is None:
                continue  # plain ECMP: nothing held at the arbiter
            dropped.append(sub.core_flow)
            # Measured, not assumed: the path the arbiter holds for it now is the one it granted.
            e = self.arbiter.table.get(sub.core_flow)
            self.races += e is None or e.path != path
        if not b.in_use:  # no flow to that peer: keep only where each path's walk stands
            self._cursors[(src, dst)] = b.cursors
            del self._buckets[(src, dst)]
        if dropped:
            msg = w.Drop(self._next_rid(), self._epoch, dropped)
            self._count(src)
            self._schedule(now + self.rtt / 2, _Drop(src, w.encode(msg)))

    # ------------------------------------------------------------------ the arbiter's side
    def _decide(self, ev: _Ask, now: float) -> None:
        out = self.arbiter.on_host(ev.flow.src, ev.data, now)
        self._after_arbiter()
        # The answer travels back the other half of the round trip (from the arrival, so
        # that the start is the arrival plus exactly the round trip).
        self._schedule(max(now, ev.sent + self.rtt), _Grant(ev.flow, out[0].data))

    def _after_arbiter(self) -> None:
        """After the arbiter handled something: it sends no copies (no follower), and its
        timer must fire by its next deadline while flows remain."""
        self.arbiter.flush()  # empties its list of changes for followers (none here)
        t = self.arbiter.next_deadline()
        if t < self._tick_at and self._pending():
            self._tick_at = t
            self._schedule(t, _Tick())

    # ------------------------------------------------------------------ the host's side
    def _granted_at_host(self, ev: _Grant) -> Granted:
        f = ev.flow
        msg = w.decode_to_host(ev.data)
        assert isinstance(msg, w.Grant), msg  # a lone leader with no limits answers every Ask
        self._epoch = max(self._epoch, msg.epoch)
        b = self._bucket(f.src, f.dst)
        parts: list[Part] = []
        for p in msg.parts:
            if p.reserved:
                self._granted[p.flow] = p.path
                parts.append(Part(p.flow, p.path, self._reserved_port(f.src, b, p.path), True, p.shared))
            elif p.why == SAME_LEAF:  # one path: any port of it, round-robin, as a core picks it
                parts.append(Part(p.flow, -1, self._reserved_port(f.src, b, 0), False, False))
            else:
                parts.append(Part(p.flow, -1, self._random_port(f.src, b), False, True))
        if not parts:  # an Ask the arbiter refused as invalid (a flow to itself): plain ECMP
            parts = [Part(None, -1, self._random_port(f.src, b), False, True) for _ in range(self.parts)]
        return Granted(f, parts)

    def _bucket(self, src: int, dst: int) -> PortBuckets:
        key = (src, dst)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = PortBuckets(self._pathmaps(src, dst, self.dport))
            cursors = self._cursors.pop(key, None)
            if cursors is not None:
                b.cursors = cursors
        return b

    def _reserved_port(self, host: int, b: PortBuckets, path: int) -> int:
        try:
            return b.take(path)
        except PathMapError:  # every port of the path in use towards this peer: the switches decide
            return self._random_port(host, b)

    def _random_port(self, host: int, b: PortBuckets) -> int:
        """A port not in use towards this peer, drawn uniformly: plain ECMP (the draws of
        ``ArkCore._random_port``, from the same per-host stream)."""
        rng = self._rngs.get(host)
        if rng is None:
            rng = self._rngs[host] = random.Random(self._seeds[host])
        if b.map.sampled:  # only probed ports have a known path
            known = [p for p in b.map.known_ports().tolist() if p not in b.in_use]
            port: int = known[rng.randrange(len(known))]
        else:
            lo, hi = b.map.port_range
            port = rng.randint(lo, hi)
            while port in b.in_use:
                port = rng.randint(lo, hi)
        b.claim(port)
        return port

    def _next_rid(self) -> int:
        # Unique per run: the arbiter answers a repeated request id from its kept answers.
        self._rid += 1
        return self._rid

    def _count(self, host: int) -> None:
        self.requests += 1
        self.sent_by_host[host] += 1
