"""Discrete-event fluid (flow-level) fabric simulator.

Flows share bandwidth max-min fairly over every directed link they cross (source NIC,
the fabric links of their path, destination NIC); rates are recomputed at each arrival,
completion and re-path. Link capacity is line rate x transport efficiency (payload
goodput, see ``ark.core.topology.TRANSPORTS``). Events sit on a heap keyed ``(time, seq)``;
one seeded generator per run owns every random draw, so a seed fixes the run.

:class:`FluidSim` is a small event loop: :meth:`~FluidSim.schedule` puts an event on the
heap, :meth:`~FluidSim.step` advances to the next event or flow completion and handles
it, :meth:`~FluidSim.run` steps until every flow has finished.

Schemes:

* ``ecmp``: every flow gets a random source port from the port range; the simulated
  switches hash its exact key bytes, each at its own ECMP decision (leaf; in a 3-tier
  Clos also the aggregation switch), with its own model, seed and selection.
* ``ark`` / ``ark-balance``: one :class:`ark.core.protocol.ArkCore` per host; messages reach
  peers after the control-plane one-way delay, so races happen as they would. Without
  jitter every host receives a message at the same instant, so the cores share one
  reservation table that receives each message once (a host's own messages in flight
  stay with its core until then): the same decisions and re-paths as one replica per
  host, at a cost per message that does not grow with the number of hosts. With jitter,
  each host keeps its own replica. The
  switches still hash the chosen port; any disagreement with the reserved path is
  counted in ``path_mismatches``. The cores' timers fire at their own deadlines
  (:meth:`ArkCore.next_deadline`), never by polling.
* ``spray``: ideal per-packet spraying: at every hop stage a flow uses the aggregate of
  all the links its equal-cost paths could take there (2-tier: all uplinks of its source
  leaf, all downlinks of its destination leaf; 3-tier: also all aggregation-core links of
  the two pods). The bound.

Rates are kept by :class:`ark.sim.maxmin.FairShares`, which after each arrival,
completion or re-path recomputes only the flows whose rate can change; a flow's bytes
left are settled when its rate changes, and completions sit on a heap of their own,
so an event costs what it touches, not the number of active flows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.messages import FlowId, Message, Release
from ark.core.pathmap import ROCE_PORT_RANGE, PathMap, PathMapCache, switch_path
from ark.core.protocol import ArkCore, Repath
from ark.core.table import ReservationTable
from ark.core.topology import Fabric
from ark.sim.maxmin import FairShares, maxmin_rates

__all__ = ["SCHEMES", "FlowResult", "FlowSpec", "FluidSim", "SimError", "SimResult", "maxmin_rates"]

SCHEMES = ("ecmp", "ark", "ark-balance", "spray")

_START, _DELIVER, _TIMER = 0, 1, 2
MAP_CACHE = 1024  # path maps kept per simulation process (about 160 kB each)


def _arrival_order(msg: Message) -> tuple[float, int, int, int]:
    return (msg.ts, 0 if isinstance(msg, Release) else 1, msg.flow[0], msg.flow[1])


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
    # Messages each host sent (RESERVE, RELEASE, RENEW): what its peers receive under full
    # broadcast, or the peers of its scope (see ark.sim.control_plane).
    messages_by_host: list[int] = field(default_factory=list)


class _Active:
    __slots__ = ("core_flow", "links", "rate", "remaining", "res", "spines", "t_upd", "version")

    def __init__(self, res: FlowResult, links: tuple[int, ...], spines: tuple[int, ...]) -> None:
        self.res = res
        self.links = links
        self.remaining = float(res.nbytes)  # bytes left at ``t_upd``
        self.t_upd = res.start_s
        self.rate = 0.0
        self.version = 0  # bumps at every rate change: older completion entries are stale
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
        shared_table: bool | None = None,
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
        self.pathmaps = pathmaps or PathMapCache(fabric, port_range, capacity=MAP_CACHE)
        self.cores: list[ArkCore] = []
        # Every host receives every message after the same delay: one table for all (see
        # ark.core.protocol, "Sharing one table"), unless jitter makes the replicas differ.
        self.shared_table = control_jitter_s == 0 if shared_table is None else shared_table
        if self.shared_table and control_jitter_s:
            raise SimError("shared_table: needs control_jitter_us = 0 (with jitter every host holds its own replica)")
        self.table: ReservationTable | None = None
        if scheme in ("ark", "ark-balance"):
            child = self.rng.integers(0, 2**63 - 1, fabric.n_hosts)
            if self.shared_table:
                self.table = ReservationTable(fabric, policy=scheme, retention_s=retention_s)
            self.cores = [
                # A host keeps source-port buckets only for peers it has flows to: the
                # maps come from the (bounded) cache, so memory does not grow with pairs.
                ArkCore(h, fabric, self.pathmaps, policy=scheme, seed=int(child[h]), retention_s=retention_s,
                        table=self.table, max_idle_peers=0)
                for h in range(fabric.n_hosts)
            ]
        self._handlers: dict[int, Callable[[Any], None]] = {
            _START: self._on_start, _DELIVER: self._on_deliver, _TIMER: self._on_timer,
        }

    def _capacities(self) -> list[float]:
        """Payload bytes/s per link."""
        fab = self.fabric
        return [lk.capacity_bps * fab.efficiency / 8.0 for lk in fab.links]

    def _bundle(self, stage: tuple[int, ...]) -> int:
        """The virtual link that stands for all distinct links of one stage (spraying)."""
        key = frozenset(stage)
        b = self._bundles.get(key)
        if b is None:
            b = self._bundles[key] = self._shares.add_link(sum(self._shares.capacity[lk] for lk in key))
        return b

    # ------------------------------------------------------------------ the loop
    def run(self, flows: Sequence[FlowSpec]) -> SimResult:
        self._reset(flows)
        while self._pending or self._heap:
            self.step()
        return SimResult(
            self.scheme, [self._results[f.id] for f in flows], sum(c.counters.races_lost for c in self.cores),
            self._fallbacks, self._mismatches, self._spine_max, self._events, self._timeline, self._messages,
            list(self._sent_by_host),
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
        self._shares = FairShares(self._capacities())
        self._bundles: dict[frozenset[int], int] = {}
        self._done: list[tuple[float, int, int, int]] = []  # (completion time, seq, flow id, version)
        n_top = self.fabric.n_spines
        self._spine_now = [0] * n_top
        self._spine_max = [0] * n_top
        self._timeline: list[tuple[float, tuple[int, ...]]] = []
        self._mismatches = self._fallbacks = self._messages = self._events = 0
        self._sent_by_host = [0] * self.fabric.n_hosts
        self._now = 0.0
        self._dirty = False
        self._pending = len(flows)
        self._timer_at = math.inf
        self._pending_hosts: dict[int, None] = {}  # hosts with messages on their way to the shared table

    def schedule(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, data))
        self._seq += 1

    def step(self) -> None:
        """Advance to the next flow completion or event and handle it."""
        if self._dirty:
            self._update_rates()
        t_comp = self._next_completion()
        t_ev = self._heap[0][0] if self._heap else math.inf
        if t_comp == math.inf and t_ev == math.inf:
            raise SimError("stalled: active flows but no rate (a zero-capacity link?)")
        self._now = min(t_comp, t_ev)
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
        """Rates of the flows the last changes can affect; each re-announces its completion."""
        now, active, done = self._now, self._active, self._done
        for fid, rate in self._shares.update().items():
            a = active[fid]
            a.remaining -= a.rate * (now - a.t_upd)
            a.t_upd, a.rate = now, rate
            a.version += 1
            if rate > 0:
                heapq.heappush(done, (now + a.remaining / rate, self._seq, fid, a.version))
                self._seq += 1
        self._dirty = False

    def _next_completion(self) -> float:
        done, active = self._done, self._active
        while done:
            _, _, fid, version = done[0]
            a = active.get(fid)
            if a is not None and a.version == version:
                return done[0][0]
            heapq.heappop(done)
        return math.inf

    # ------------------------------------------------------------------ events
    def _complete(self) -> None:
        now, active, done = self._now, self._active, self._done
        # Every flow due within 1 ns finishes now: a tolerance relative to the flow's rate
        # (remaining <= rate x 1e-9), so the clock never steps by less than one ulp.
        finished = []
        while done and done[0][0] <= now + 1e-9:
            _, _, fid, version = heapq.heappop(done)
            a = active.get(fid)
            if a is not None and a.version == version:
                finished.append(a)
        for a in finished:
            del active[a.res.id]
            self._shares.remove(a.res.id)
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
        self._shares.add(f.id, links)
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

    def _on_deliver(self, data: tuple[Message, tuple[int, ...] | None]) -> None:
        # Messages arriving at the same instant arrive in key order (releases first at
        # equal timestamps), whatever order they were sent in: then no replica ever holds
        # a later key than a message still on its way to it from the same instant.
        batch = [data]
        heap = self._heap
        while heap and heap[0][0] == self._now and heap[0][2] == _DELIVER:
            batch.append(heapq.heappop(heap)[3])
            self._events += 1
        if len(batch) > 1:
            batch.sort(key=lambda d: _arrival_order(d[0]))
        for msg, dests in batch:
            if dests is None:
                self._deliver_to_table(msg)
                continue
            for h in dests:
                core = self.cores[h]
                evs = core.receive(msg, self._now)
                if evs and self._apply_repaths(evs):
                    self._dirty = True
                self._arm_timer(core)

    def _deliver_to_table(self, msg: Message) -> None:
        """The shared table receives ``msg`` for every host but its sender; the cores whose
        flows that touched (and those still judging pending reservations) catch up."""
        assert self.table is not None
        changed = self.table.receive(msg)
        later = self.table.take_changed()  # what a deferred re-evaluation moved
        if changed is not None:
            changed = None if later is None else [*changed, *later]
        cores, n = self.cores, self.fabric.n_hosts
        moved = self._apply_repaths(cores[msg.flow[0]].delivered(msg))
        if changed is None:
            for core in cores:
                moved |= self._apply_repaths(core.sync(None))
        else:
            for f in changed:
                if 0 <= f[0] < n:
                    moved |= self._apply_repaths(cores[f[0]].sync((f,)))
        for h in list(self._pending_hosts):
            if cores[h].pending:
                moved |= self._apply_repaths(cores[h].resync())
            else:
                del self._pending_hosts[h]
        if moved:
            self._dirty = True
        self._arm_timer(None)

    def _on_timer(self, _: None) -> None:
        now = self._now
        self._timer_at = math.inf
        if self.table is not None:
            expired = self.table.tick(now)
            later = self.table.take_changed()
            for f in expired:
                if self._apply_repaths(self.cores[f[0]].sync((f,))):
                    self._dirty = True
            for core in self.cores if later is None else (self.cores[f[0]] for f in later):
                if self._apply_repaths(core.sync(None if later is None else later)):
                    self._dirty = True
            self._arm_timer(None)
            return
        for core in self.cores:
            if core.next_deadline() <= now and self._apply_repaths(core.tick(now)):
                self._dirty = True
        for core in self.cores:
            self._arm_timer(core)

    def _arm_timer(self, core: ArkCore | None) -> None:
        """Make sure a timer fires by ``core``'s (None: the shared table's) next deadline,
        while flows remain."""
        if core is None or self.table is not None:
            t = self.table.next_deadline() if self.table is not None else math.inf
        else:
            t = core.next_deadline()
        if t < self._timer_at and self._pending:
            self._timer_at = t
            self.schedule(t, _TIMER, None)

    # ------------------------------------------------------------------ helpers
    def _broadcast(self, src: int, msgs: Sequence[Message]) -> None:
        t, n = self._now, self.fabric.n_hosts
        self._sent_by_host[src] += len(msgs)
        for m in msgs:
            self._messages += 1
            if self.table is not None:
                self._pending_hosts[src] = None
                self.schedule(t + self.delay, _DELIVER, (m, None))
            elif self.jitter:
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
                self._shares.remove(res.id)
                self._shares.add(res.id, act.links)
                self._count_spines(act, +1)
                res.path, res.port = sw, ev.port
                changed = True
        if changed:
            self._spines_changed()
        return changed

    def _count_spines(self, act: _Active, delta: int) -> None:
        now, top = self._spine_now, self._spine_max
        for k in act.spines:
            c = now[k] = now[k] + delta
            if c > top[k]:
                top[k] = c

    def _spines_changed(self) -> None:
        if self.record_timeline:
            self._timeline.append((self._now, tuple(self._spine_now)))

    def _links(self, src: int, dst: int, path: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Links a flow crosses, and the top-tier switches (spines or cores) it counts on."""
        fab = self.fabric
        if self.scheme == "spray":
            stages = fab.stages(src, dst)
            bundle = (fab.tx_link(src), *(self._bundle(st) for st in stages), fab.rx_link(dst))
            tops = {fab.top_switch(src, dst, k) for k in range(fab.n_paths(src, dst))} if stages else set()
            return bundle, tuple(sorted(t for t in tops if t is not None))
        top = fab.top_switch(src, dst, path)
        return fab.path_links(src, dst, path), () if top is None else (top,)

    def _switch(self, src: int, dst: int, port: int) -> int:
        return switch_path(self.fabric, src, dst, port, self.dport)
