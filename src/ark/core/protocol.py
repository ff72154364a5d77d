"""The ARK reservation protocol: a sans-IO replicated reservation table.

One :class:`ArkCore` runs per host. It never touches sockets, clocks or global random:
inputs are method calls with ``now`` passed in, outputs are messages to broadcast and
events for the local flows. The simulator, the agent and the testbed all drive it.

Table semantics (the same on every replica)
-------------------------------------------
The table is a pure function of the set of RESERVE, RENEW and RELEASE messages a replica
holds (two RELEASEs of one flow: the earliest counts),
so replicas that received the same messages agree, whatever the delivery order.
Reservations are processed in key order, key = ``(ts, owner host, owner seq)`` (the seq
only orders one host's own reservations made at the same instant). A reservation R is
evaluated against the links held, at time ``R.ts``, by reservations with smaller keys
that were not yet released (release ts > ``R.ts``):

1. requested path free (no holder on any of its links): R holds it alone;
2. otherwise R lost a race: it is re-pathed to the lowest-index free path;
3. otherwise no path is free: under ``ark`` R holds nothing (its flow stays on the path
   its port hashes to, as plain ECMP); under ``ark-balance`` and ``ark-split`` R shares
   its requested path.

``shared`` reservations (``ark-balance`` overflow) always share their requested path.

A reservation *ends* at ``min(release ts, lease expiry)``; RENEW moves the expiry later.
"Not yet released at ``R.ts``" above means "end > ``R.ts``". Expired reservations stop
holding links ``expiry_grace_s`` after their end (so that messages still in flight are
judged against the links that were held when they were sent); ``table(at=T)`` gives the
exact set at any instant ``T`` the replica still remembers.
A reservation is forgotten ``retention_s`` after it ends. Reservations that overlapped a
forgotten one are *frozen*: they keep the assignment they had (a joiner adopts them
from a peer's snapshot), and messages about reservations that ended before the
retention horizon are dropped as stale (without a lease: those that started before it).

Most messages arrive in key order and take an incremental fast path; the others
re-evaluate only the reservations from the earliest affected key on, against the ones
still active then. Both give exactly the full recomputation's result (the fault
harness checks this).

Requests (owner side)
---------------------
* ``ark`` (the paper): lowest-index free path; none free -> a random source port (plain
  ECMP), nothing reserved, nothing broadcast. So is a request at a cap of the host
  (:class:`CoreLimits`: live reservations, or what peers may retain of it): only an
  invalid request raises; ``Decision.why`` says why a flow holds no reservation.
* ``ark-balance``: as ``ark`` while a path is free; when none is, the path whose busiest
  link carries the fewest reserved bytes still to send (tie: lowest index).
  That flow is recorded as a shared reservation so later decisions see its bytes. A
  link's backlog is its live reservations fed into a work-conserving queue drained at
  the path rate (see :func:`ark.core.table.backlog`).
* ``ark-split`` (:meth:`ArkCore.request_split`): one transfer of known size as ``parts``
  sub-flows of equal reserved size on distinct paths, for an engine that sends one
  transfer over several connections (QPs) and hands each its next slice when it has
  room. Each part is an ordinary reservation chosen as ``ark-balance`` would, except
  that the parts of one transfer avoid each other's paths while others are left: the
  lowest free path, else the one whose busiest link has the least reserved backlog
  (marked shared). Receivers apply the parts like any reservation, so the wire format
  and every replica's rules are unchanged. A plain :meth:`ArkCore.request` under
  ``ark-split`` is one part (``ark-balance``).

The table itself (messages, holders, recomputation) is :class:`ark.core.table.ReservationTable`;
:class:`ArkCore` adds what belongs to one host: its flows, source ports and decisions.

A simulator whose hosts all hear every message after the same delay can give every
host one shared table instead of a replica each: :class:`ark.core.shared_table.SharedTableCore`
is that host's core (the simulator's alone; no agent uses it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ark.core.messages import FlowId, Message, Release, Renew, Reserve
from ark.core.pathmap import PathMapError, PortBuckets, PortMap
from ark.core.roce import flow_label_for_sport
from ark.core.table import (
    INF,
    POLICIES,
    Changed,
    CoreError,
    CoreLimits,
    Counters,
    Entry,
    ReservationTable,
    Routes,
    deadline_after,
    least_backlogged,
)

__all__ = [
    "POLICIES", "ArkCore", "CoreError", "CoreLimits", "Counters", "Decision", "LeaseFn", "PathMaps", "Released", "Repath",
    "Routes", "deadline_after",
]

PathMaps = Callable[[int, int, int], PortMap]  # (src, dst, dport) -> map
LeaseFn = Callable[[int, float], float]  # (nbytes, path rate bps) -> lease seconds

# Why a flow holds no reservation (Decision.why): the flow then goes out as plain ECMP.
SAME_LEAF = "same leaf"  # nothing to reserve
NO_FREE_PATH = "no free path"
NOT_RESERVING = "not reserving"  # request(reserve=False) without a reason of the caller's
# more_ports: extra ports one flow may hold, and never more than 1/MORE_PORTS_SHARE of its
# path's bucket, so that one flow cannot take every port of a path from the flows after it.
MORE_PORTS_PER_FLOW = 64
MORE_PORTS_SHARE = 8


@dataclass(slots=True)
class _Own:
    flow: FlowId
    dst: int
    dport: int
    path: int
    port: int
    reserved: bool
    # Ports the flow held before a re-path: its owner may still be sending on them until
    # it moves, so they stay claimed until the flow is released.
    stale: list[int] = field(default_factory=list)
    # More ports of its path (more_ports): an engine that opens several connections per
    # transfer binds each to its own port; claimed until the flow is released.
    extra: list[int] = field(default_factory=list)


class Repath(NamedTuple):
    """A local flow's path or reservation changed after a race was resolved."""

    flow: FlowId
    old_path: int
    path: int
    port: int
    flow_label: int | None
    reserved: bool


class Decision(NamedTuple):
    """The answer to :meth:`ArkCore.request`."""

    flow: FlowId
    dst: int
    dport: int
    path: int
    port: int
    flow_label: int | None
    reserved: bool
    shared: bool
    fallback: bool
    messages: tuple[Message, ...]
    events: tuple[Repath, ...] = ()
    why: str = ""  # why the flow holds no reservation ("" when it does), e.g. NO_FREE_PATH


class Released(NamedTuple):
    """The answer to :meth:`ArkCore.release`."""

    messages: tuple[Message, ...]
    events: tuple[Repath, ...]


class ArkCore:
    """One host's replica of the reservation table plus its local flows.

    ``bookkeeping_grid``: wake for bookkeeping on a grid rather than once per flow end
    (:meth:`ark.core.table.ReservationTable.next_deadline`); lease expiries stay exact.
    """

    def __init__(
        self,
        host: int,
        routes: Routes,
        pathmaps: PathMaps,
        *,
        policy: str = "ark",
        seed: int = 0,
        retention_s: float = 5.0,
        lease: LeaseFn | None = None,
        expiry_grace_s: float = 0.25,
        seq_base: int = 0,
        max_idle_peers: int | None = None,
        limits: CoreLimits | None = None,
        bookkeeping_grid: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise CoreError(f"policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
        if not 0 <= host < routes.n_hosts:
            raise CoreError(f"host: must be 0..{routes.n_hosts - 1}; got {host}")
        if not 0 <= seq_base < 2**62:
            raise CoreError(f"seq_base: must be 0..2**62-1; got {seq_base}")
        if max_idle_peers is not None and max_idle_peers < 0:
            raise CoreError(f"max_idle_peers: must be >= 0 or None; got {max_idle_peers}")
        self.host = host
        self.routes = routes
        self._n_hosts = routes.n_hosts
        self.policy = policy
        self.counters = Counters()
        self.limits = limits or CoreLimits.unbounded()
        self._owner_retained = self.limits.owner_retained  # read on every request (see _capped)
        self._table = self._new_table(retention_s, expiry_grace_s, bookkeeping_grid)
        self.retention_s = self._table.retention_s
        self.expiry_grace_s = self._table.expiry_grace_s
        self.purge_slack_s = self._table.purge_slack_s
        self._pathmaps = pathmaps
        self._rng = random.Random(seed)  # owned: ECMP fallback ports only
        self._seq = seq_base
        self._seq_base = seq_base
        self._lease = lease
        self._own: dict[FlowId, _Own] = {}
        # Local flows whose RESERVE is not released: what max_flows_per_host bounds.
        self._unreleased: set[FlowId] = set()
        self._buckets: dict[tuple[int, int], PortBuckets] = {}
        # Peers with no port in use, oldest first: beyond max_idle_peers their buckets go,
        # all but their round-robin cursors (the map comes back from whoever supplies maps),
        # so dropping a bucket changes no decision.
        self._max_idle = max_idle_peers
        self._idle: dict[tuple[int, int], None] = {}
        self._cursors: dict[tuple[int, int], tuple[int, ...]] = {}
        self._rates: dict[tuple[int, int], float] = {}
        self._sids: dict[int, tuple[int, ...]] = {}  # per destination: the table's stage ids
        self._dports: dict[int, None] = {}  # destination ports in use, least recent first
        self._settled: list[Repath] = []  # changes a deferred recomputation made, not yet returned
        self._handlers: dict[type, Callable[[Any], list[Repath]]] = {
            Reserve: self._on_reserve, Release: self._on_release, Renew: self._on_renew,
        }

    def _new_table(self, retention_s: float, expiry_grace_s: float, bookkeeping_grid: bool) -> ReservationTable:
        """This host's replica (a core on a shared table hands back that table instead)."""
        return ReservationTable(self.routes, policy=self.policy, retention_s=retention_s,
                                expiry_grace_s=expiry_grace_s, counters=self.counters, limits=self.limits,
                                bookkeeping_grid=bookkeeping_grid)

    @property
    def reservations(self) -> ReservationTable:
        """The reservation table this core judges against (shared in the simulator)."""
        return self._table

    # ------------------------------------------------------------------ owner API
    def request_split(self, dst: int, nbytes: int, now: float, parts: int, dport: int = 4791) -> tuple[Decision, ...]:
        """Reserve one transfer of ``nbytes`` as ``parts`` sub-flows (``ark-split``).

        Each part is its own flow (own id, port and reservation, released on its own) of
        ``nbytes / parts`` reserved bytes, chosen like a request of this core's policy but
        away from the paths the earlier parts took, as long as other usable paths remain:
        under ``ark-split`` and ``ark-balance`` a part finding no free path shares the
        least-backlogged one; under ``ark`` it goes out as plain ECMP.
        """
        if not 1 <= parts <= 64:
            raise CoreError(f"parts: must be 1..64; got {parts}")
        if nbytes < 0:
            raise CoreError(f"nbytes: must be >= 0; got {nbytes}")
        q, r = divmod(int(nbytes), parts)
        out: list[Decision] = []
        avoid = 0
        for i in range(parts):
            dec = self.request(dst, q + (i < r), now, dport, avoid=avoid)
            out.append(dec)
            avoid |= 1 << dec.path
        return tuple(out)

    def request(
        self, dst: int, nbytes: int, now: float, dport: int = 4791, prefer_port: int | None = None,
        *, reserve: bool = True, avoid: int = 0, why: str = NOT_RESERVING,
    ) -> Decision:
        """Pick a path and source port for a new flow to ``dst`` and reserve it.

        ``prefer_port``: keep this source port if the path it leads to is free (a
        re-pathed flow then needs no new connection). ``reserve=False``: a random port,
        nothing reserved (plain ECMP; a host whose clock cannot be trusted does this).
        ``avoid``: a bit mask of paths to stay off while other usable paths remain (the
        parts of one ``ark-split`` transfer). ``why``: the reason a ``reserve=False`` flow
        reports (``Decision.why``). A host at a cap of its own (:meth:`_capped`) gets plain
        ECMP too, never an error: only an invalid request raises.
        """
        # The guards inline (this is the hot path): what check_request and _capped check.
        if not (0 <= dst < self._n_hosts and dst != self.host and nbytes >= 0 and 0 <= dport <= 0xFFFF):
            self.check_request(dst, nbytes, dport)
        if self._table.dirty:
            self._settle()
        self.counters.requests += 1
        self._seq += 1
        flow = (self.host, self._seq)
        buckets = self._bucket(dst, dport)
        stages = self._table.stage_list(self.host, dst)
        if not stages:  # intra-leaf: nothing to choose, nothing to reserve
            return self._unreserved(flow, dst, dport, 0, buckets.take(0), fallback=False, why=SAME_LEAF)
        n = len(stages[0])
        capped = "" if not reserve or (len(self._unreleased) < self.limits.max_flows_per_host and self._table.owner_count(
            self.host) < self._owner_retained) else self._capped(float(now))
        if capped:
            self.counters.capped += 1
        if capped or not reserve:
            return self._ecmp(flow, dst, dport, buckets, capped or why)
        usable = buckets.usable_mask & ~avoid or buckets.usable_mask if avoid else buckets.usable_mask
        if prefer_port is None:  # the usual request (a core on a shared table has its own view)
            path, pinned = self._lowest_free(dst, n, usable, float(now)), None
        else:
            path, pinned = self._free_path(dst, n, buckets, prefer_port, float(now), usable)
        shared = False
        if path is None:
            self.counters.fallbacks += 1
            if self.policy == "ark":
                return self._ecmp(flow, dst, dport, buckets, NO_FREE_PATH)
            self.counters.shared += 1
            # A path no known source port reaches (a probed map after a link failure) is not usable.
            path, shared = self._balance_choice(stages, n, now, usable), True
        if pinned is not None:
            buckets.claim(pinned)
            port = pinned
        else:
            try:
                port = buckets.take(path)
            except PathMapError:  # every port of the path is held by live flows: nothing to reserve with
                self.counters.fallbacks += 1
                return self._ecmp(flow, dst, dport, buckets, f"no free port on path {path}")
        return self._reserve(flow, dst, dport, path, port, int(nbytes), float(now), shared)

    def place(
        self, flow: FlowId, dst: int, nbytes: int, now: float, dport: int, path: int | None, *,
        shared: bool = False, lease_s: float = INF, why: str = "",
    ) -> Decision:
        """Record a local flow whose path someone else decided (an arbiter): ``flow`` is
        the id it gave, ``path`` its path (None: plain ECMP, ``why`` says why). The flow
        takes a source port of that path from this host's maps, and its reservation goes
        into this table (which then holds only this host's flows: nothing is broadcast),
        pinned to that path: this table never decides it again (the arbiter's table may
        hold what this one does not, and the other way round)."""
        self.check_request(dst, nbytes, dport)
        if flow in self._own or flow[0] != self.host:
            raise CoreError(f"flow: {flow} is already a local flow or not this host's")
        self._settle()
        buckets = self._bucket(dst, dport)
        if not self._table.stage_list(self.host, dst):  # intra-leaf: one path, as request places it
            return self._unreserved(flow, dst, dport, 0, buckets.take(0), fallback=False, why=SAME_LEAF)
        if path is None:
            return self._ecmp(flow, dst, dport, buckets, why)
        if not 0 <= path < buckets.map.paths:
            raise CoreError(f"path: must be 0..{buckets.map.paths - 1}; got {path}")
        try:
            port = buckets.take(path)
        except PathMapError:
            self.counters.fallbacks += 1
            return self._ecmp(flow, dst, dport, buckets, f"no free port on path {path}")
        rate = float(self.routes.path_rate_bps(self.host, dst, path))
        msg = Reserve(flow, float(now), self.host, dst, dport, path, port, int(nbytes), rate, shared,
                      float(now) + lease_s)
        self._own[flow] = _Own(flow, dst, dport, path, port, True)
        self._unreleased.add(flow)
        self.counters.reserved += 1
        self.sync(self._table.insert(msg, pinned=True))
        self.flush()
        return Decision(flow, dst, dport, path, port, flow_label_for_sport(port), reserved=True, shared=shared,
                        fallback=shared, messages=())

    def extend_to(self, flow: FlowId, expires: float, now: float) -> None:
        """A local reservation's lease now ends at ``expires`` (an arbiter renewed it)."""
        entry = self._table.get(flow)
        if flow not in self._own or entry is None or entry.released is not None or expires <= entry.expires:
            return
        self._table.apply_renew(entry, Renew(flow, max(float(now), entry.msg.ts), expires))

    def check_request(self, dst: int, nbytes: int, dport: int) -> None:
        """An invalid request: the only kind :meth:`request` refuses."""
        if not 0 <= dst < self._n_hosts or dst == self.host:
            raise CoreError(f"dst: must be another host 0..{self._n_hosts - 1}; got {dst}")
        if nbytes < 0:
            raise CoreError(f"nbytes: must be >= 0; got {nbytes}")
        if not 0 <= dport <= 0xFFFF:
            raise CoreError(f"dport: must be 0..65535; got {dport}")

    def _capped(self, now: float) -> str:
        """Why this host may not reserve more now ("" when it may).

        Live reservations are bounded by ``max_flows_per_host``; released ones do not
        count. What peers bound is every retained reservation of ours (ended ones until
        forgotten): we stop ``max_flows_per_host`` short of that (``owner_retained``), so a
        peer that forgets later than we do still takes every RESERVE we send. Ended ones
        count for ``retention_s`` only: at the cap, what waits only for the next forgetting
        on the bookkeeping grid (up to twice ``purge_slack_s`` more) is forgotten first.
        """
        lim = self.limits
        if len(self._unreleased) >= lim.max_flows_per_host:
            return f"cap: {lim.max_flows_per_host} live reservations"
        if self._table.owner_count(self.host) >= self._owner_retained:
            self._table.forget_ended(now)
            if self._table.owner_count(self.host) >= self._owner_retained:
                return f"cap: {self._owner_retained} reservations retained"
        return ""

    def _ecmp(self, flow: FlowId, dst: int, dport: int, buckets: PortBuckets, why: str) -> Decision:
        """Plain ECMP: a random source port of the map, nothing reserved, nothing broadcast."""
        port = self._random_port(buckets)
        return self._unreserved(flow, dst, dport, buckets.map.path_of(port), port, fallback=True, why=why)

    def _free_path(
        self, dst: int, n: int, buckets: PortBuckets, prefer_port: int | None, now: float, usable: int
    ) -> tuple[int | None, int | None]:
        """(lowest free path of ``usable``, the preferred port when its own path is free)."""
        free_path = self._lowest_free(dst, n, usable, now)
        if prefer_port is not None and free_path is not None and prefer_port not in buckets.in_use:
            lo, hi = buckets.map.port_range
            pp = buckets.map.path_of(prefer_port) if lo <= prefer_port <= hi else -1
            if pp >= 0 and self._lowest_free(dst, n, 1 << pp, now) == pp:  # its path is free
                return pp, prefer_port
        return free_path, None

    def _lowest_free(self, dst: int, n: int, usable: int, now: float) -> int | None:
        """The lowest free path of ``usable`` in this core's view (the table's stage masks answer)."""
        return self._table.lowest_free(self._sids.get(dst) or self._stage_ids(dst), n, usable)

    def _stage_ids(self, dst: int) -> tuple[int, ...]:
        sids = self._sids[dst] = self._table.pair_sids(self.host, dst)
        return sids

    def _unreserved(
        self, flow: FlowId, dst: int, dport: int, path: int, port: int, *, fallback: bool, why: str
    ) -> Decision:
        self._own[flow] = _Own(flow, dst, dport, path, port, False)
        return Decision(flow, dst, dport, path, port, flow_label_for_sport(port), reserved=False, shared=False,
                        fallback=fallback, messages=(), events=tuple(self.flush()), why=why)

    def _reserve(
        self, flow: FlowId, dst: int, dport: int, path: int, port: int, nbytes: int, now: float, shared: bool
    ) -> Decision:
        rate = self._rates.get((dst, path))
        if rate is None:
            rate = self._rates[(dst, path)] = float(self.routes.path_rate_bps(self.host, dst, path))
        expires = now + self._lease(nbytes, rate) if self._lease else INF
        msg = Reserve(flow, now, self.host, dst, dport, path, port, nbytes, rate, shared, expires)
        own = self._own[flow] = _Own(flow, dst, dport, path, port, True)
        self._unreleased.add(flow)
        self.counters.reserved += 1
        changes = self._record_reserve(msg)
        # With skewed clocks our own key may lose at once to a peer's smaller key, and a
        # recomputation may move other local flows: report those as events.
        events = tuple(e for e in changes if e.flow != flow) if changes else ()
        reserved = own.reserved
        return Decision(  # positional: one per request (reserved, shared, fallback, messages, events, why)
            flow, dst, dport, own.path, own.port, flow_label_for_sport(own.port), reserved, shared,
            shared or not reserved, (msg,), events, "" if reserved else NO_FREE_PATH,  # lost at once
        )

    def select_path(self, dst: int) -> int | None:
        """The lowest-index path to ``dst`` whose links are all free (None if none)."""
        self._settle()
        stages = self._table.stage_list(self.host, dst)
        if not stages:
            return 0
        return self._table.lowest_free(self._table.pair_sids(self.host, dst), len(stages[0]))

    def release(self, flow: FlowId, now: float) -> Released:
        """The local flow finished: free its port and broadcast RELEASE if it reserved."""
        own = self._own.pop(flow, None)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._unreleased.discard(flow)
        self._settle()
        buckets = self._bucket(own.dst, own.dport)
        for port in (own.port, *own.stale, *own.extra):
            buckets.give(port)
        if self._max_idle is not None and not buckets.in_use:
            self._forget_idle((own.dst, own.dport))
        entry = self._entry(flow)
        msg = Release(flow, float(now))
        if entry is None or entry.released is not None or msg.ts < entry.msg.ts:
            return Released((), tuple(self.flush()))
        return self._record_release(msg)

    def _record_reserve(self, msg: Reserve) -> list[Repath]:
        """Our new reservation into the table; the local flows it changed."""
        inserted = self._table.insert(msg)
        entry = self._table.get(msg.flow)
        if inserted == [msg.flow] and entry is not None and entry.path == msg.path and entry.held:
            return self.flush()  # the common case: it alone changed, and holds the path it asked for
        return [*self.sync(inserted), *self.flush()]

    def _record_release(self, msg: Release) -> Released:
        """Our RELEASE into the table: what to broadcast, and the local flows it changed."""
        self.sync(self._table.apply_release(msg))
        return Released((msg,), tuple(self.flush()))

    def unreserve(self, flow: FlowId, now: float) -> Released:
        """Give up a local flow's reservation but keep the flow (and its port) running.

        The flow goes on as plain ECMP; peers learn from the RELEASE that its links are
        free. Used when this host can no longer keep its promises (a skewed clock). Ports
        of paths it left before (re-paths) go back to their buckets: it stays where it is.
        """
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._settle()
        entry = self._table.get(flow)
        own.reserved = False
        self._unreleased.discard(flow)
        self._give_back(own, own.stale)
        own.stale = []
        if entry is None or entry.released is not None:
            return Released((), tuple(self.flush()))
        msg = Release(flow, max(float(now), entry.msg.ts))  # a clock that stepped back cannot undo it
        self.sync(self._table.apply_release(msg))
        return Released((msg,), tuple(e for e in self.flush() if e.flow != flow))

    def renew(self, flow: FlowId, now: float) -> tuple[Message, ...]:
        """Extend a local reservation's lease by a full lease from ``now``."""
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._settle()
        entry = self._table.get(flow)
        if entry is None or self._lease is None or entry.released is not None:
            return ()
        expires = float(now) + self._lease(entry.msg.nbytes, entry.msg.rate_bps)
        if expires <= entry.expires:
            return ()
        msg = Renew(flow, float(now), expires)
        self._table.apply_renew(entry, msg)
        return (msg,)

    def more_ports(self, flow: FlowId, n: int) -> list[int]:
        """Up to ``n`` more free source ports of a local flow's path, claimed for the flow
        until it is released or moves to another path; fewer (or none) when its bucket has
        no more free ports, or when the flow holds ``MORE_PORTS_PER_FLOW`` extra ports or
        1/``MORE_PORTS_SHARE`` of its path's bucket already (the flows after it need ports
        of that path too)."""
        self._settle()  # the flow's path as every deferred message leaves it
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        if n < 0:
            raise CoreError(f"n: must be >= 0; got {n}")
        buckets = self._bucket(own.dst, own.dport)
        share = len(buckets.map.buckets[own.path]) // MORE_PORTS_SHARE
        n = min(n, min(MORE_PORTS_PER_FLOW, share) - len(own.extra))
        out: list[int] = []
        while len(out) < n:
            port = buckets.try_take(own.path)
            if port is None:
                break
            out.append(port)
        own.extra.extend(out)
        return out

    def receive(self, msg: Message, now: float, sender: int | None = None, *, defer: bool = False) -> list[Repath]:
        """Apply a peer's message; returns changes to local flows (races lost).

        ``defer``: leave a forced re-evaluation for :meth:`flush` (a batch of messages
        then costs one); the changes come back from that call instead.
        """
        self.counters.received += 1
        if sender is not None and msg.flow[0] != sender:
            self.counters.invalid += 1
            return []
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counters.invalid += 1
            return []
        events = handler(msg)
        return events if defer else [*events, *self.flush()]

    def _on_reserve(self, msg: Reserve) -> list[Repath]:
        if not self._table.admissible(msg):
            return []
        if msg.flow[0] == self.host and msg.flow not in self._own and msg.flow[1] > self._seq_base:
            # An echo of a reservation of ours we have already forgotten: ignore.
            # (Lower seqs belong to a predecessor before a restart: kept, so that
            # they can be released.)
            self.counters.stale += 1
            return []
        if not self._table.has_room(msg):
            return []
        return self.sync(self._table.insert(msg))

    def _on_release(self, msg: Release) -> list[Repath]:
        return self.sync(self._table.on_release(msg))

    def _on_renew(self, msg: Renew) -> list[Repath]:
        return self.sync(self._table.on_renew(msg))

    def tick(self, now: float) -> list[Repath]:
        """Let time pass: expire leases, forget old reservations.

        Returns changes to local flows whose lease ran out (they no longer hold a path).
        """
        self._settle()
        events: list[Repath] = self.flush()
        for flow in self._table.tick(now):
            if flow in self._own:
                events.extend(self._sync_own(flow, race=False))
        return events

    def next_deadline(self) -> float:
        """The earliest instant at which :meth:`tick` has work (``inf``: none)."""
        return self._table.next_deadline()

    def flush(self) -> list[Repath]:
        """Apply what received messages deferred; changes to local flows since the last flush.

        :meth:`receive` with ``defer`` leaves re-evaluations that a message forces (a key
        older than the newest, a release or renewal that changes the past) to the table,
        so that a batch of messages costs one recomputation from the earliest affected
        key. Every owner operation and every view settles first, so nothing observable is
        stale; a driver calls this after each batch (or each message) to learn which
        local flows moved.
        """
        self._settle()
        out, self._settled = self._settled, []
        return out

    def _settle(self) -> None:
        """Run the table's deferred recomputation; keep what it moved for the next flush().
        """
        if self._table.dirty:
            changed = self._table.take_changed()
            if changed is None or changed:
                self._settled.extend(self.sync(changed))

    def sync(self, flows: Changed | Iterable[FlowId]) -> list[Repath]:
        """Bring the listed local flows (None: all of them) in line with the table."""
        events: list[Repath] = []
        for f in list(self._own) if flows is None else flows:
            if f in self._own:
                events.extend(self._sync_own(f))
        return events

    def _entry(self, flow: FlowId) -> Entry | None:
        return self._table.get(flow)

    def _view_backlog(self, lk: int, now: float) -> float:
        return self._table.link_backlog(lk, now)

    # ------------------------------------------------------------------ table views
    def frozen(self) -> dict[FlowId, tuple[int | None, bool]]:
        """Assignments that can no longer be recomputed here (see :class:`~ark.core.table.Entry`)."""
        self._settle()
        return self._table.frozen()

    def adopt(self, assignments: dict[FlowId, tuple[int | None, bool] | None]) -> list[Repath]:
        """Set or thaw assignments that cannot be recomputed here (see
        :meth:`ark.core.table.ReservationTable.adopt`); report the local flows that moved."""
        return self.sync(self._table.adopt(assignments))

    def assignment(self, flow: FlowId) -> tuple[float, bool, int | None, bool] | None:
        """``(ts, frozen, path, shared)`` of a reservation held here, else None."""
        self._settle()
        return self._table.assignment(flow)

    def _recompute(self) -> list[Repath]:
        self._settle()
        return self.sync(self._table.recompute())

    def snapshot(self) -> list[Message]:
        """Every message this replica holds, for a peer that (re)joins."""
        self._settle()
        return self._table.snapshot()

    def table(self, at: float | None = None) -> dict[FlowId, tuple[int, bool]]:
        """Reservations holding links: flow -> (path, shared) (see :meth:`ReservationTable.table`)."""
        self._settle()
        return self._table.table(at)

    def entries(self) -> dict[FlowId, tuple[Reserve, float | None, int | None, bool]]:
        """Everything the replica knows: flow -> (reserve, released ts, path, shared)."""
        self._settle()
        return self._table.entries()

    def state_digest(self, since: float, until: float = INF, owner: int | None = None) -> bytes:
        """Digest of the (flow, end) pairs (of ``owner``, or of every host) ending in
        [``since``, ``until``) (see the table)."""
        return self._table.state_digest(since, until, owner)

    def knows(self, flow: FlowId) -> bool:
        """Does this replica keep anything about ``flow`` (a reservation, an early message)?"""
        return self._table.knows(flow)

    def set_clock(self, owner: int, behind: float, margin: float) -> None:
        """How far ``owner``'s clock runs behind ours, as we measured it (see
        :meth:`ark.core.table.ReservationTable.set_clock`); our own is 0 by definition."""
        if owner != self.host:
            self._table.set_clock(owner, behind, margin)

    def behind(self, owner: int) -> float:
        """How far behind ours we judge ``owner``'s clock (0: within the bound)."""
        return self._table.behind(owner)

    def end_of(self, flow: FlowId) -> float | None:
        """The end of a known reservation (min of release and lease expiry)."""
        return self._table.end_of(flow)

    def digest(self, at: float | None = None) -> str:
        """Order-independent digest of :meth:`table` (paths, not ports)."""
        self._settle()
        return self._table.digest(at)

    def link_holders(self) -> dict[int, frozenset[FlowId]]:
        self._settle()
        return self._table.link_holders()

    def exclusive_conflicts(self, at: float | None = None) -> list[int]:
        """Links held by two flows of which one claims them alone (must stay empty)."""
        self._settle()
        return self._table.exclusive_conflicts(at)

    # ------------------------------------------------------------------ local flows
    def reload_pathmaps(self) -> list[FlowId]:
        """Take fresh path maps (the fabric re-hashed); returns local flows whose port moved.

        Ports in use stay claimed. A listed flow's packets now cross another path than
        its reservation says: the caller (``Node.reload_pathmaps``) reserves it again,
        and its owner moves to the new port if it changed (a RoCE QP through
        mlx5dv_modify_qp_udp_sport, a TCP sender on a new connection).
        """
        self._settle()
        old = self._buckets
        self._buckets = {}
        for key, b in old.items():
            nb = self._bucket(*key)
            for port in b.in_use:
                nb.claim(port)
        moved = []
        for f, o in self._own.items():
            path = self._bucket(o.dst, o.dport).map.path_of(o.port)
            # -1: the new map does not know the port (not probed, e.g. busy): no evidence it moved.
            if path != o.path and path >= 0:
                moved.append(f)
                if not o.reserved:
                    o.path = path  # nothing reserved: only where its bytes go changed
        return sorted(moved)

    def local_flows(self) -> dict[FlowId, tuple[int, int, int, bool]]:
        """Local flows: flow -> (dst, path, port, reserved)."""
        self._settle()
        return {f: (o.dst, o.path, o.port, o.reserved) for f, o in self._own.items()}

    def local_flow(self, flow: FlowId) -> tuple[int, int, int, bool]:
        """One local flow's (dst, path, port, reserved), as :meth:`local_flows` has it."""
        self._settle()
        o = self._own.get(flow)
        if o is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        return o.dst, o.path, o.port, o.reserved

    def _bucket(self, dst: int, dport: int) -> PortBuckets:
        key = (dst, dport)
        b = self._buckets.get(key)
        if b is None:
            self._admit_dport(dport)
            b = self._buckets[key] = PortBuckets(self._pathmaps(self.host, dst, dport))
            cursors = self._cursors.pop(key, None) if self._cursors else None
            if cursors is not None:
                b.cursors = cursors
        elif self._idle:
            self._idle.pop(key, None)
        return b

    def _admit_dport(self, dport: int) -> None:
        """Make room for a new destination port: its maps and buckets cost memory per peer."""
        ports = self._dports
        if dport in ports:
            ports[dport] = ports.pop(dport)  # most recent last
            return
        if len(ports) >= self.limits.max_dports:
            idle = next((d for d in ports if not any(b.in_use for (_, dp), b in self._buckets.items() if dp == d)), None)
            if idle is None:
                raise CoreError(f"dport: {len(ports)} destination ports are in use (limit {self.limits.max_dports}); "
                                f"got {dport}")
            del ports[idle]
            for key in [k for k in self._buckets if k[1] == idle]:
                del self._buckets[key]
                self._idle.pop(key, None)
            forget = getattr(self._pathmaps, "forget_dport", None)
            if forget is not None:
                forget(idle)
        ports[dport] = None

    def _forget_idle(self, key: tuple[int, int]) -> None:
        idle = self._idle
        idle.pop(key, None)
        idle[key] = None
        while len(idle) > (self._max_idle or 0):
            old = next(iter(idle))
            del idle[old]
            b = self._buckets.pop(old, None)
            if b is not None:
                self._cursors[old] = b.cursors

    def _random_port(self, buckets: PortBuckets) -> int:
        if buckets.map.sampled:  # only probed ports have a known path
            known = [p for p in buckets.map.known_ports().tolist() if p not in buckets.in_use]
            if not known:
                raise CoreError("every probed source port towards this peer is in use")
            port: int = known[self._rng.randrange(len(known))]
            buckets.claim(port)
            return port
        lo, hi = buckets.map.port_range
        if len(buckets.in_use) > hi - lo:
            raise CoreError("every source port towards this peer is in use")
        while True:
            port = self._rng.randint(lo, hi)
            if port not in buckets.in_use:
                buckets.claim(port)
                return port

    def _sync_own(self, flow: FlowId, race: bool = True) -> list[Repath]:
        """Bring a local flow in line with its table entry; report what changed."""
        own = self._own.get(flow)
        entry = self._entry(flow)
        if own is None or entry is None:
            return []
        reserved = entry.path is not None and entry.held
        new_path = entry.path if entry.path is not None else own.path
        if new_path == own.path and reserved == own.reserved:
            return []
        old = own.path
        if new_path != own.path:
            reserved = self._move(own, new_path) and reserved
        own.reserved = reserved
        if race:
            self.counters.races_lost += 1
        return [Repath(flow, old, own.path, own.port, flow_label_for_sport(own.port), reserved)]

    def _move(self, own: _Own, new_path: int) -> bool:
        """Move a local flow to a port of ``new_path``; False when it cannot go there.

        The port it leaves stays claimed until its next move or its release (its owner may
        still be sending on it until it has moved). The ports it held before that and its
        extra ports (more_ports) of the path it leaves go back to their buckets at once,
        so that a flow raced off a path does not keep that path's ports from later flows:
        a bucket is walked round-robin, so a port given back is handed out again only after
        the walk has passed every other port of its path.
        """
        buckets = self._bucket(own.dst, own.dport)
        left, port = own.port, buckets.try_take(new_path)
        ok = port is not None
        if port is None:
            # The table's path is one our map has no free port for (a probed map after
            # a link failure: every replica agrees on the table, only we know the map).
            # Our bytes cannot go there: run unreserved on a random known port.
            try:
                port = self._random_port(buckets)
            except CoreError:  # no port at all: keep the old one rather than fail
                self.counters.fallbacks += 1
                return False
        self._give_back(own, [*own.stale, *own.extra])
        own.stale, own.extra = [left], []
        own.port, own.path = port, new_path if ok else buckets.map.path_of(port)
        return ok

    def ecmp_port(self, dst: int, dport: int) -> tuple[int, int]:
        """(path, port): a random source port towards ``dst`` that no local flow holds, not
        claimed: for a flow this host keeps nowhere (``Node`` beyond ``max_local_flows``)."""
        self.check_request(dst, 0, dport)
        buckets = self._bucket(dst, dport)
        port = self._random_port(buckets)
        buckets.give(port)
        return buckets.map.path_of(port), port

    def port_path(self, dst: int, dport: int, port: int) -> int:
        """The path a source port leads over towards ``dst`` (-1: the map does not know it)."""
        self.check_request(dst, 0, dport)
        return self._bucket(dst, dport).map.path_of(port)

    def _give_back(self, own: _Own, ports: list[int]) -> None:
        if ports:
            buckets = self._bucket(own.dst, own.dport)
            for p in ports:
                buckets.give(p)

    def _balance_choice(self, stages: tuple[tuple[int, ...], ...], n: int, now: float, usable: int = -1) -> int:
        return least_backlogged(stages, n, lambda lk: self._view_backlog(lk, now), usable)
