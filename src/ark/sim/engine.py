"""Discrete-event fluid (flow-level) fabric simulator.

Flows share bandwidth max-min fairly over every directed link they cross (source NIC,
leaf uplink, spine downlink, destination NIC); rates are recomputed at each arrival,
completion and re-path. Link capacity is line rate x transport efficiency (payload
goodput, see ``ark.core.topology.TRANSPORTS``). Events sit on a heap keyed ``(time, seq)``;
one seeded generator per run owns every random draw, so a seed fixes the run.

Schemes:

* ``ecmp``: every flow gets a random source port from the port range; the simulated
  source leaf hashes its exact key bytes with the fabric's hash model.
* ``ark`` / ``ark-balance``: one :class:`ark.core.protocol.ArkCore` per host; messages reach
  peers after the control-plane one-way delay, so races happen as they would. The
  switches still hash the chosen port; any disagreement with the reserved path is
  counted in ``path_mismatches``.
* ``spray``: ideal per-packet spraying: a flow between two leaves uses the aggregate of
  all uplinks of its source leaf and all downlinks of its destination leaf. The bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ark.core.messages import FlowId, Message
from ark.core.pathmap import ROCE_PORT_RANGE, PathMap, fabric_pathmap, switch_path
from ark.core.protocol import ArkCore, Repath
from ark.core.topology import Fabric

SCHEMES = ("ecmp", "ark", "ark-balance", "spray")

_START, _DELIVER, _TICK = 0, 1, 2


class SimError(ValueError):
    """Invalid simulator parameters."""


@dataclass(frozen=True)
class FlowSpec:
    id: int
    src: int
    dst: int
    nbytes: int
    start_s: float


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


def maxmin_rates(flow_links: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates by progressive filling.

    Repeatedly find the link whose remaining capacity per unfrozen flow is smallest,
    freeze its flows at that share and charge every link they cross.
    """
    n = len(flow_links)
    users: dict[int, list[int]] = {}
    for i, links in enumerate(flow_links):
        for lk in links:
            u = users.get(lk)
            if u is None:
                users[lk] = [i]
            else:
                u.append(i)
    rem = {lk: float(capacity[lk]) for lk in users}
    cnt = {lk: len(u) for lk, u in users.items()}
    rate = [0.0] * n
    frozen = [False] * n
    left = n
    while left:
        best_l, best_s = -1, math.inf
        for lk, c in cnt.items():
            s = rem[lk] / c
            if s < best_s:
                best_l, best_s = lk, s
        best_s = max(best_s, 0.0)
        for i in users[best_l]:
            if frozen[i]:
                continue
            frozen[i] = True
            rate[i] = best_s
            left -= 1
            for lk in flow_links[i]:
                rem[lk] -= best_s
                c = cnt[lk] - 1
                if c:
                    cnt[lk] = c
                else:
                    del cnt[lk]
    return rate


class _Active:
    __slots__ = ("core_flow", "links", "rate", "remaining", "res", "spines")

    def __init__(self, res: FlowResult, links: tuple[int, ...], spines: tuple[int, ...]) -> None:
        self.res = res
        self.links = links
        self.remaining = float(res.nbytes)
        self.rate = 0.0
        self.core_flow: FlowId | None = None
        self.spines = spines


class PathMapCache:
    """Lazily computed path maps, shareable across runs on one fabric."""

    def __init__(self, fabric: Fabric, port_range: tuple[int, int] = ROCE_PORT_RANGE) -> None:
        self.fabric, self.port_range = fabric, port_range
        self._maps: dict[tuple[int, int, int], PathMap] = {}

    def __call__(self, src: int, dst: int, dport: int) -> PathMap:
        key = (src, dst, dport)
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = fabric_pathmap(self.fabric, src, dst, dport, self.port_range)
        return m


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
        n_links = fabric.n_links
        eff = fabric.efficiency
        cap = [lk.capacity_bps * eff / 8.0 for lk in fabric.links]
        # Spray bundles: aggregate of a leaf's uplinks, and of the downlinks into a leaf.
        self._up_bundle = [n_links + a for a in range(fabric.n_leaves)]
        self._down_bundle = [n_links + fabric.n_leaves + b for b in range(fabric.n_leaves)]
        for a in range(fabric.n_leaves):
            cap.append(sum(cap[fabric.uplink(a, k)] for k in range(fabric.n_spines)))
        for b in range(fabric.n_leaves):
            cap.append(sum(cap[fabric.downlink(k, b)] for k in range(fabric.n_spines)))
        self.capacity = cap
        self.cores: list[ArkCore] = []
        if scheme in ("ark", "ark-balance"):
            child = self.rng.integers(0, 2**63 - 1, fabric.n_hosts)
            self.cores = [
                ArkCore(h, fabric, self.pathmaps, policy=scheme, seed=int(child[h]),
                        retention_s=retention_s)
                for h in range(fabric.n_hosts)
            ]

    # ------------------------------------------------------------------ helpers
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

    # ------------------------------------------------------------------ run
    def run(self, flows: Sequence[FlowSpec]) -> SimResult:
        fab = self.fabric
        heap: list[tuple[float, int, int, object]] = []
        seq = 0
        for f in flows:
            if f.nbytes < 0 or not math.isfinite(f.start_s):
                raise SimError(f"flow {f.id}: needs nbytes >= 0 and a finite start")
            heapq.heappush(heap, (f.start_s, seq, _START, f))
            seq += 1
        if self.cores:
            heapq.heappush(heap, (1.0, seq, _TICK, None))
            seq += 1
        results = {f.id: FlowResult(f.id, f.src, f.dst, f.nbytes, f.start_s) for f in flows}
        active: dict[int, _Active] = {}
        by_core_flow: dict[FlowId, _Active] = {}
        spine_now = [0] * fab.n_spines
        spine_max = [0] * fab.n_spines
        timeline: list[tuple[float, tuple[int, ...]]] = []
        mismatches = 0
        fallbacks = 0
        messages = 0
        events = 0
        now = 0.0
        last = 0.0
        dirty = False
        pending = len(flows)

        def spines_changed(t: float) -> None:
            for k, c in enumerate(spine_now):
                if c > spine_max[k]:
                    spine_max[k] = c
            if self.record_timeline:
                timeline.append((t, tuple(spine_now)))

        def add(act: _Active) -> None:
            for k in act.spines:
                spine_now[k] += 1

        def remove(act: _Active) -> None:
            for k in act.spines:
                spine_now[k] -= 1

        def broadcast(src: int, msgs: Sequence[Message], t: float) -> None:
            nonlocal seq, messages
            for m in msgs:
                messages += 1
                if self.jitter:
                    for h in range(fab.n_hosts):
                        if h != src:
                            d = self.delay + float(self.rng.uniform(0, self.jitter))
                            heapq.heappush(heap, (t + d, seq, _DELIVER, (m, (h,))))
                            seq += 1
                else:
                    dests = tuple(h for h in range(fab.n_hosts) if h != src)
                    heapq.heappush(heap, (t + self.delay, seq, _DELIVER, (m, dests)))
                    seq += 1

        def apply_repaths(evs: Sequence[Repath], t: float) -> bool:
            nonlocal mismatches
            changed = False
            for ev in evs:
                act = by_core_flow.get(ev.flow)
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
                        mismatches += 1
                    remove(act)
                    act.links, act.spines = self._links(res.src, res.dst, sw)
                    add(act)
                    res.path, res.port = sw, ev.port
                    changed = True
            if changed:
                spines_changed(t)
            return changed

        while pending or heap:
            if dirty and active:
                acts = list(active.values())
                rates = maxmin_rates([a.links for a in acts], self.capacity)
                for a, r in zip(acts, rates, strict=True):
                    a.rate = r
                dirty = False
            t_comp = math.inf
            for a in active.values():
                if a.rate > 0:
                    tc = last + a.remaining / a.rate
                    if tc < t_comp:
                        t_comp = tc
            t_ev = heap[0][0] if heap else math.inf
            if t_comp == math.inf and t_ev == math.inf:
                raise SimError("stalled: active flows but no rate (a zero-capacity link?)")
            now = min(t_comp, t_ev)
            dt = now - last
            if dt > 0:
                for a in active.values():
                    a.remaining -= a.rate * dt
                last = now
            events += 1
            if t_comp <= t_ev:
                # Relative tolerance: an absolute one can stall the clock below one ulp.
                done = [a for a in active.values() if a.remaining <= a.rate * 1e-9]
                if not done:
                    done = [min(active.values(), key=lambda a: a.remaining / a.rate if a.rate else math.inf)]
                for a in done:
                    del active[a.res.id]
                    a.res.finish_s = now
                    pending -= 1
                    remove(a)
                    if a.core_flow is not None:
                        core = self.cores[a.res.src]
                        rel = core.release(a.core_flow, now)
                        del by_core_flow[a.core_flow]
                        broadcast(a.res.src, rel.messages, now)
                        apply_repaths(rel.events, now)
                spines_changed(now)
                dirty = True
                continue
            _, _, kind, data = heapq.heappop(heap)
            if kind == _START:
                assert isinstance(data, FlowSpec)
                f = data
                res = results[f.id]
                if f.nbytes == 0:
                    res.finish_s = now
                    pending -= 1
                    continue
                core_flow = None
                if self.scheme == "ecmp":
                    lo, hi = self.port_range
                    port = int(self.rng.integers(lo, hi + 1))
                    path = self._switch(f.src, f.dst, port)
                elif self.scheme == "spray":
                    port, path = -1, -1
                else:
                    core = self.cores[f.src]
                    dec = core.request(f.dst, f.nbytes, now, self.dport)
                    port = dec.port
                    path = self._switch(f.src, f.dst, port)
                    if path != dec.path:
                        mismatches += 1
                    res.reserved, res.fallback = dec.reserved, dec.fallback
                    fallbacks += dec.fallback
                    core_flow = dec.flow
                    broadcast(f.src, dec.messages, now)
                    apply_repaths(dec.events, now)
                res.path, res.port = path, port
                links, spines = self._links(f.src, f.dst, max(path, 0))
                act = _Active(res, links, spines)
                act.core_flow = core_flow
                active[f.id] = act
                if core_flow is not None:
                    by_core_flow[core_flow] = act
                add(act)
                spines_changed(now)
                dirty = True
            elif kind == _DELIVER:
                msg, dests = cast(tuple[Message, tuple[int, ...]], data)
                for h in dests:
                    evs = self.cores[h].receive(msg, now)
                    if evs and apply_repaths(evs, now):
                        dirty = True
            else:  # tick
                for c in self.cores:
                    c.tick(now)
                if pending:
                    heapq.heappush(heap, (now + 1.0, seq, _TICK, None))
                    seq += 1
        races = sum(c.counters.races_lost for c in self.cores)
        return SimResult(
            self.scheme,
            [results[f.id] for f in flows],
            races,
            fallbacks,
            mismatches,
            spine_max,
            events,
            timeline,
            messages,
        )
