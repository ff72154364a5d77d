"""Discrete-event fluid (flow-level) fabric simulator.

Flows share bandwidth max-min fairly over every directed link they cross (source NIC,
leaf uplink, spine downlink, destination NIC); rates are recomputed at each arrival,
completion and re-path. Link capacity is line rate x transport efficiency (payload
goodput, see ``ark.core.topology.TRANSPORTS``). Events sit on a heap keyed ``(time, seq)``;
one seeded generator per run owns every random draw, so a seed fixes the run.

:class:`FluidSim` is a small event loop: :meth:`~FluidSim.schedule` puts an event on the
heap, :meth:`~FluidSim.step` advances to the next event or flow completion and handles
it, :meth:`~FluidSim.run` steps until every flow has finished.

Schemes:

* ``ecmp``: every flow gets a random source port from the port range; the simulated
  source leaf hashes its exact key bytes with the fabric's hash model.
* ``ark`` / ``ark-balance``: one :class:`ark.core.protocol.ArkCore` per host; messages reach
  peers after the control-plane one-way delay, so races happen as they would. The
  switches still hash the chosen port; any disagreement with the reserved path is
  counted in ``path_mismatches``. The cores' timers fire at their own deadlines
  (:meth:`ArkCore.next_deadline`), never by polling.
* ``spray``: ideal per-packet spraying: a flow between two leaves uses the aggregate of
  all uplinks of its source leaf and all downlinks of its destination leaf. The bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.messages import FlowId, Message
from ark.core.pathmap import ROCE_PORT_RANGE, PathMap, PathMapCache, switch_path
from ark.core.protocol import ArkCore, Repath
from ark.core.topology import Fabric
from ark.sim.maxmin import maxmin_rates

__all__ = ["SCHEMES", "FlowResult", "FlowSpec", "FluidSim", "SimError", "SimResult", "maxmin_rates"]

SCHEMES = ("ecmp", "ark", "ark-balance", "spray")

_START, _DELIVER, _TIMER = 0, 1, 2


class SimError(ValueError):
    """Invalid simulator parameters."""


@dataclass
class FlowResult:
    id: int
    src: int
    dst: int
    nbytes: int
    start_s: float
    finish_s: float = math.nan
    path: int = -1
    port: int = -1
    reserved: bool = False
    fallback: bool = False
    repaths: int = 0

    @property
    def fct_s(self) -> float:
        return self.finish_s - self.start_s


@dataclass
class SimResult:
    scheme: str
    flows: list[FlowResult]
    races: int
    fallbacks: int
    path_mismatches: int
    max_concurrent_per_spine: list[int]
    events: int
    spine_timeline: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    control_messages: int = 0


class _Active:
    __slots__ = ("core_flow", "links", "rate", "remaining", "res", "spines")

    def __init__(self, res: FlowResult, links: tuple[int, ...], spines: tuple[int, ...]) -> None:
        self.res = res
        self.links = links
        self.remaining = float(res.nbytes)
        self.rate = 0.0
        self.core_flow: FlowId | None = None
        self.spines = spines


class FluidSim:
    """One run of one scheme over one list of flows."""

    def __init__(
        self,
        fabric: Fabric,
        scheme: str,
        *,
        seed: int = 0,
        control_delay_s: float = 20e-6,
        control_jitter_s: float = 0.0,
        dport: int = 4791,
        port_range: tuple[int, int] = ROCE_PORT_RANGE,
        pathmaps: Callable[[int, int, int], PathMap] | None = None,
        record_timeline: bool = False,
        retention_s: float = 5.0,
    ) -> None:
        if scheme not in SCHEMES:
            raise SimError(f"scheme: must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        if control_delay_s < 0 or control_jitter_s < 0:
            raise SimError("control_delay_us: must be >= 0")
        self.fabric, self.scheme = fabric, scheme
        self.delay, self.jitter = control_delay_s, control_jitter_s
        self.dport, self.port_range = dport, port_range
        self.rng = np.random.default_rng(seed)
        self.record_timeline = record_timeline
        self.pathmaps = pathmaps or PathMapCache(fabric, port_range)
        self.capacity = self._capacities()
        self.cores: list[ArkCore] = []
        if scheme in ("ark", "ark-balance"):
            child = self.rng.integers(0, 2**63 - 1, fabric.n_hosts)
            self.cores = [
                ArkCore(h, fabric, self.pathmaps, policy=scheme, seed=int(child[h]), retention_s=retention_s)
                for h in range(fabric.n_hosts)
            ]
        self._handlers: dict[int, Callable[[Any], None]] = {
            _START: self._on_start, _DELIVER: self._on_deliver, _TIMER: self._on_timer,
        }

    def _capacities(self) -> list[float]:
        """Payload bytes/s per link, then the spray bundles: a leaf's uplinks, a leaf's downlinks."""
        fab = self.fabric
        n_links = fab.n_links
        cap = [lk.capacity_bps * fab.efficiency / 8.0 for lk in fab.links]
        self._up_bundle = [n_links + a for a in range(fab.n_leaves)]
        self._down_bundle = [n_links + fab.n_leaves + b for b in range(fab.n_leaves)]
        for a in range(fab.n_leaves):
            cap.append(sum(cap[fab.uplink(a, k)] for k in range(fab.n_spines)))
        for b in range(fab.n_leaves):
            cap.append(sum(cap[fab.downlink(k, b)] for k in range(fab.n_spines)))
        return cap

    # ------------------------------------------------------------------ the loop
    def run(self, flows: Sequence[FlowSpec]) -> SimResult:
        self._reset(flows)
        while self._pending or self._heap:
            self.step()
        return SimResult(
            self.scheme, [self._results[f.id] for f in flows], sum(c.counters.races_lost for c in self.cores),
            self._fallbacks, self._mismatches, self._spine_max, self._events, self._timeline, self._messages,
        )

    def _reset(self, flows: Sequence[FlowSpec]) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        for f in flows:
            if f.nbytes < 0 or not math.isfinite(f.start_s):
                raise SimError(f"flow {f.id}: needs nbytes >= 0 and a finite start")
            self.schedule(f.start_s, _START, f)
        self._results = {f.id: FlowResult(f.id, f.src, f.dst, f.nbytes, f.start_s) for f in flows}
        self._active: dict[int, _Active] = {}
        self._by_core_flow: dict[FlowId, _Active] = {}
        self._spine_now = [0] * self.fabric.n_spines
        self._spine_max = [0] * self.fabric.n_spines
        self._timeline: list[tuple[float, tuple[int, ...]]] = []
        self._mismatches = self._fallbacks = self._messages = self._events = 0
        self._now = self._last = 0.0
        self._dirty = False
        self._pending = len(flows)
        self._timer_at = math.inf

    def schedule(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, data))
        self._seq += 1

    def step(self) -> None:
        """Advance to the next flow completion or event and handle it."""
        if self._dirty and self._active:
            self._update_rates()
        t_comp = self._next_completion()
        t_ev = self._heap[0][0] if self._heap else math.inf
        if t_comp == math.inf and t_ev == math.inf:
            raise SimError("stalled: active flows but no rate (a zero-capacity link?)")
        self._advance(min(t_comp, t_ev))
        if t_comp <= t_ev:
            self._events += 1
            self._complete()
            return
        _, _, kind, data = heapq.heappop(self._heap)
        if kind == _TIMER and self._now != self._timer_at:
            return  # superseded by an earlier deadline
        self._events += 1
        self._handlers[kind](data)

    def _update_rates(self) -> None:
        acts = list(self._active.values())
        for a, r in zip(acts, maxmin_rates([a.links for a in acts], self.capacity), strict=True):
            a.rate = r
        self._dirty = False

    def _next_completion(self) -> float:
        t_comp = math.inf
        last = self._last
        for a in self._active.values():
            if a.rate > 0:
                tc = last + a.remaining / a.rate
                if tc < t_comp:
                    t_comp = tc
        return t_comp

    def _advance(self, now: float) -> None:
        dt = now - self._last
        self._now = now
        if dt > 0:
            for a in self._active.values():
                a.remaining -= a.rate * dt
            self._last = now

    # ------------------------------------------------------------------ events
    def _complete(self) -> None:
        now, active = self._now, self._active
        # Relative tolerance: an absolute one can stall the clock below one ulp.
        done = [a for a in active.values() if a.remaining <= a.rate * 1e-9]
        if not done:
            done = [min(active.values(), key=lambda a: a.remaining / a.rate if a.rate else math.inf)]
        for a in done:
            del active[a.res.id]
            a.res.finish_s = now
            self._pending -= 1
            self._count_spines(a, -1)
            if a.core_flow is not None:
                core = self.cores[a.res.src]
                rel = core.release(a.core_flow, now)
                del self._by_core_flow[a.core_flow]
                self._broadcast(a.res.src, rel.messages)
                self._apply_repaths(rel.events)
                self._arm_timer(core)
        self._spines_changed()
        self._dirty = True

    def _on_start(self, f: FlowSpec) -> None:
        res = self._results[f.id]
        if f.nbytes == 0:
            res.finish_s = self._now
            self._pending -= 1
            return
        core_flow = None
        if self.scheme == "ecmp":
            lo, hi = self.port_range
            port = int(self.rng.integers(lo, hi + 1))
            path = self._switch(f.src, f.dst, port)
        elif self.scheme == "spray":
            port, path = -1, -1
        else:
            port, path, core_flow = self._reserve(f, res)
        res.path, res.port = path, port
        links, spines = self._links(f.src, f.dst, max(path, 0))
        act = _Active(res, links, spines)
        act.core_flow = core_flow
        self._active[f.id] = act
        if core_flow is not None:
            self._by_core_flow[core_flow] = act
        self._count_spines(act, +1)
        self._spines_changed()
        self._dirty = True

    def _reserve(self, f: FlowSpec, res: FlowResult) -> tuple[int, int, FlowId]:
        """ARK: the source host's core picks the path; the simulated switch hashes the port."""
        core = self.cores[f.src]
        dec = core.request(f.dst, f.nbytes, self._now, self.dport)
        path = self._switch(f.src, f.dst, dec.port)
        if path != dec.path:
            self._mismatches += 1
        res.reserved, res.fallback = dec.reserved, dec.fallback
        self._fallbacks += dec.fallback
        self._broadcast(f.src, dec.messages)
        self._apply_repaths(dec.events)
        self._arm_timer(core)
        return dec.port, path, dec.flow

    def _on_deliver(self, data: tuple[Message, tuple[int, ...]]) -> None:
        msg, dests = data
        for h in dests:
            core = self.cores[h]
            evs = core.receive(msg, self._now)
            if evs and self._apply_repaths(evs):
                self._dirty = True
            self._arm_timer(core)

    def _on_timer(self, _: None) -> None:
        now = self._now
        self._timer_at = math.inf
        for core in self.cores:
            if core.next_deadline() <= now and self._apply_repaths(core.tick(now)):
                self._dirty = True
        for core in self.cores:
            self._arm_timer(core)

    def _arm_timer(self, core: ArkCore) -> None:
        """Make sure a timer fires by ``core``'s next deadline (while flows remain)."""
        t = core.next_deadline()
        if t < self._timer_at and self._pending:
            self._timer_at = t
            self.schedule(t, _TIMER, None)

    # ------------------------------------------------------------------ helpers
    def _broadcast(self, src: int, msgs: Sequence[Message]) -> None:
        t, n = self._now, self.fabric.n_hosts
        for m in msgs:
            self._messages += 1
            if self.jitter:
                for h in range(n):
                    if h != src:
                        self.schedule(t + (self.delay + float(self.rng.uniform(0, self.jitter))), _DELIVER, (m, (h,)))
            else:
                self.schedule(t + self.delay, _DELIVER, (m, tuple(h for h in range(n) if h != src)))

    def _apply_repaths(self, evs: Sequence[Repath]) -> bool:
        """Move flows whose port changed after a race; True if any moved."""
        changed = False
        for ev in evs:
            act = self._by_core_flow.get(ev.flow)
            if act is None:
                continue
            res = act.res
            res.repaths += 1
            res.reserved = ev.reserved
            if not ev.reserved:
                res.fallback = True
            if ev.port != res.port:
                sw = self._switch(res.src, res.dst, ev.port)
                if sw != ev.path:
                    self._mismatches += 1
                self._count_spines(act, -1)
                act.links, act.spines = self._links(res.src, res.dst, sw)
                self._count_spines(act, +1)
                res.path, res.port = sw, ev.port
                changed = True
        if changed:
            self._spines_changed()
        return changed

    def _count_spines(self, act: _Active, delta: int) -> None:
        for k in act.spines:
            self._spine_now[k] += delta

    def _spines_changed(self) -> None:
        for k, c in enumerate(self._spine_now):
            if c > self._spine_max[k]:
                self._spine_max[k] = c
        if self.record_timeline:
            self._timeline.append((self._now, tuple(self._spine_now)))

    def _links(self, src: int, dst: int, path: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        fab = self.fabric
        if self.scheme == "spray":
            a, b = fab.hosts[src].leaf, fab.hosts[dst].leaf
            if a == b:
                return (fab.tx_link(src), fab.rx_link(dst)), ()
            bundle = (fab.tx_link(src), self._up_bundle[a], self._down_bundle[b], fab.rx_link(dst))
            return bundle, tuple(range(fab.n_spines))
        spines = () if fab.n_paths(src, dst) == 1 else (path,)
        return fab.path_links(src, dst, path), spines

    def _switch(self, src: int, dst: int, port: int) -> int:
        return switch_path(self.fabric, src, dst, port, self.dport)
