"""The simulator's arbiter control plane (``[network] control = "arbiter"``).

Under broadcast control every host runs an :class:`ark.core.protocol.ArkCore` and learns
the others' reservations a one-way delay late, so two hosts deciding within that delay can
race. Here no host keeps a replica: one real :class:`ark.core.arbiter.Arbiter` decides for
everyone, driven through its bytes API exactly as ``ark arbiter`` drives it:

* a KV flow that arrives at ``t`` sends an :class:`~ark.core.arbiter_wire.Ask` (``parts``
  sub-flows under ``ark-split``); it reaches the arbiter at ``t + rtt/2``, which decides
  then, with that instant as its clock;
* the :class:`~ark.core.arbiter_wire.Grant` is back at the host at ``t + rtt``: the host's
  own :class:`~ark.core.protocol.ArkCore` places each part as an agent's does
  (:meth:`~ark.core.protocol.ArkCore.place`: a source port of the granted path from its
  map, round-robin, never one in use towards that peer; a random port for a part left to
  plain ECMP; path 0's next port within a leaf), and the flow starts then: its FCT counts
  the wait. A granted path with no free port here goes out as plain ECMP and its
  reservation is dropped at once, as an agent drops it. Each host's core draws from the
  same seeded stream as under broadcast (common random numbers: a comparison of the two
  modes is not a comparison of two sets of ECMP draws);
* when the flow completes its core frees the ports and the host sends one
  :class:`~ark.core.arbiter_wire.Drop`, applied at the arbiter ``rtt/2`` later (until
  then the paths stay held);
* the arbiter's timers (forgetting released reservations) fire at its own
  :meth:`~ark.core.arbiter.Arbiter.next_deadline`, never by polling.

One decider stamps its decisions in increasing order, so no decision ever moves an earlier
one: there are no races. :attr:`ArbiterControl.races` still checks it, granted path
against the arbiter's table, when each flow ends. Not modelled: arbiter failure and
takeover, request loss, the arbiter's service time and queueing (``ark.sim.control_cost``
costs those), link failures (the hosts would have to ask again).

It answers the calls of every control plane (:mod:`ark.sim.control`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ark.core import arbiter_wire as w
from ark.core.arbiter import Arbiter, ArbiterLimits, LeaseFn
from ark.core.flows import FlowSpec
from ark.core.messages import FlowId
from ark.core.node import MAX_SPLIT_PARTS
from ark.core.protocol import ArkCore, Decision, PathMaps
from ark.core.topology import Fabric
from ark.sim.control import Counters, Loop, Part
from ark.sim.transfer import Transfer

MAX_ASK_PARTS = MAX_SPLIT_PARTS  # parts one Ask may carry (the wire format's bound too)
# The simulator measures placement, not admission: no host may be rate limited or capped.
SIM_LIMITS = ArbiterLimits(max_flows_per_host=1 << 20, rate_per_host=1e9, burst_per_host=1 << 20)
# A lone arbiter beats to no other arbiter: a beat would only wake the event loop.
LONE_HEARTBEAT_S = 1e6
REFUSED = "refused by the arbiter"  # an Ask it answered with no part (a flow to the asking host)


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


class ArbiterControl:
    """One arbiter and the hosts' side of it, for one run of :class:`ark.sim.engine.FluidSim`.

    Its events go on the loop's heap (:meth:`Loop.control_at`), which hands them back to
    :meth:`on_event`; the arbiter's timer is armed only while flows remain
    (:attr:`Loop.pending`), or the run would never end.
    """

    name = "arbiter"

    def __init__(
        self, fabric: Fabric, policy: str, pathmaps: PathMaps, loop: Loop, *, rtt_s: float, dport: int,
        parts: int, host_seeds: Sequence[int], retention_s: float, lease: LeaseFn | None, start_s: float,
    ) -> None:
        self.rtt, self.dport, self.parts = rtt_s, dport, parts
        self._loop = loop
        self.arbiter = Arbiter(fabric, policy=policy, lease=lease, limits=SIM_LIMITS, retention_s=retention_s,
                               heartbeat_s=LONE_HEARTBEAT_S, takeover_s=2 * LONE_HEARTBEAT_S)
        self.arbiter.start(start_s)
        self._fabric, self._pathmaps, self._policy = fabric, pathmaps, policy
        self._seeds, self._retention = host_seeds, retention_s
        self._cores: dict[int, ArkCore] = {}  # per host, made when it first has a flow
        self._granted: dict[FlowId, int] = {}  # reserved flows in flight -> the path granted
        self._rid = 0
        self._epoch = 0  # the highest epoch the hosts have seen
        self._tick_at = math.inf
        self.requests = 0  # Asks and Drops the hosts sent
        self.sent_by_host = [0] * fabric.n_hosts
        self.races = 0  # granted flows whose path the arbiter moved before they ended (0 by construction)
        self._events = 0

    # ------------------------------------------------------------------ the engine's calls
    def ask(self, f: FlowSpec, now: float) -> None:
        """A flow arrived at its host: its request is on its way to the arbiter."""
        ask = w.Ask(self._next_rid(), self._epoch, f.dst, f.nbytes, self.dport, self.parts)
        self._count(f.src)
        self._loop.control_at(now + self.rtt / 2, _Ask(f, now, w.encode(ask)))

    def on_event(self, ev: object, now: float) -> None:
        """Handle one event due now; a flow whose grant arrived starts."""
        self._events += 1  # every one counts, a superseded tick too
        if isinstance(ev, _Ask):
            self._decide(ev, now)
        elif isinstance(ev, _Grant):
            self._granted_at_host(ev, now)
        elif isinstance(ev, _Drop):
            self.arbiter.on_host(ev.host, ev.data, now)
            self._after_arbiter()
        elif now == self._tick_at:  # an earlier deadline superseded any other tick
            self._tick_at = math.inf
            if self._loop.pending:  # after the last flow there is nothing left to keep tidy for
                self.arbiter.tick(now)
                self._after_arbiter()

    def done(self, t: Transfer, now: float) -> None:
        """``t`` completed: its host's core frees its ports and the host drops its reservations."""
        src = t.res.src
        core = self._cores[src]
        dropped: list[FlowId] = []
        for sub in t.subs:
            assert sub.core_flow is not None  # every part has an id: the arbiter's or the core's
            core.release(sub.core_flow, now)  # its table holds only this host's flows: nothing to send
            path = self._granted.pop(sub.core_flow, None)
            if path is None:
                continue  # plain ECMP: nothing held at the arbiter
            dropped.append(sub.core_flow)
            # Measured, not assumed: the path the arbiter holds for it now is the one it granted.
            e = self.arbiter.table.get(sub.core_flow)
            self.races += e is None or e.path != path
        if now >= core.next_deadline():  # forget released entries, as an agent's timer does
            core.tick(now)
        self._send_drop(src, dropped, now)

    def rebuild(self, now: float) -> None:
        raise AssertionError("arbiter control does not model a link failure (unsupported() refuses it)")

    def holds(self, flow: FlowId) -> bool:
        return flow in self._granted

    def counters(self) -> Counters:
        """The requests each host sent (Ask, Drop), and the one-way delay to the arbiter."""
        one_way = self.rtt / 2
        return Counters(self.races, self.requests, list(self.sent_by_host), one_way, one_way, self._events,
                        rtt_s=self.rtt)

    def _send_drop(self, host: int, flows: list[FlowId], now: float) -> None:
        if flows:
            msg = w.Drop(self._next_rid(), self._epoch, flows)
            self._count(host)
            self._loop.control_at(now + self.rtt / 2, _Drop(host, w.encode(msg)))

    # ------------------------------------------------------------------ the arbiter's side
    def _decide(self, ev: _Ask, now: float) -> None:
        out = self.arbiter.on_host(ev.flow.src, ev.data, now)
        self._after_arbiter()
        # The answer travels back the other half of the round trip (from the arrival, so
        # that the start is the arrival plus exactly the round trip).
        self._loop.control_at(max(now, ev.sent + self.rtt), _Grant(ev.flow, out[0].data))

    def _after_arbiter(self) -> None:
        """After the arbiter handled something: it sends no copies (no follower), and its
        timer must fire by its next deadline while flows remain."""
        self.arbiter.flush()  # empties its list of changes for followers (none here)
        t = self.arbiter.next_deadline()
        if t < self._tick_at and self._loop.pending:
            self._tick_at = t
            self._loop.control_at(t, _Tick())

    # ------------------------------------------------------------------ the host's side
    def _granted_at_host(self, ev: _Grant, now: float) -> None:
        f = ev.flow
        msg = w.decode_to_host(ev.data)
        assert isinstance(msg, w.Grant), msg  # a lone leader with no limits answers every Ask
        self._epoch = max(self._epoch, msg.epoch)
        core = self._core(f.src)
        parts: list[Part] = []
        unplaced: list[FlowId] = []
        for p in msg.parts:
            dec = core.place(p.flow, f.dst, f.nbytes, now, self.dport, p.path if p.reserved else None,
                             shared=p.shared, lease_s=p.lease_s, why=p.why)
            if dec.reserved:
                self._granted[p.flow] = p.path
            elif p.reserved:  # no free port of that path here: the arbiter need not keep it
                unplaced.append(p.flow)
            parts.append(_part(dec))
        if not msg.parts:  # an Ask the arbiter refused as invalid: plain ECMP under the core's own ids
            parts = [_part(core.request(f.dst, f.nbytes, now, self.dport, reserve=False, why=REFUSED))
                     for _ in range(self.parts)]
        self._send_drop(f.src, unplaced, now)
        self._loop.start(f, parts)

    def _core(self, host: int) -> ArkCore:
        core = self._cores.get(host)
        if core is None:
            # Its table holds only its own flows (placed, never decided again); it keeps port
            # buckets only for peers it has flows to, as under broadcast.
            core = self._cores[host] = ArkCore(host, self._fabric, self._pathmaps, policy=self._policy,
                                               seed=self._seeds[host], retention_s=self._retention,
                                               max_idle_peers=0)
        return core

    def _next_rid(self) -> int:
        # Unique per run: the arbiter answers a repeated request id from its kept answers.
        self._rid += 1
        return self._rid

    def _count(self, host: int) -> None:
        self.requests += 1
        self.sent_by_host[host] += 1


def _part(dec: Decision) -> Part:
    return Part(dec.flow, dec.path if dec.reserved else -1, dec.port, dec.reserved, dec.fallback)
