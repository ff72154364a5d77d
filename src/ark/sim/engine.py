"""Discrete-event fluid (flow-level) fabric simulator.

Flows share bandwidth max-min fairly over every directed link they cross (source NIC,
the fabric links of their path, destination NIC); rates are recomputed at each arrival,
completion and re-path. Link capacity is line rate x transport efficiency (payload
goodput, see ``ark.core.topology.TRANSPORTS``). Events sit on a heap keyed ``(time, seq)``;
seeded generators owned by the run make every random draw, so a seed fixes the run.

:class:`FluidSim` is a small event loop: :meth:`~FluidSim.schedule` puts an event on the
heap, :meth:`~FluidSim.step` advances to the next event or flow completion and handles
it, :meth:`~FluidSim.run` steps until every flow has finished. Each flow in flight is an
:class:`ark.sim.transfer.Transfer` of one or more sub-flows, sent whole or in chunks.

Schemes:

* ``ecmp``: every flow gets a random source port from the port range; the simulated
  switches hash its exact key bytes, each at its own ECMP decision (leaf; in a 3-tier
  Clos also the aggregation switch), with its own model, seed and selection.
* ``ark`` / ``ark-balance`` / ``ark-split``: a control plane decides (:mod:`ark.sim.control`):
  one :class:`ark.core.protocol.ArkCore` per host, broadcasting its reservations
  (``control="broadcast"``, :mod:`ark.sim.broadcast_control`: races happen as they
  would), or one :class:`ark.core.arbiter.Arbiter` that every host asks, a request round
  trip after each flow arrives (``control="arbiter"``, :mod:`ark.sim.arbiter_control`;
  no races). Under ``ark-split`` a transfer is several reserved sub-flows on distinct
  paths. The switches still hash the chosen port; any disagreement with the reserved path
  is counted in ``path_mismatches``. The loop never asks which mode runs: it hands the
  control plane the flows that arrive and finish, and its events.
* ``ecmp-split``: the same sub-flows on random source ports (what an engine with several
  connections gets without ARK).
* ``ark-conn`` / ``ecmp-conn``: a few long-lived connections per peer pair, every transfer
  striped over them; placed by ARK when each opens, or hashed from random ports
  (:mod:`ark.sim.connections`).
* ``plb``, ``letflow``, ``conga``, ``hedera``: the baselines of :mod:`ark.sim.balancers`.
* ``oracle-path``: one path per flow, chosen by a controller that knows every flow's bytes
  left (:class:`ark.sim.balancers.OraclePath`): the bound of single-path placement.
* ``spray``: ideal per-packet spraying: at every hop stage a flow uses the aggregate of
  all the links its equal-cost paths could take there (2-tier: all uplinks of its source
  leaf, all downlinks of its destination leaf; 3-tier: also all aggregation-core links of
  the two pods). The bound.

A leaf-spine link may fail or degrade during the run (:mod:`ark.sim.failure`): every
scheme sees the same event.

Rates are kept by :class:`ark.sim.maxmin.FairShares`, which after each arrival,
completion or re-path recomputes only the flows whose rate can change; a flow's bytes
left are settled when its rate changes, and completions sit on a heap of their own,
so an event costs what it touches, not the number of active flows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.messages import FlowId
from ark.core.pathmap import ROCE_PORT_RANGE, PathMapCache, switch_path
from ark.core.protocol import PathMaps, Repath
from ark.core.table import POLICIES
from ark.core.topology import Fabric
from ark.sim.arbiter_control import ArbiterControl, unsupported
from ark.sim.balancers import Balancer, SchemeParams, make_balancer
from ark.sim.broadcast_control import BroadcastControl
from ark.sim.connections import CONN_SCHEMES, Connections
from ark.sim.control import CONTROLS, ControlPlane, NoControl, Part
from ark.sim.failure import FailedRoutes, LinkChange, RebuiltMaps
from ark.sim.maxmin import FairShares, maxmin_rates
from ark.sim.results import FlowResult, SimResult
from ark.sim.transfer import SubFlow, Transfer, sub_id, top_switches

__all__ = [
    "ARK_OFFERED", "ARK_SCHEMES", "REPRODUCED", "SCHEMES", "FlowResult", "FlowSpec", "FluidSim", "SimError", "SimResult",
    "maxmin_rates",
]

SCHEMES = ("ecmp", "ark", "ark-balance", "spray", "plb", "letflow", "conga", "hedera", "ark-split", "ecmp-split",
           "oracle-path", "ark-conn", "ecmp-conn")
REPRODUCED = ("ecmp", "ark", "ark-balance", "spray")  # what an experiment runs unless told otherwise
ARK_SCHEMES = POLICIES  # the schemes an ArkCore runs: its policies
ARK_OFFERED = (*ARK_SCHEMES, "ark-conn")  # what ARK offers a user: its policies and its connection placement
SPLIT_SCHEMES = ("ark-split", "ecmp-split")

_START, _CONTROL, _RESUME, _LB, _CHANGE, _REBUILD = range(6)
MAP_CACHE = 1024  # path maps kept per simulation process (a lazy one: a few kB)
Progress = Callable[[int, int, float], None]  # (flows finished, flows, simulated time)
CONTROL_PORTS = (49152, 7100)  # source and destination port of the in-band control connection


class SimError(ValueError):
    """Invalid simulator parameters."""


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
        pathmaps: PathMaps | None = None,
        record_timeline: bool = False,
        retention_s: float = 5.0,
        shared_table: bool | None = None,
        params: SchemeParams | None = None,
        chunks: int = 1,
        chunk_gap_s: float = 0.0,
        change: LinkChange | None = None,
        clock_skew_s: float = 0.0,
        control_on_data: bool = False,
        data_queue_bytes: float = 100e3,
        control: str = "broadcast",
        arbiter_rtt_s: float = 200e-6,
    ) -> None:
        if scheme not in SCHEMES:
            raise SimError(f"scheme: must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        if control_delay_s < 0 or control_jitter_s < 0:
            raise SimError("control_delay_us: must be >= 0")
        if control not in CONTROLS:
            raise SimError(f"control: must be one of {', '.join(CONTROLS)}; got {control!r}")
        if not (math.isfinite(arbiter_rtt_s) and arbiter_rtt_s >= 0):
            raise SimError(f"arbiter_rtt_us: must be a finite number >= 0; got {arbiter_rtt_s * 1e6!r}")
        if chunks < 1 or chunk_gap_s < 0 or clock_skew_s < 0 or data_queue_bytes < 0:
            raise SimError("chunks: must be >= 1 (and chunk_gap_s, clock_skew_s, data_queue_bytes >= 0)")
        self.fabric, self.scheme = fabric, scheme
        self.delay, self.jitter = control_delay_s, control_jitter_s
        self.dport, self.port_range = dport, port_range
        self.rng = np.random.default_rng(seed)
        self.lb_rng = np.random.default_rng([seed, 1])  # the baselines' own draws
        self.record_timeline = record_timeline
        self.params = params or SchemeParams()
        self.chunks, self.chunk_gap = chunks, chunk_gap_s
        self.change = change
        self.control_on_data, self.data_queue = control_on_data, data_queue_bytes
        # Only the ARK schemes have a control plane; the others ignore the mode.
        self.control = control if scheme in ARK_SCHEMES else "none"
        self.arbiter_rtt = arbiter_rtt_s
        if self.control == "arbiter":
            why = unsupported(jitter_s=control_jitter_s, skew_s=clock_skew_s, control_on_data=control_on_data,
                              link_down=change is not None and change.down, parts=self._ask_parts())
            if why:
                raise SimError(f"control: \"arbiter\" {why}")
        self._retention = retention_s
        self._off = np.random.default_rng([seed, 2]).uniform(0, clock_skew_s, fabric.n_hosts).tolist() \
            if clock_skew_s > 0 else None
        base = pathmaps or PathMapCache(fabric, port_range, capacity=MAP_CACHE, lazy=True)
        if change is not None:
            change.check(fabric)
        self.maps: RebuiltMaps | None = None
        if change is not None and change.down and scheme in ARK_SCHEMES:
            self.maps = RebuiltMaps(base, FailedRoutes(fabric, change), port_range)
        self.pathmaps = self.maps or base
        self._check_shared_table(shared_table)
        # Each host's own stream (ECMP ports): its core's, or its side of the arbiter's.
        self._host_seeds = [int(c) for c in self.rng.integers(0, 2**63 - 1, fabric.n_hosts)] \
            if scheme in ARK_SCHEMES else []
        self.control_plane: ControlPlane = NoControl(fabric.n_hosts, self.delay)  # made per run (_reset)
        self._handlers: dict[int, Callable[[Any], None]] = {
            _START: self._on_start, _CONTROL: self._on_control, _RESUME: self._on_resume,
            _LB: self._on_balancer, _CHANGE: self._on_change, _REBUILD: self._on_rebuild,
        }

    def _ask_parts(self) -> int:
        """Sub-flows per transfer: ``[params.split] parts`` under ``ark-split``, else 1."""
        return self.params.split.parts if self.scheme in SPLIT_SCHEMES else 1

    def _check_shared_table(self, shared_table: bool | None) -> None:
        # Every host receives every message after the same delay: one table for all
        # (ark.core.shared_table), unless jitter, skewed clocks or in-band control make the
        # replicas differ.
        same = self.jitter == 0 and self._off is None and not self.control_on_data
        self.shared_table = same if shared_table is None else shared_table
        if self.shared_table and not same:
            raise SimError("shared_table: needs control_jitter_us = 0, no clock skew and a separate control network "
                           "(otherwise every host holds its own replica)")

    def _new_control(self, start_s: float) -> ControlPlane:
        """A fresh control plane for one run: the mode's, or none for schemes without one."""
        if self.scheme not in ARK_SCHEMES:
            return NoControl(self.fabric.n_hosts, self.delay)
        if self.control == "arbiter":  # started before the first flow
            return ArbiterControl(
                self.fabric, self.scheme, self.pathmaps, self, rtt_s=self.arbiter_rtt, dport=self.dport,
                parts=self._ask_parts(), host_seeds=self._host_seeds, retention_s=self._retention, lease=None,
                start_s=start_s)
        return BroadcastControl(
            self.fabric, self.scheme, self.pathmaps, self, host_seeds=self._host_seeds, retention_s=self._retention,
            shared_table=self.shared_table, delay_s=self.delay, jitter_s=self.jitter, on_data=self.control_on_data,
            offsets=self._off, rng=self.rng, dport=self.dport,
            parts=self.params.split.parts if self.scheme in SPLIT_SCHEMES else 1)

    def _new_connections(self) -> Connections | None:
        """A run's long-lived connections per peer pair (the connection schemes), else None."""
        if self.scheme not in CONN_SCHEMES:
            return None
        p = self.params.conn
        return Connections(self.fabric, self.scheme, self.pathmaps, self.dport, per_pair=p.connections,
                           idle_s=p.idle_s, random_port=lambda: self.random_port(self.rng))

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

    # ------------------------------------------------------------------ the view balancers get
    @property
    def now(self) -> float:
        return self._now

    @property
    def shares(self) -> FairShares:
        return self._shares

    @property
    def pending(self) -> int:
        return self._pending

    def group(self, src: int, dst: int) -> tuple[int, ...]:
        """The paths the source's ECMP group holds towards ``dst`` now."""
        if self._routes is not None:
            return self._routes.group(src, dst)
        return tuple(range(self.fabric.n_paths(src, dst)))

    def hashed(self, src: int, dst: int, port: int) -> int:
        return self._switch(src, dst, port)

    def random_port(self, rng: np.random.Generator) -> int:
        lo, hi = self.port_range
        return int(rng.integers(lo, hi + 1))

    def move(self, t: Transfer, path: int, port: int) -> None:
        if path == t.subs[0].path:  # a new port onto the same path: its rates stay
            t.subs[0].port = t.res.port = port
            return
        self._move_sub(t, 0, path, port)
        self._spines_changed()

    def at(self, t: float, data: object) -> None:
        self.schedule(t, _LB, data)

    def transfers(self) -> Iterable[Transfer]:
        """Transfers sending now (not idle between two chunks)."""
        return self._active.values()

    def sending(self, flow: int) -> Transfer | None:
        return self._active.get(flow)

    # ------------------------------------------------------------------ the loop
    def run(self, flows: Sequence[FlowSpec], progress: Progress | None = None, every: int = 20_000) -> SimResult:
        """Simulate ``flows`` to the end; ``progress(finished, total, now)`` is called every
        ``every`` events (what a long run shows; it changes nothing)."""
        self._reset(flows)
        if progress is None:
            while self._pending or self._heap:
                self.step()
        else:
            n = 0
            progress(0, len(flows), self._now)
            while self._pending or self._heap:
                self.step()
                n += 1
                if n % every == 0:
                    progress(len(flows) - self._pending, len(flows), self._now)
            progress(len(flows) - self._pending, len(flows), self._now)
        lb, c = self.balancer, self.control_plane.counters()
        return SimResult(
            self.scheme, [self._results[f.id] for f in flows], c.races,
            self._fallbacks, self._mismatches, self._spine_max, self._events + c.events, self._timeline, c.messages,
            c.by_host, race_moved=len(self._race_moved), moves=lb.moves if lb else 0,
            rehashes=lb.rehashes if lb else 0, stale=self._stale, rebuild_repathed=c.rebuild_repathed,
            mismatches_after_rebuild=self._after_rebuild, control_delay_mean_s=c.delay_mean_s,
            control_delay_max_s=c.delay_max_s, control=self.control_plane.name, arbiter_rtt_s=c.rtt_s,
        )

    def _reset(self, flows: Sequence[FlowSpec]) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        for f in flows:
            if f.nbytes < 0 or not math.isfinite(f.start_s):
                raise SimError(f"flow {f.id}: needs nbytes >= 0 and a finite start")
            self.schedule(f.start_s, _START, f)
        if self.change is not None:
            self.schedule(self.change.at_s, _CHANGE, None)
        self._results = {f.id: FlowResult(f.id, f.src, f.dst, f.nbytes, f.start_s) for f in flows}
        self._active: dict[int, Transfer] = {}
        self._paused: dict[int, Transfer] = {}  # idle between two chunks
        self._owner: dict[int, tuple[Transfer, int]] = {}  # sub-flow id -> (transfer, index), split schemes
        self._shares = FairShares(self._capacities())
        self._base_capacity = list(self._shares.capacity)
        self._bundles: dict[frozenset[int], int] = {}
        self._done: list[tuple[float, int, int, int]] = []  # (completion time, seq, flow id, version)
        n_top = self.fabric.n_spines
        self._spine_now = [0] * n_top
        self._spine_max = [0] * n_top
        self._timeline: list[tuple[float, tuple[int, ...]]] = []
        self._mismatches = self._fallbacks = self._events = 0
        self._stale = self._after_rebuild = 0
        self._race_moved: set[int] = set()
        self._routes: FailedRoutes | None = None
        self._ctl_links: dict[tuple[int, int], tuple[int, ...]] = {}
        self._now = 0.0
        self._dirty = False
        self._pending = len(flows)
        self._multi = (self.scheme in SPLIT_SCHEMES and self.params.split.parts > 1) or (
            self.scheme in CONN_SCHEMES and self.params.conn.connections > 1)
        self._conns = self._new_connections()
        self.balancer: Balancer | None = make_balancer(self.scheme, self.params, self)
        self.control_plane = self._new_control(min([0.0, *(f.start_s for f in flows)]))

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
        if kind != _CONTROL:  # the control plane counts its own events
            self._events += 1
        self._handlers[kind](data)

    def _update_rates(self) -> None:
        """Rates of the flows the last changes can affect; each re-announces its completion."""
        now, active, done = self._now, self._active, self._done
        changed = self._shares.update()
        if self._multi:
            self._update_transfers(changed)
        else:
            for fid, rate in changed.items():
                a = active[fid]
                a.remaining -= a.rate * (now - a.t_upd)
                a.t_upd, a.rate = now, rate
                a.version += 1
                if rate > 0:
                    heapq.heappush(done, (now + a.remaining / rate, self._seq, fid, a.version))
                    self._seq += 1
        self._dirty = False
        if self.balancer is not None and self.balancer.wants_rates:
            self.balancer.rates()

    def _update_transfers(self, changed: dict[int, float]) -> None:
        """Transfers of several sub-flows: their bytes drain at the sum of the sub-flows' rates."""
        now, done = self._now, self._done
        touched: dict[int, Transfer] = {}
        for sid, rate in changed.items():
            t, k = self._owner[sid]
            t.subs[k].rate = rate
            touched[t.res.id] = t
        for fid, t in touched.items():
            t.remaining -= t.rate * (now - t.t_upd)
            t.t_upd, t.rate = now, sum(s.rate for s in t.subs)
            t.version += 1
            if t.rate > 0:
                heapq.heappush(done, (now + t.remaining / t.rate, self._seq, fid, t.version))
                self._seq += 1

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
            if a.chunks_left:
                self._pause(a)
                continue
            del active[a.res.id]
            for sub in a.subs:
                self._shares.remove(sub.sid)
                self._owner.pop(sub.sid, None)
            a.res.finish_s = now
            self._pending -= 1
            self._count_spines(a, -1)
            self.control_plane.done(a, now)
            if self.balancer is not None:
                self.balancer.done(a)
            if self._conns is not None:
                self._conns.release(a.res.src, a.res.dst, now)
        self._spines_changed()
        self._dirty = True

    def _pause(self, t: Transfer) -> None:
        """A chunk is done: idle for the gap, holding its paths and reservations."""
        fid = t.res.id
        del self._active[fid]
        self._paused[fid] = t
        for sub in t.subs:
            self._shares.remove(sub.sid)
            sub.rate = 0.0
        t.chunks_left -= 1
        t.remaining, t.rate = 0.0, 0.0
        t.version += 1
        if self.balancer is not None:
            self.balancer.idle(t)
        self.schedule(self._now + self.chunk_gap, _RESUME, fid)

    def _on_resume(self, fid: int) -> None:
        t = self._paused[fid]
        if self.balancer is not None:
            if self.chunk_gap >= self.balancer.flowlet_s:
                self.balancer.flowlet(t)
            self.balancer.resumed(t)
        del self._paused[fid]
        self._active[fid] = t
        t.remaining, t.t_upd, t.rate = t.chunk_bytes, self._now, 0.0
        for sub in t.subs:
            self._shares.add(sub.sid, sub.links)
        self._dirty = True

    def _on_start(self, f: FlowSpec) -> None:
        res = self._results[f.id]
        if f.nbytes == 0:
            res.finish_s = self._now
            self._pending -= 1
            return
        if self.scheme in ARK_SCHEMES:  # its control plane decides, now or later (start)
            self.control_plane.ask(f, self._now)
            return
        if self._conns is not None:
            ports = self._conns.take(f.src, f.dst, self._now)
            self._launch(f, res, self._subflows(f, res, [(p, self._switch(f.src, f.dst, p), None) for p in ports]))
            return
        self._launch(f, res, self._split(f, res) if self._multi else [self._first(f, res)])

    def _on_control(self, ev: object) -> None:
        self.control_plane.on_event(ev, self._now)

    def _launch(self, f: FlowSpec, res: FlowResult, subs: list[SubFlow]) -> Transfer:
        """The flow starts sending now over ``subs``."""
        t = Transfer(res, subs, self.chunks)
        t.t_upd = self._now  # later than the arrival when it waited for a grant
        self._active[f.id] = t
        for k, sub in enumerate(subs):
            self._shares.add(sub.sid, sub.links)
            if self._multi:
                self._owner[sub.sid] = (t, k)
        if self.balancer is not None:
            self.balancer.started(t)
        self._count_spines(t, +1)
        self._spines_changed()
        self._dirty = True
        return t

    def _first(self, f: FlowSpec, res: FlowResult) -> SubFlow:
        """The one path of a single-path scheme without a control plane."""
        first = self.balancer.first(f.src, f.dst, f.nbytes) if self.balancer is not None else None
        if first is not None:
            port, path = -1, first
        elif self.scheme == "spray":
            port, path = -1, -1
        else:
            port = self.random_port(self.rng)
            path = self._switch(f.src, f.dst, port)
        res.path, res.port = path, port
        links, spines = self._links(f.src, f.dst, max(path, 0))
        return SubFlow(f.id, path, port, links, spines)

    def _split(self, f: FlowSpec, res: FlowResult) -> list[SubFlow]:
        """Sub-flows on random ports (``ecmp-split``)."""
        ports = [self.random_port(self.rng) for _ in range(self.params.split.parts)]
        return self._subflows(f, res, [(p, self._switch(f.src, f.dst, p), None) for p in ports])

    def _subflows(self, f: FlowSpec, res: FlowResult, chosen: Sequence[tuple[int, int, FlowId | None]]) -> list[SubFlow]:
        """One sub-flow per (port, path, reservation); the first stands for the flow in ``res``."""
        subs = []
        for k, (port, path, core_flow) in enumerate(chosen):
            links, spines = self._links(f.src, f.dst, path)
            sub = SubFlow(sub_id(f.id, k), path, port, links, spines)
            sub.core_flow = core_flow
            subs.append(sub)
        res.path, res.port = subs[0].path, subs[0].port
        return subs

    def _count_mismatch(self) -> None:
        self._mismatches += 1
        if self.maps is not None and self.maps.rebuilt:
            self._after_rebuild += 1

    # ------------------------------------------------------------------ what a control plane may ask
    def control_at(self, t: float, ev: object) -> None:
        self.schedule(t, _CONTROL, ev)

    def control_due(self, same: Callable[[object], bool]) -> list[object]:
        heap, now, out = self._heap, self._now, []
        while heap and heap[0][0] == now and heap[0][2] == _CONTROL and same(heap[0][3]):
            out.append(heapq.heappop(heap)[3])
        return out

    def start(self, f: FlowSpec, parts: Sequence[Part]) -> Transfer:
        """The flow starts now on the ports its control plane chose (the switches hash them;
        a port that misses the path the control plane expects is counted)."""
        res = self._results[f.id]
        chosen: list[tuple[int, int, FlowId | None]] = []
        for p in parts:
            path = self._switch(f.src, f.dst, p.port)
            if p.path >= 0 and path != p.path:
                self._count_mismatch()
            chosen.append((p.port, path, p.flow))
        res.reserved = any(p.reserved for p in parts)
        res.fallback = any(p.fallback for p in parts)
        self._fallbacks += sum(p.fallback for p in parts)
        return self._launch(f, res, self._subflows(f, res, chosen))

    def repath(self, moves: Sequence[tuple[Transfer, int, Repath]]) -> bool:
        """Move sub-flows whose port changed after a race; True if any moved."""
        changed = False
        for t, k, ev in moves:
            res, sub = t.res, t.subs[k]
            res.repaths += 1
            res.reserved = ev.reserved
            if not ev.reserved:
                res.fallback = True
            if ev.port != sub.port:
                sw = self._switch(res.src, res.dst, ev.port)
                if sw != ev.path:
                    self._count_mismatch()
                self._move_sub(t, k, sw, ev.port)
                self._race_moved.add(res.id)
                changed = True
        if changed:
            self._spines_changed()
            self._dirty = True
        return changed

    def replace(self, t: Transfer, k: int, part: Part) -> None:
        sub, res = t.subs[k], t.res
        if k == 0:
            res.reserved, res.fallback = part.reserved, part.fallback
        self._fallbacks += part.fallback
        sw = self._switch(res.src, res.dst, part.port)
        if part.path >= 0 and sw != part.path:
            self._count_mismatch()
        sub.core_flow = part.flow
        if sw != sub.path or part.port != sub.port:
            self._move_sub(t, k, sw, part.port)

    def mismatch(self) -> None:
        self._count_mismatch()

    def _on_balancer(self, data: object) -> None:
        """The balancer's events due now, as one batch (one allocation update after them)."""
        assert self.balancer is not None
        batch, heap = [data], self._heap
        while heap and heap[0][0] == self._now and heap[0][2] == _LB:
            batch.append(heapq.heappop(heap)[3])
            self._events += 1
        self.balancer.events(batch)

    # ------------------------------------------------------------------ link changes
    def _on_change(self, _: None) -> None:
        """A leaf-spine link fails or degrades; every flow on the scheme's terms follows."""
        ch = self.change
        assert ch is not None
        for lk in ch.links(self.fabric):
            self._set_capacity(lk, self._base_capacity[lk] * ch.fraction)
        if ch.down:
            self._routes = FailedRoutes(self.fabric, ch)
            self._ctl_links.clear()
            dead = set(ch.links(self.fabric))
            for t in [*self._active.values(), *self._paused.values()]:
                self._follow(t, dead)
            if self.maps is not None:
                self.schedule(self._now + ch.detect_s, _REBUILD, None)
        self._spines_changed()
        self._dirty = True

    def _set_capacity(self, lk: int, cap: float) -> None:
        self._shares.set_capacity(lk, cap)
        for key, b in self._bundles.items():
            if lk in key:
                self._shares.set_capacity(b, sum(self._shares.capacity[x] for x in key))

    def _follow(self, t: Transfer, dead: set[int]) -> None:
        """After a failure: a balancer re-paths its flows; the switches re-hash every port."""
        crossed = any(lk in dead for sub in t.subs for lk in sub.links)
        if self.scheme == "spray" or (self.balancer is not None and self.balancer.link_down(t, crossed)):
            return
        res = t.res
        for k, sub in enumerate(t.subs):
            if sub.port < 0:
                continue  # a path no port chose (spray, a balancer's own): nothing to re-hash
            sw = self._switch(res.src, res.dst, sub.port)
            if sw != sub.path:
                self._stale += sub.core_flow is not None and self.control_plane.holds(sub.core_flow)
                self._move_sub(t, k, sw, sub.port)

    def _on_rebuild(self, _: None) -> None:
        """ARK's hosts rebuild their maps and re-path the reservations whose port moved."""
        assert self.maps is not None
        self.maps.rebuild()
        self.control_plane.rebuild(self._now)
        self._spines_changed()
        self._dirty = True

    # ------------------------------------------------------------------ helpers
    def control_delay(self, src: int, dst: int) -> float:
        """In-band control: the delay plus jitter, plus the standing queue at every switch
        egress of the control connection's path where data is bottlenecked now."""
        d = self.delay + (float(self.rng.uniform(0, self.jitter)) if self.jitter else 0.0)
        links = self._ctl_links.get((src, dst))
        if links is None:
            path = self._switch(src, dst, CONTROL_PORTS[0], CONTROL_PORTS[1])
            links = self._ctl_links[(src, dst)] = self.fabric.path_links(src, dst, path)[1:]
        shares = self._shares
        for lk in links:
            if shares.beta_of[lk] and shares.capacity[lk] > 0:
                d += self.data_queue / shares.capacity[lk]
        return d

    def _move_sub(self, t: Transfer, k: int, path: int, port: int) -> None:
        """Sub-flow ``k`` of ``t`` now crosses ``path`` with source ``port``."""
        sub, res = t.subs[k], t.res
        self._count_spines(t, -1)
        sub.links, sub.spines = self._links(res.src, res.dst, path)
        t.spines = top_switches(t.subs)
        if res.id in self._active:
            self._shares.remove(sub.sid)
            self._shares.add(sub.sid, sub.links)
            self._dirty = True
        self._count_spines(t, +1)
        sub.path, sub.port = path, port
        if k == 0:
            res.path, res.port = path, port

    def _count_spines(self, act: Transfer, delta: int) -> None:
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

    def _switch(self, src: int, dst: int, port: int, dport: int | None = None) -> int:
        dp = self.dport if dport is None else dport
        if self._routes is not None:
            return self._routes.switch_path(src, dst, port, dp)
        return switch_path(self.fabric, src, dst, port, dp)
