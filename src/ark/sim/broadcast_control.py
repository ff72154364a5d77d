"""The simulator's broadcast control plane (``[network] control = "broadcast"``).

Every host runs an :class:`ark.core.protocol.ArkCore` and broadcasts its RESERVE and
RELEASE messages; they reach the peers after the control-plane one-way delay, so races
happen as they would. Without jitter, skew or in-band control every host receives a
message at the same instant, so the cores share one reservation table that receives each
message once (:class:`ark.core.shared_table.SharedTableCore`: a host's own messages in
flight stay with its core until then): the same decisions and re-paths as one replica per
host, at a cost per message that does not grow with the number of hosts. Otherwise each
host keeps its own replica and its own clock (skewed by a seeded offset), and every copy
of a message is delivered on its own, after the delay plus a seeded jitter draw, or across
the data fabric's queues (in-band control).

Under ``ark-split`` a transfer is several reserved sub-flows on distinct paths
(:meth:`ArkCore.request_split`). The switches still hash the chosen port; any
disagreement with the reserved path is counted by the loop. The cores' timers fire at
their own deadlines (:meth:`ArkCore.next_deadline`), never by polling. After a link
failure the hosts rebuild their maps and reserve again the flows whose port moved
(:meth:`BroadcastControl.rebuild`, as ``Node.reload_pathmaps`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ark.core.flows import FlowSpec
from ark.core.messages import FlowId, Message, Release
from ark.core.protocol import ArkCore, Decision, PathMaps, Repath
from ark.core.shared_table import SharedTableCore
from ark.core.table import ReservationTable
from ark.core.topology import Fabric
from ark.sim.control import Counters, Loop, Part
from ark.sim.transfer import Transfer


class _Deliver(NamedTuple):
    msg: Message
    dests: tuple[int, ...] | None  # None: the shared table (every host but the sender)


class _Timer(NamedTuple):
    pass


def _arrival_order(d: _Deliver) -> tuple[float, int, int, int]:
    msg = d.msg
    return (msg.ts, 0 if isinstance(msg, Release) else 1, msg.flow[0], msg.flow[1])


def _is_delivery(ev: object) -> bool:
    return isinstance(ev, _Deliver)


def _part(dec: Decision) -> Part:
    return Part(dec.flow, dec.path, dec.port, dec.reserved, dec.fallback)


class BroadcastControl:
    """One core per host, and the messages between them (see the module docstring)."""

    name = "broadcast"

    def __init__(
        self, fabric: Fabric, policy: str, pathmaps: PathMaps, loop: Loop, *, host_seeds: Sequence[int],
        retention_s: float, shared_table: bool, delay_s: float, jitter_s: float, on_data: bool,
        offsets: list[float] | None, rng: np.random.Generator, dport: int, parts: int,
    ) -> None:
        self._loop, self._n = loop, fabric.n_hosts
        self.delay, self.jitter, self.on_data = delay_s, jitter_s, on_data
        self._off, self._rng, self.dport, self.parts = offsets, rng, dport, parts
        self.table: ReservationTable | None = None
        self.cores: list[ArkCore]
        # A host keeps source-port buckets only for peers it has flows to: the maps come
        # from the (bounded) cache, so memory does not grow with pairs.
        if shared_table:
            table = self.table = ReservationTable(fabric, policy=policy, retention_s=retention_s)
            self.cores = [SharedTableCore(h, table, pathmaps, seed=host_seeds[h], max_idle_peers=0)
                          for h in range(fabric.n_hosts)]
        else:
            self.cores = [ArkCore(h, fabric, pathmaps, policy=policy, seed=host_seeds[h], retention_s=retention_s,
                                  max_idle_peers=0) for h in range(fabric.n_hosts)]
        self._by_core_flow: dict[FlowId, tuple[Transfer, int]] = {}
        self._pending_hosts: dict[int, None] = {}  # hosts with messages on their way to the shared table
        self._timer_at = math.inf
        self._messages = self._events = self._rebuild_repathed = 0
        self._sent_by_host = [0] * fabric.n_hosts
        self._ctl_sum, self._ctl_n, self._ctl_max = 0.0, 0, 0.0

    # ------------------------------------------------------------------ the loop's calls
    def ask(self, f: FlowSpec, now: float) -> None:
        """The source host's core picks the path(s) and tells the others; the flow starts now."""
        core = self.cores[f.src]
        local = self._local(f.src)
        if self.parts > 1:
            decs = core.request_split(f.dst, f.nbytes, local, self.parts, self.dport)
        else:
            decs = (core.request(f.dst, f.nbytes, local, self.dport),)
        for d in decs:
            self._broadcast(f.src, d.messages, now)
            self._repath(d.events)
        self._arm_timer(core)
        t = self._loop.start(f, [_part(d) for d in decs])
        for k, d in enumerate(decs):
            self._by_core_flow[d.flow] = (t, k)

    def on_event(self, ev: object, now: float) -> None:
        if isinstance(ev, _Deliver):
            self._on_deliver(ev, now)
        elif now == self._timer_at:  # else superseded by an earlier deadline: not an event
            self._events += 1
            self._on_timer(now)

    def done(self, t: Transfer, now: float) -> None:
        """``t`` completed: its host releases each reservation and tells the others."""
        for sub in t.subs:
            if sub.core_flow is None:
                continue
            core = self.cores[t.res.src]
            rel = core.release(sub.core_flow, self._local(core.host))
            del self._by_core_flow[sub.core_flow]
            self._broadcast(t.res.src, rel.messages, now)
            self._repath(rel.events)
            self._arm_timer(core)

    def holds(self, flow: FlowId) -> bool:
        own = self.cores[flow[0]].local_flows().get(flow)
        return own is not None and own[3]

    def counters(self) -> Counters:
        mean = self._ctl_sum / self._ctl_n if self._ctl_n else self.delay
        top = self._ctl_max if self._ctl_n else self.delay
        races = sum(c.counters.races_lost for c in self.cores)
        return Counters(races, self._messages, list(self._sent_by_host), mean, top, self._events,
                        self._rebuild_repathed)

    # ------------------------------------------------------------------ messages
    def _broadcast(self, src: int, msgs: Sequence[Message], now: float) -> None:
        n, at = self._n, self._loop.control_at
        self._sent_by_host[src] += len(msgs)
        for m in msgs:
            self._messages += 1
            if self.table is not None:
                self._pending_hosts[src] = None
                at(now + self.delay, _Deliver(m, None))
            elif self.on_data or self.jitter:
                for h in range(n):
                    if h != src:
                        d = self._loop.control_delay(src, h) if self.on_data else \
                            self.delay + float(self._rng.uniform(0, self.jitter))
                        self._ctl_sum += d
                        self._ctl_n += 1
                        self._ctl_max = max(self._ctl_max, d)
                        at(now + d, _Deliver(m, (h,)))
            else:
                at(now + self.delay, _Deliver(m, tuple(h for h in range(n) if h != src)))

    def _on_deliver(self, ev: _Deliver, now: float) -> None:
        # Messages arriving at the same instant arrive in key order (releases first at
        # equal timestamps), whatever order they were sent in: then no replica ever holds
        # a later key than a message still on its way to it from the same instant.
        batch = [ev, *(d for d in self._loop.control_due(_is_delivery) if isinstance(d, _Deliver))]
        self._events += len(batch)
        if len(batch) > 1:
            batch.sort(key=_arrival_order)
        for d in batch:
            if d.dests is None:
                self._deliver_to_table(d.msg)
                continue
            for h in d.dests:
                core = self.cores[h]
                self._repath(core.receive(d.msg, self._local(h)))
                self._arm_timer(core)

    def _deliver_to_table(self, msg: Message) -> None:
        """The shared table receives ``msg`` for every host but its sender; the cores whose
        flows that touched (and those still judging pending reservations) catch up."""
        assert self.table is not None
        changed = self.table.receive(msg)
        later = self.table.take_changed()  # what a deferred re-evaluation moved
        if changed is not None:
            changed = None if later is None else [*changed, *later]
        cores, n = self.cores, self._n
        sender = cores[msg.flow[0]]
        assert isinstance(sender, SharedTableCore)
        self._repath(sender.delivered(msg))
        if changed is None:
            for core in cores:
                self._repath(core.sync(None))
        else:
            for f in changed:
                if 0 <= f[0] < n:
                    self._repath(cores[f[0]].sync((f,)))
        for h in list(self._pending_hosts):
            core = cores[h]
            assert isinstance(core, SharedTableCore)
            if core.pending:
                self._repath(core.resync())
            else:
                del self._pending_hosts[h]
        self._arm_timer(None)

    def _repath(self, evs: Sequence[Repath]) -> bool:
        if not evs:
            return False
        by = self._by_core_flow
        moves = [(*entry, ev) for ev in evs if (entry := by.get(ev.flow)) is not None]
        return self._loop.repath(moves) if moves else False

    # ------------------------------------------------------------------ timers
    def _on_timer(self, now: float) -> None:
        self._timer_at = math.inf
        if self.table is not None:
            expired = self.table.tick(now)
            later = self.table.take_changed()
            for f in expired:
                self._repath(self.cores[f[0]].sync((f,)))
            for core in self.cores if later is None else (self.cores[f[0]] for f in later):
                self._repath(core.sync(None if later is None else later))
            self._arm_timer(None)
            return
        for core in self.cores:
            local = self._local(core.host)
            if core.next_deadline() <= local:
                self._repath(core.tick(local))
        for core in self.cores:
            self._arm_timer(core)

    def _arm_timer(self, core: ArkCore | None) -> None:
        """Make sure a timer fires by ``core``'s (None: the shared table's) next deadline,
        while flows remain."""
        if core is None or self.table is not None:
            t = self.table.next_deadline() if self.table is not None else math.inf
        else:
            t = self._sim_time(core.host, core.next_deadline())
        if t < self._timer_at and self._loop.pending:
            self._timer_at = t
            self._loop.control_at(t, _Timer())

    # ------------------------------------------------------------------ clocks
    def _local(self, host: int) -> float:
        """``host``'s clock now (skewed by its offset, if any)."""
        now = self._loop.now
        return now if self._off is None else now + self._off[host]

    def _sim_time(self, host: int, local: float) -> float:
        """The simulated instant at which ``host``'s clock reads ``local`` (never early)."""
        if self._off is None or local == math.inf:
            return local
        off = self._off[host]
        t = local - off
        while t + off < local:
            t = math.nextafter(t, math.inf)
        return t

    # ------------------------------------------------------------------ link failures
    def rebuild(self, now: float) -> None:
        """The hosts have rebuilt their maps: each re-reserves its flows whose port moved."""
        for core in self.cores:
            moved = core.reload_pathmaps()
            reserved = {f: v[3] for f, v in core.local_flows().items()} if moved else {}
            for flow in moved:
                entry = self._by_core_flow.get(flow)
                if entry is not None and reserved.get(flow):
                    self._rereserve(core, flow, *entry, now)
        for core in self.cores:  # every reserved flow crosses the path it holds
            for f, (_dst, held, _port, is_reserved) in core.local_flows().items():
                entry = self._by_core_flow.get(f)
                if is_reserved and entry is not None and entry[0].subs[entry[1]].path != held:
                    self._loop.mismatch()

    def _rereserve(self, core: ArkCore, flow: FlowId, t: Transfer, k: int, now: float) -> None:
        """As ``Node.reload_pathmaps``: release, then reserve again, keeping the port when
        the path it now leads to is free."""
        sub, res, local = t.subs[k], t.res, self._local(core.host)
        rel = core.release(flow, local)
        del self._by_core_flow[flow]
        self._broadcast(core.host, rel.messages, now)
        self._repath(rel.events)
        left = t.left(now)
        # The transfer's other parts keep their paths: stay off them while others are free,
        # as request_split does.
        avoid = 0
        for j, s in enumerate(t.subs):
            if j != k:
                avoid |= 1 << s.path  # siblings may share a path: a sum would carry into the next bit
        dec = core.request(res.dst, int(left / len(t.subs)), local, self.dport, prefer_port=sub.port, avoid=avoid)
        self._by_core_flow[dec.flow] = (t, k)
        self._broadcast(core.host, dec.messages, now)
        self._loop.replace(t, k, _part(dec))
        self._repath(dec.events)
        self._arm_timer(core)
        self._rebuild_repathed += 1
