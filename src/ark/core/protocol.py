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
   its port hashes to, as plain ECMP); under ``ark-balance`` R shares its requested path.

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
  ECMP), nothing reserved, nothing broadcast.
* ``ark-balance``: as ``ark`` while a path is free; when none is, the path whose busiest
  link carries the fewest reserved bytes still to send (tie: lowest index).
  That flow is recorded as a shared reservation so later decisions see its bytes. A
  link's backlog is its live reservations fed into a work-conserving queue drained at
  the path rate (see :meth:`ArkCore._link_backlog`).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ark.core.messages import FlowId, Key, Message, Release, Renew, Reserve
from ark.core.pathmap import PathMap, PortBuckets
from ark.core.roce import flow_label_for_sport

POLICIES = ("ark", "ark-balance")


class Routes(Protocol):
    """What the core needs of a topology (``ark.core.topology.Fabric`` provides it)."""

    def stages(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]: ...

    def n_paths(self, src: int, dst: int) -> int: ...

    def path_rate_bps(self, src: int, dst: int, path: int) -> float: ...

    @property
    def n_hosts(self) -> int: ...


PathMaps = Callable[[int, int, int], PathMap]  # (src, dst, dport) -> map
LeaseFn = Callable[[int, float], float]  # (nbytes, path rate bps) -> lease seconds
INF = float("inf")
_NO_END_BUCKET = 2**62
_EVERYTHING: Key = (-INF, -1, -1)  # a deferred full recomputation


def _bucket_of(t: float) -> int:
    """The 100 ms digest bucket of a time; clamped, so no finite or infinite time overflows."""
    v = t * _BUCKETS_PER_S
    if v != v:
        raise CoreError("time: NaN")
    if v >= _NO_END_BUCKET:
        return _NO_END_BUCKET
    return -_NO_END_BUCKET if v <= -_NO_END_BUCKET else math.floor(v)
_BUCKETS_PER_S = 10


def deadline_after(t: float, offset: float, *, strict: bool) -> float:
    """The first float ``d`` with ``d - offset >= t`` (``> t`` when ``strict``).

    ``t + offset`` alone can round so that a tick at it still finds nothing due, and a
    caller that sleeps until the deadline would wake forever.
    """
    d = t + offset
    while d - offset < t or (strict and d - offset == t):
        d = math.nextafter(d, INF)
    return d


class CoreError(ValueError):
    """A local API misuse (unknown host, unknown flow, bad argument)."""


@dataclass(frozen=True)
class CoreLimits:
    """Bounds on what other hosts and local clients can make a replica keep.

    ``max_flows_per_host``: reservations of one owner a replica holds (a RESERVE beyond
    it is dropped and counted); ``max_early_per_host``: releases and renewals of one
    owner's still unknown flows kept for later; ``max_dports``: destination ports with
    path maps and port buckets at once (the least recently used idle one is dropped).
    """

    max_flows_per_host: int = 4096
    max_early_per_host: int = 1024
    max_dports: int = 8

    @classmethod
    def unbounded(cls) -> CoreLimits:
        """For a replica that only trusted code feeds (the simulator, benchmarks)."""
        return cls(2**62, 2**62, 2**16)


@dataclass(slots=True)
class _Entry:
    msg: Reserve
    released: float | None = None
    path: int | None = None  # assigned path; None = holds nothing
    shared: bool = False
    expires: float = INF
    renew_ts: float = -INF
    held: bool = False  # currently counted in the holders index
    # Frozen: an overlapping reservation has been forgotten, so recomputing this one
    # could give another answer than the one every replica already agreed on.
    frozen: bool = False

    @property
    def end(self) -> float:
        r = self.released
        return self.expires if r is None or r > self.expires else r


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


class Released(NamedTuple):
    """The answer to :meth:`ArkCore.release`."""

    messages: tuple[Message, ...]
    events: tuple[Repath, ...]


@dataclass
class Counters:
    requests: int = 0
    reserved: int = 0
    fallbacks: int = 0
    shared: int = 0
    races_lost: int = 0  # own flows re-pathed or unreserved after a race
    renewals: int = 0
    expired: int = 0  # reservations whose lease ran out before a RELEASE
    received: int = 0
    duplicates: int = 0
    stale: int = 0
    invalid: int = 0
    overflow: int = 0  # dropped: an owner over its share of the table (CoreLimits)
    recomputes: int = 0
    partial_recomputes: int = 0


@dataclass
class _StageIndex:
    """Bitmask per stage: bit k set when link ``stage[k]`` has a holder.

    Stages are interned to small ints so that a lookup never hashes a K-long tuple.
    """

    ids: dict[tuple[int, ...], int] = field(default_factory=dict)
    masks: list[int] = field(default_factory=list)
    by_link: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    pair_sids: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)


class _Sweep:
    """Links held by earlier reservations, as a sweep moves forward in key order."""

    __slots__ = ("active", "held", "retire")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.retire: list[tuple[float, Key]] = []
        self.active: dict[Key, tuple[int, ...]] = {}

    def add(self, key: Key, links: tuple[int, ...], end: float) -> None:
        for lk in links:
            self.held[lk] = self.held.get(lk, 0) + 1
        self.active[key] = links
        heapq.heappush(self.retire, (end, key))

    def retire_until(self, ts: float) -> None:
        """Forget reservations that ended at or before ``ts``."""
        retire = self.retire
        while retire and retire[0][0] <= ts:
            _, k = heapq.heappop(retire)
            for lk in self.active.pop(k):
                self.held[lk] -= 1


class ArkCore:
    """One host's replica of the reservation table plus its local flows."""

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
        limits: CoreLimits | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise CoreError(f"policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
        if not 0 <= host < routes.n_hosts:
            raise CoreError(f"host: must be 0..{routes.n_hosts - 1}; got {host}")
        if retention_s <= 0:
            raise CoreError(f"retention_s: must be > 0; got {retention_s}")
        if expiry_grace_s < 0 or expiry_grace_s >= retention_s:
            raise CoreError(f"expiry_grace_s: must be in [0, retention_s); got {expiry_grace_s}")
        if not 0 <= seq_base < 2**62:
            raise CoreError(f"seq_base: must be 0..2**62-1; got {seq_base}")
        self.host = host
        self.routes = routes
        self._n_hosts = routes.n_hosts
        self.policy = policy
        self.retention_s = retention_s
        self.counters = Counters()
        self._pathmaps = pathmaps
        self._rng = random.Random(seed)  # owned: ECMP fallback ports only
        self._seq = seq_base
        self._seq_base = seq_base
        self._lease = lease
        self.expiry_grace_s = expiry_grace_s
        self.purge_slack_s = retention_s / 10  # forgetting in batches (see next_deadline)
        self._entries: dict[FlowId, _Entry] = {}
        self._keys: list[Key] = []
        self._early_release: dict[FlowId, float] = {}
        self._early_renew: dict[FlowId, Renew] = {}
        self._holders: dict[int, set[FlowId]] = {}
        self._stages = _StageIndex()
        self._stage_cache: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self._own: dict[FlowId, _Own] = {}
        self._buckets: dict[tuple[int, int], PortBuckets] = {}
        # Largest end among entries taken out of the holders index early (released).
        self._max_released = -INF
        self._expired_upto = -INF  # entries ending at or before this hold nothing
        self._end_heap: list[tuple[float, FlowId]] = []  # ends: leaves the live set
        # Ends that are lease expiries (not releases): the entry still holds its links
        # until then, so a tick is due exactly then (the rest can wait, see next_deadline).
        self._expiry_heap: list[tuple[float, FlowId]] = []
        # Entries whose end is after _expired_upto: all a partial recomputation needs
        # to know about the past.
        self._live: set[FlowId] = set()
        # Per owner: XOR of (flow, end) hashes per 100 ms of end time (see state_digest).
        self._digest_buckets: dict[int, dict[int, int]] = {}
        self._digest_of: dict[FlowId, tuple[int, int]] = {}
        self.limits = limits or CoreLimits.unbounded()
        self._per_owner: dict[int, int] = {}  # entries held per owner host
        self._early_per_owner: dict[int, int] = {}
        self._dports: dict[int, None] = {}  # destination ports in use, least recent first
        self._purge_heap: list[tuple[float, FlowId]] = []  # for forgetting
        self._rates: dict[tuple[int, int], float] = {}
        self._horizon = -INF
        # Recomputation is deferred while messages arrive in a batch (see flush()).
        self._pending: Key | None = None
        self._settled: list[Repath] = []  # events of a deferred recomputation, not yet returned
        self._handlers: dict[type, Callable[[Any], list[Repath]]] = {
            Reserve: self._on_reserve, Release: self._on_release, Renew: self._on_renew,
        }

    # ------------------------------------------------------------------ owner API
    def request(
        self, dst: int, nbytes: int, now: float, dport: int = 4791, prefer_port: int | None = None,
        *, reserve: bool = True,
    ) -> Decision:
        """Pick a path and source port for a new flow to ``dst`` and reserve it.

        ``prefer_port``: keep this source port if the path it leads to is free (a
        re-pathed flow then needs no new connection). ``reserve=False``: a random port,
        nothing reserved (plain ECMP; a host whose clock cannot be trusted does this).
        """
        if not 0 <= dst < self._n_hosts or dst == self.host:
            raise CoreError(f"dst: must be another host 0..{self._n_hosts - 1}; got {dst}")
        if nbytes < 0:
            raise CoreError(f"nbytes: must be >= 0; got {nbytes}")
        if not 0 <= dport <= 0xFFFF:
            raise CoreError(f"dport: must be 0..65535; got {dport}")
        self._settle()
        self.counters.requests += 1
        self._seq += 1
        flow = (self.host, self._seq)
        buckets = self._bucket(dst, dport)
        stages = self._stage_list(self.host, dst)
        if not stages:  # intra-leaf: nothing to choose, nothing to reserve
            return self._unreserved(flow, dst, dport, 0, buckets.take(0), fallback=False)
        n = len(stages[0])
        if not reserve:
            port = self._random_port(buckets)
            return self._unreserved(flow, dst, dport, buckets.map.path_of(port), port, fallback=True)
        if self._per_owner.get(self.host, 0) >= self.limits.max_flows_per_host:
            raise CoreError(f"flows: this host holds {self.limits.max_flows_per_host} reservations (the limit)")
        path, pinned = self._free_path(dst, n, buckets, prefer_port)
        shared = False
        if path is None:
            self.counters.fallbacks += 1
            if self.policy == "ark":
                port = self._random_port(buckets)
                return self._unreserved(flow, dst, dport, buckets.map.path_of(port), port, fallback=True)
            self.counters.shared += 1
            # A path no known source port reaches (a probed map after a link failure) is not usable.
            path, shared = self._balance_choice(stages, n, now, buckets.usable_mask), True
        if pinned is not None:
            buckets.claim(pinned)
        port = pinned if pinned is not None else buckets.take(path)
        return self._reserve(flow, dst, dport, path, port, int(nbytes), float(now), shared)

    def _free_path(
        self, dst: int, n: int, buckets: PortBuckets, prefer_port: int | None
    ) -> tuple[int | None, int | None]:
        """(lowest free usable path, the preferred port when its own path is free)."""
        sids = self._stages.pair_sids[(self.host, dst)]
        free_path = self._lowest_free(sids, n, buckets.usable_mask)
        if prefer_port is not None and free_path is not None and prefer_port not in buckets.in_use:
            lo, hi = buckets.map.port_range
            pp = buckets.map.path_of(prefer_port) if lo <= prefer_port <= hi else -1
            if pp >= 0 and self._lowest_free(sids, n, 1 << pp) == pp:  # its path is free
                return pp, prefer_port
        return free_path, None

    def _unreserved(self, flow: FlowId, dst: int, dport: int, path: int, port: int, *, fallback: bool) -> Decision:
        self._own[flow] = _Own(flow, dst, dport, path, port, False)
        return Decision(flow, dst, dport, path, port, flow_label_for_sport(port),
                        reserved=False, shared=False, fallback=fallback, messages=(), events=tuple(self.flush()))

    def _reserve(
        self, flow: FlowId, dst: int, dport: int, path: int, port: int, nbytes: int, now: float, shared: bool
    ) -> Decision:
        rate = self._rates.get((dst, path))
        if rate is None:
            rate = self._rates[(dst, path)] = float(self.routes.path_rate_bps(self.host, dst, path))
        expires = now + self._lease(nbytes, rate) if self._lease else INF
        msg = Reserve(flow, now, self.host, dst, dport, path, port, nbytes, rate, shared, expires)
        self._own[flow] = _Own(flow, dst, dport, path, port, True)
        self.counters.reserved += 1
        # With skewed clocks our own key may lose at once to a peer's smaller key, and a
        # recomputation may move other local flows: report those as events.
        events = tuple(e for e in [*self._insert(msg), *self.flush()] if e.flow != flow)
        own = self._own[flow]
        return Decision(
            flow, dst, dport, own.path, own.port, flow_label_for_sport(own.port),
            reserved=own.reserved, shared=shared, fallback=shared or not own.reserved,
            messages=(msg,), events=events,
        )

    def select_path(self, dst: int) -> int | None:
        """The lowest-index path to ``dst`` whose links are all free (None if none)."""
        self._settle()
        stages = self._stage_list(self.host, dst)
        if not stages:
            return 0
        return self._lowest_free(self._stages.pair_sids[(self.host, dst)], len(stages[0]))

    def _lowest_free(self, sids: tuple[int, ...], n: int, usable: int = -1) -> int | None:
        busy = 0
        masks = self._stages.masks
        for sid in sids:
            busy |= masks[sid]
        free = ~busy & ((1 << n) - 1) & usable
        return (free & -free).bit_length() - 1 if free else None

    def release(self, flow: FlowId, now: float) -> Released:
        """The local flow finished: free its port and broadcast RELEASE if it reserved."""
        own = self._own.pop(flow, None)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._settle()
        buckets = self._bucket(own.dst, own.dport)
        for port in (own.port, *own.stale, *own.extra):
            buckets.give(port)
        entry = self._entries.get(flow)
        msg = Release(flow, float(now))
        if entry is None or entry.released is not None or msg.ts < entry.msg.ts:
            return Released((), tuple(self.flush()))
        self._apply_release(msg)
        return Released((msg,), tuple(self.flush()))

    def unreserve(self, flow: FlowId, now: float) -> Released:
        """Give up a local flow's reservation but keep the flow (and its port) running.

        The flow goes on as plain ECMP; peers learn from the RELEASE that its links are
        free. Used when this host can no longer keep its promises (a skewed clock).
        """
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._settle()
        entry = self._entries.get(flow)
        own.reserved = False
        if entry is None or entry.released is not None:
            return Released((), tuple(self.flush()))
        msg = Release(flow, max(float(now), entry.msg.ts))  # a clock that stepped back cannot undo it
        self._apply_release(msg)
        return Released((msg,), tuple(e for e in self.flush() if e.flow != flow))

    def renew(self, flow: FlowId, now: float) -> tuple[Message, ...]:
        """Extend a local reservation's lease by a full lease from ``now``."""
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._settle()
        entry = self._entries.get(flow)
        if entry is None or self._lease is None or entry.released is not None:
            return ()
        expires = float(now) + self._lease(entry.msg.nbytes, entry.msg.rate_bps)
        if expires <= entry.expires:
            return ()
        msg = Renew(flow, float(now), expires)
        self._apply_renew(entry, msg)
        return (msg,)

    def more_ports(self, flow: FlowId, n: int) -> list[int]:
        """Up to ``n`` more free source ports of a local flow's path, claimed for the flow
        until it is released; fewer (or none) when its bucket has no more free ports."""
        self._settle()  # the flow's path as every deferred message leaves it
        own = self._own.get(flow)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        if n < 0:
            raise CoreError(f"n: must be >= 0; got {n}")
        buckets = self._bucket(own.dst, own.dport)
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
        if not self._valid_reserve(msg):
            self.counters.invalid += 1
            return []
        if self._ended_before(msg, self._horizon):
            self.counters.stale += 1
            return []
        old = self._entries.get(msg.flow)
        if old is not None:
            if old.msg == msg:
                self.counters.duplicates += 1
            else:
                self.counters.invalid += 1
            return []
        if msg.flow[0] == self.host and msg.flow not in self._own and msg.flow[1] > self._seq_base:
            # An echo of a reservation of ours we have already forgotten: ignore.
            # (Lower seqs belong to a predecessor before a restart: kept, so that
            # they can be released.)
            self.counters.stale += 1
            return []
        if self._per_owner.get(msg.flow[0], 0) >= self.limits.max_flows_per_host:
            self.counters.overflow += 1
            return []
        return self._insert(msg)

    def _on_release(self, msg: Release) -> list[Repath]:
        entry = self._entries.get(msg.flow)
        if entry is None:
            if msg.ts < self._horizon:
                self.counters.stale += 1
            elif msg.flow in self._early_release and self._early_release[msg.flow] <= msg.ts:
                self.counters.duplicates += 1
            elif self._early_room(msg.flow, msg.flow not in self._early_release):
                self._early_release[msg.flow] = msg.ts
            return []
        if entry.released is not None and entry.released <= msg.ts:
            # Two RELEASEs for one flow (a predecessor's, after a restart): the
            # earliest wins on every replica, whatever the arrival order.
            self.counters.duplicates += 1
            return []
        if msg.ts < entry.msg.ts:
            self.counters.invalid += 1
            return []
        return self._apply_release(msg)

    def _early_room(self, flow: FlowId, new: bool) -> bool:
        """Count a new early release/renewal of ``flow``'s owner; False when over the cap."""
        if not new:
            return True
        n = self._early_per_owner.get(flow[0], 0)
        if n >= self.limits.max_early_per_host:
            self.counters.overflow += 1
            return False
        self._early_per_owner[flow[0]] = n + 1
        return True

    def _early_gone(self, flow: FlowId) -> None:
        n = self._early_per_owner.get(flow[0], 0) - 1
        if n > 0:
            self._early_per_owner[flow[0]] = n
        else:
            self._early_per_owner.pop(flow[0], None)

    def _on_renew(self, msg: Renew) -> list[Repath]:
        entry = self._entries.get(msg.flow)
        if entry is None:
            if msg.expires < self._horizon:
                self.counters.stale += 1
            else:
                old_r = self._early_renew.get(msg.flow)
                if (old_r is None or old_r.expires < msg.expires) and self._early_room(msg.flow, old_r is None):
                    self._early_renew[msg.flow] = msg
            return []
        if msg.ts < entry.msg.ts or msg.expires < entry.msg.ts:
            self.counters.invalid += 1
            return []
        if msg.expires <= entry.expires:
            self.counters.duplicates += 1
            return []
        # A renewal that arrives after the lease lapsed here still applies: the
        # table is a function of the message set, whatever the arrival times.
        return self._apply_renew(entry, msg)

    def tick(self, now: float) -> list[Repath]:
        """Let time pass: expire leases, forget old reservations.

        Returns changes to local flows whose lease ran out (they no longer hold a path),
        and any a deferred recomputation made.
        """
        self._settle()
        events: list[Repath] = self.flush()
        upto = now - self.expiry_grace_s
        if upto > self._expired_upto:
            self._expired_upto = upto
            heap = self._end_heap
            while heap and heap[0][0] <= upto:
                end, flow = heapq.heappop(heap)
                e = self._entries.get(flow)
                if e is None or e.end != end:
                    continue
                self._live.discard(flow)
                if not e.held:
                    continue
                self._unhold(flow, self._links(e.msg, e.path))  # type: ignore[arg-type]
                if e.released is None:
                    self.counters.expired += 1
                    if flow in self._own:
                        events.extend(self._sync_own(flow, race=False))
            while self._expiry_heap and self._expiry_heap[0][0] <= upto:
                heapq.heappop(self._expiry_heap)  # handled above through the end heap
        horizon = now - self.retention_s
        if horizon > self._horizon:
            self._horizon = horizon
            heap = self._purge_heap
            while heap and heap[0][0] < horizon:
                end, flow = heapq.heappop(heap)
                e = self._entries.get(flow)
                if e is None or e.end != end:
                    continue
                if e.held:  # unreachable: the grace is shorter than the retention
                    self._unhold(flow, self._links(e.msg, e.path))  # type: ignore[arg-type]
                del self._entries[flow]
                n = self._per_owner[flow[0]] - 1
                if n:
                    self._per_owner[flow[0]] = n
                else:
                    del self._per_owner[flow[0]]
                self._live.discard(flow)
                self._digest_set(flow, None)
                i = bisect_left(self._keys, e.msg.key)
                del self._keys[i]
                # Later reservations that started while this one was active keep the
                # assignment it helped decide.
                keys = self._keys
                while i < len(keys) and keys[i][0] < end:
                    self._entries[(keys[i][1], keys[i][2])].frozen = True
                    i += 1
            for d in (self._early_release, self._early_renew):
                for f in [f for f, t in d.items() if (t if isinstance(t, float) else t.ts) < horizon]:
                    del d[f]
                    self._early_gone(f)
        return events

    def next_deadline(self) -> float:
        """The earliest instant at which :meth:`tick` has work (``inf``: none).

        A lease that runs out stops holding links ``expiry_grace_s`` after it; a
        reservation is forgotten once it ended more than ``retention_s`` ago. Forgetting
        only bounds memory, so it waits ``purge_slack_s`` longer and happens in batches.
        Heap tops may be stale (an entry renewed or released since); waking for one costs
        one empty tick, after which the deadline moves on.
        """
        t = INF
        if self._expiry_heap:
            t = deadline_after(self._expiry_heap[0][0], self.expiry_grace_s, strict=False)
        if self._end_heap:
            t = min(t, deadline_after(self._end_heap[0][0], self.expiry_grace_s + self.purge_slack_s, strict=False))
        if self._purge_heap:
            t = min(t, deadline_after(self._purge_heap[0][0], self.retention_s + self.purge_slack_s, strict=True))
        if self._early_release or self._early_renew:
            early = min([*self._early_release.values(), *(r.ts for r in self._early_renew.values())])
            t = min(t, deadline_after(early, self.retention_s + self.purge_slack_s, strict=True))
        return t

    def frozen(self) -> dict[FlowId, tuple[int | None, bool]]:
        """Assignments that can no longer be recomputed here (see ``_Entry.frozen``)."""
        self._settle()
        return {f: (e.path, e.shared) for f, e in self._entries.items() if e.frozen}

    def adopt(self, assignments: dict[FlowId, tuple[int | None, bool]]) -> list[Repath]:
        """Take a peer's frozen assignments (a joiner cannot recompute them itself)."""
        self._settle()
        changed = False
        for f, (path, shared) in assignments.items():
            e = self._entries.get(f)
            if e is None or e.frozen:
                continue
            if path is not None and not 0 <= path < self.routes.n_paths(e.msg.src, e.msg.dst):
                self.counters.invalid += 1
                continue
            e.path, e.shared, e.frozen = path, shared, True
            changed = True
        return self._recompute() if changed else []

    def snapshot(self) -> list[Message]:
        """Every message this replica holds, for a peer that (re)joins.

        The table is a function of the message set, so a replica that applies these
        converges to this one's table.
        """
        self._settle()
        out: list[Message] = []
        for key in self._keys:
            e = self._entries[(key[1], key[2])]
            out.append(e.msg)
            if e.expires > e.msg.expires:
                out.append(Renew(e.msg.flow, max(e.renew_ts, e.msg.ts), e.expires))
            if e.released is not None:
                out.append(Release(e.msg.flow, e.released))
        out.extend(Release(f, t) for f, t in self._early_release.items())
        out.extend(self._early_renew.values())
        return out

    # ------------------------------------------------------------------ views
    def table(self, at: float | None = None) -> dict[FlowId, tuple[int, bool]]:
        """Reservations holding links: flow -> (path, shared).

        ``at=None``: what this replica counts as held now (leases expire after the grace).
        ``at=T``: exactly the reservations that hold links at instant ``T``, a pure function
        of the messages held (for comparing replicas whose clocks differ).
        """
        self._settle()
        if at is None:
            return {f: (e.path, e.shared) for f, e in self._entries.items() if e.held and e.path is not None}
        return {
            f: (e.path, e.shared)
            for f, e in self._entries.items()
            if e.path is not None and e.msg.ts <= at < e.end
        }

    def entries(self) -> dict[FlowId, tuple[Reserve, float | None, int | None, bool]]:
        """Everything the replica knows: flow -> (reserve, released ts, path, shared)."""
        self._settle()
        return {f: (e.msg, e.released, e.path, e.shared) for f, e in self._entries.items()}

    def state_digest(self, since: float, until: float = INF, owner: int | None = None) -> bytes:
        """Digest of what this replica knows about reservations (of ``owner``, or of every
        host) ending in [``since``, ``until``): (flow, end) pairs. Equal message sets give
        equal digests.

        Bounds are rounded down to 100 ms. A window that closes a little in the past
        ignores what is still in flight or still being renewed."""
        # XOR of per-entry hashes kept per 100 ms of end time: order-free and cheap.
        # Python's hash of ints and floats is not salted, so every process computes
        # the same value.
        lo = _bucket_of(since)
        hi = _NO_END_BUCKET + 1 if until == INF else _bucket_of(until)
        owners = self._digest_buckets.values() if owner is None else [self._digest_buckets.get(owner, {})]
        x = 0
        for buckets in owners:
            for b, v in buckets.items():
                if lo <= b < hi:
                    x ^= v
        return (x & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")

    def knows(self, flow: FlowId) -> bool:
        """Does this replica keep anything about ``flow`` (a reservation, an early message)?"""
        return flow in self._entries or flow in self._early_release or flow in self._early_renew

    def end_of(self, flow: FlowId) -> float | None:
        """The end of a known reservation (min of release and lease expiry)."""
        e = self._entries.get(flow)
        return None if e is None else e.end

    def digest(self, at: float | None = None) -> str:
        """Order-independent digest of :meth:`table` (paths, not ports)."""
        h = hashlib.sha256()
        t = self.table(at)
        for f in sorted(t):
            p, s = t[f]
            h.update(f"{f[0]}:{f[1]}:{p}:{int(s)};".encode())
        return h.hexdigest()[:16]

    def link_holders(self) -> dict[int, frozenset[FlowId]]:
        self._settle()
        return {lk: frozenset(s) for lk, s in self._holders.items() if s}

    def exclusive_conflicts(self, at: float | None = None) -> list[int]:
        """Links held by two flows of which one claims them alone (must stay empty).

        ``at``: judge the reservations active at that instant (see :meth:`table`).
        """
        users: dict[int, list[bool]] = {}
        for f, (path, shared) in self.table(at).items():
            for lk in self._links(self._entries[f].msg, path):
                users.setdefault(lk, []).append(shared)
        return sorted(lk for lk, sh in users.items() if len(sh) > 1 and not all(sh))

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

    # ------------------------------------------------------------------ internals
    def _bucket(self, dst: int, dport: int) -> PortBuckets:
        b = self._buckets.get((dst, dport))
        if b is None:
            self._admit_dport(dport)
            b = self._buckets[(dst, dport)] = PortBuckets(self._pathmaps(self.host, dst, dport))
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
            forget = getattr(self._pathmaps, "forget_dport", None)
            if forget is not None:
                forget(idle)
        ports[dport] = None

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

    def _stage_list(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
        stages = self._stage_cache.get((src, dst))
        if stages is not None:
            return stages
        stages = self._stage_cache[(src, dst)] = self.routes.stages(src, dst)
        idx = self._stages
        sids = []
        for st in stages:
            sid = idx.ids.get(st)
            if sid is None:
                sid = idx.ids[st] = len(idx.masks)
                m = 0
                for k, lk in enumerate(st):
                    idx.by_link.setdefault(lk, []).append((sid, k))
                    if self._holders.get(lk):
                        m |= 1 << k
                idx.masks.append(m)
            sids.append(sid)
        idx.pair_sids[(src, dst)] = tuple(sids)
        return stages

    def _valid_reserve(self, msg: Reserve) -> bool:
        n = self._n_hosts
        if not (0 <= msg.src < n and 0 <= msg.dst < n and msg.src != msg.dst):
            return False
        return msg.path < self.routes.n_paths(msg.src, msg.dst)

    def _links(self, msg: Reserve, path: int) -> tuple[int, ...]:
        return tuple(st[path] for st in self._stage_list(msg.src, msg.dst))

    def _hold(self, flow: FlowId, links: Sequence[int]) -> None:
        self._entries[flow].held = True
        for lk in links:
            s = self._holders.get(lk)
            if s is None:
                s = self._holders[lk] = set()
            if not s:
                for sid, k in self._stages.by_link.get(lk, ()):
                    self._stages.masks[sid] |= 1 << k
            s.add(flow)

    def _unhold(self, flow: FlowId, links: Sequence[int]) -> None:
        self._entries[flow].held = False
        for lk in links:
            s = self._holders[lk]
            s.discard(flow)
            if not s:
                for sid, k in self._stages.by_link.get(lk, ()):
                    self._stages.masks[sid] &= ~(1 << k)

    def _assign(self, msg: Reserve, held: Callable[[int], bool]) -> tuple[int | None, bool]:
        """Rule 1-3 of the module docstring, against a view of held links."""
        stages = self._stage_list(msg.src, msg.dst)
        if msg.shared:
            return msg.path, True
        if not any(held(st[msg.path]) for st in stages):
            return msg.path, False
        for k in range(len(stages[0])):
            if not any(held(st[k]) for st in stages):
                return k, False
        if self.policy == "ark-balance":
            return msg.path, True
        return None, False

    def _digest_set(self, flow: FlowId, end: float | None) -> None:
        buckets = self._digest_buckets.get(flow[0])
        if buckets is None:
            buckets = self._digest_buckets[flow[0]] = {}
        old = self._digest_of.pop(flow, None)
        if old is not None:
            b, h = old
            v = buckets[b] ^ h
            if v:
                buckets[b] = v
            else:
                del buckets[b]
        if end is not None:
            b = _bucket_of(end)
            h = hash((flow[0], flow[1], end))
            buckets[b] = buckets.get(b, 0) ^ h
            self._digest_of[flow] = (b, h)

    def _push_end(self, entry: _Entry) -> None:
        end = entry.end
        self._digest_set(entry.msg.flow, end)
        if end > self._expired_upto:
            self._live.add(entry.msg.flow)
        else:
            self._live.discard(entry.msg.flow)
        if end != INF:
            heapq.heappush(self._end_heap, (end, entry.msg.flow))
            heapq.heappush(self._purge_heap, (end, entry.msg.flow))
            if entry.released is None:
                heapq.heappush(self._expiry_heap, (end, entry.msg.flow))

    def _insert(self, msg: Reserve) -> list[Repath]:
        entry = _Entry(msg, expires=msg.expires)
        key = msg.key
        # The fast path is exact when the holders index equals "entries whose end is
        # after msg.ts": no larger key exists and nothing ended early after msg.ts.
        fast = (
            self._pending is None
            and (not self._keys or key > self._keys[-1])
            and msg.ts >= self._max_released
            and msg.ts >= self._expired_upto
        )
        self._entries[msg.flow] = entry
        self._per_owner[msg.flow[0]] = self._per_owner.get(msg.flow[0], 0) + 1
        insort(self._keys, key)
        renew = self._early_renew.pop(msg.flow, None) if self._early_renew else None
        if renew is not None:
            self._early_gone(msg.flow)
        if renew is not None and renew.expires > entry.expires:
            entry.expires, entry.renew_ts = renew.expires, renew.ts
        early = self._early_release.pop(msg.flow, None) if self._early_release else None
        if early is not None:
            self._early_gone(msg.flow)
            entry.released = max(early, msg.ts)
            self._max_released = max(self._max_released, entry.end)
            fast = False
        if entry.end <= self._expired_upto:
            fast = False
        self._push_end(entry)
        if not fast:
            self._defer(key)
            return []
        holders = self._holders
        stages = self._stage_list(msg.src, msg.dst)
        links = [st[msg.path] for st in stages]
        if not msg.shared and not any([holders.get(lk) for lk in links]):
            entry.path = msg.path  # the common case: requested path free
        else:
            entries, ts = self._entries, msg.ts

            def held(lk: int) -> bool:
                hs = holders.get(lk)
                return hs is not None and any(entries[f].end > ts for f in hs)

            entry.path, entry.shared = self._assign(msg, held)
            if entry.path is not None:
                links = [st[entry.path] for st in stages]
        if entry.path is not None:
            self._hold(msg.flow, links)
        if msg.flow[0] != self.host:
            return []
        return self._sync_own(msg.flow)

    def _ended_before(self, msg: Reserve, t: float) -> bool:
        if msg.expires == INF and msg.ts < t:
            return True  # no lease: an unknown reservation that old cannot be judged
        end = msg.expires
        rel = self._early_release.get(msg.flow)
        if rel is not None:
            end = min(end, rel)
        renew = self._early_renew.get(msg.flow)
        if renew is not None and rel is None:
            end = max(end, renew.expires)
        return end < t

    def _later_start_at_or_after(self, entry: _Entry, t: float) -> bool:
        """Is there a reservation with a larger key that started at or after ``t``?"""
        last = self._keys[-1]
        return last != entry.msg.key and last[0] >= t

    def _apply_release(self, msg: Release) -> list[Repath]:
        entry = self._entries[msg.flow]
        old_end = entry.end
        entry.released = msg.ts
        new_end = entry.end
        self._push_end(entry)
        # Invariant of the fast insert path: every released entry is out of the holders
        # index and its end is <= _max_released.
        self._max_released = max(self._max_released, new_end)
        if entry.held:
            self._unhold(msg.flow, self._links(entry.msg, entry.path))  # type: ignore[arg-type]
        if new_end != old_end and self._later_start_at_or_after(entry, new_end):
            # Someone reserved at or after this release instant: their evaluation
            # may change now that this flow is known to be gone by then.
            self._defer((new_end, -1, -1))
        return []

    def _apply_renew(self, entry: _Entry, msg: Renew) -> list[Repath]:
        old_end = entry.end
        entry.expires, entry.renew_ts = msg.expires, msg.ts
        self.counters.renewals += 1
        new_end = entry.end
        if new_end == old_end:  # already released before the old expiry
            return []
        self._push_end(entry)
        if entry.released is not None:
            self._max_released = max(self._max_released, new_end)
        lapsed = old_end <= self._expired_upto and entry.path is not None and not entry.held
        if lapsed:
            # It holds again: only a full recomputation rebuilds the holders index for it.
            self._defer(_EVERYTHING)
        elif self._later_start_at_or_after(entry, old_end):
            self._defer((old_end, -1, -1))
        return []

    def _defer(self, start: Key) -> None:
        self._pending = start if self._pending is None else min(self._pending, start)

    def _settle(self) -> None:
        """Run a deferred recomputation now; keep its events for the next flush()."""
        if self._pending is not None:
            start, self._pending = self._pending, None
            self._settled.extend(self._recompute_from(start))

    def flush(self) -> list[Repath]:
        """Apply what received messages deferred; changes to local flows since the last flush.

        :meth:`receive` defers re-evaluations that a message forces (a key older than the
        newest, a release or renewal that changes the past), so that a batch of messages
        costs one recomputation from the earliest affected key. Every owner operation and
        every view settles first, so nothing observable is stale; a driver calls this
        after each batch (or each message) to learn which local flows moved.
        """
        self._settle()
        out, self._settled = self._settled, []
        return out

    def _recompute(self) -> list[Repath]:
        self.counters.recomputes += 1
        self._evaluate(self._keys, _Sweep())
        # Rebuild the holders index and masks from scratch.
        self._holders = {}
        masks = self._stages.masks
        for i in range(len(masks)):
            masks[i] = 0
        upto = self._expired_upto
        self._live = {f for f, e in self._entries.items() if e.end > upto}
        for f, e in self._entries.items():
            e.held = False
            if e.path is not None and e.released is None and e.end > upto:
                self._hold(f, self._links(e.msg, e.path))
        events: list[Repath] = []
        for f in list(self._own):
            if f in self._entries:
                events.extend(self._sync_own(f))
        return events

    def _evaluate(self, keys: Sequence[Key], sweep: _Sweep) -> list[tuple[_Entry, int | None]]:
        """Rules 1-3 for ``keys`` in order; returns (entry, old path) of those that moved."""
        changed: list[tuple[_Entry, int | None]] = []
        held = sweep.held
        for key in keys:
            e = self._entries[(key[1], key[2])]
            sweep.retire_until(key[0])
            if not e.frozen:
                old = (e.path, e.shared)
                e.path, e.shared = self._assign(e.msg, lambda lk: held.get(lk, 0) > 0)
                if (e.path, e.shared) != old:
                    changed.append((e, old[0]))
            if e.path is not None:
                sweep.add(key, self._links(e.msg, e.path), e.end)
        return changed

    def _recompute_from(self, start: Key) -> list[Repath]:
        """Re-evaluate only the reservations with keys >= ``start``.

        Earlier keys cannot depend on later ones, and the sweep starts from everything
        earlier that is still active at ``start``; so this equals the full recomputation
        while costing (active + suffix) instead of (everything retained).
        """
        if start == _EVERYTHING:
            return self._recompute()
        t0 = start[0]
        keys, entries = self._keys, self._entries
        i = bisect_left(keys, start)
        if i >= len(keys):
            return []
        self.counters.partial_recomputes += 1
        k0 = keys[i]
        sweep = _Sweep()
        # Entries still active at t0: all in _live when t0 is after the expiry horizon,
        # else found by one scan (cheap: no assignment is evaluated for them).
        for f in self._live if t0 >= self._expired_upto else entries:
            e = entries[f]
            if e.path is not None and e.msg.key < k0 and e.end > t0:
                sweep.add(e.msg.key, self._links(e.msg, e.path), e.end)
        changed = self._evaluate(keys[i:], sweep)
        upto = self._expired_upto
        events: list[Repath] = []
        for e, old_path in changed:
            f = e.msg.flow
            if e.held:
                self._unhold(f, self._links(e.msg, old_path))  # type: ignore[arg-type]
            if e.path is not None and e.released is None and e.end > upto:
                self._hold(f, self._links(e.msg, e.path))
            if f in self._own:
                events.extend(self._sync_own(f))
        return events

    def _sync_own(self, flow: FlowId, race: bool = True) -> list[Repath]:
        """Bring a local flow in line with its table entry; report what changed."""
        own = self._own.get(flow)
        entry = self._entries.get(flow)
        if own is None or entry is None:
            return []
        reserved = entry.path is not None and entry.held
        new_path = entry.path if entry.path is not None else own.path
        if new_path == own.path and reserved == own.reserved:
            return []
        old = own.path
        if new_path != own.path:
            buckets = self._bucket(own.dst, own.dport)
            own.stale.append(own.port)
            port = buckets.try_take(new_path)
            if port is not None:
                own.port, own.path = port, new_path
            else:
                # The table's path is one our map has no free port for (a probed map after
                # a link failure: every replica agrees on the table, only we know the map).
                # Our bytes cannot go there: run unreserved on a random known port.
                reserved = False
                try:
                    own.port = self._random_port(buckets)
                    own.path = buckets.map.path_of(own.port)
                except CoreError:  # no port at all: keep the old one rather than fail
                    own.stale.pop()
                    self.counters.fallbacks += 1
        own.reserved = reserved
        if race:
            self.counters.races_lost += 1
        return [Repath(flow, old, own.path, own.port, flow_label_for_sport(own.port), reserved)]

    def _balance_choice(self, stages: tuple[tuple[int, ...], ...], n: int, now: float, usable: int = -1) -> int:
        best, best_cost = 0, float("inf")
        for k in range(n):
            if not usable >> k & 1:
                continue
            cost = max(self._link_backlog(st[k], now) for st in stages)
            if cost < best_cost:
                best, best_cost = k, cost
        return best

    def _link_backlog(self, link: int, now: float) -> float:
        """Reserved bytes still to send on ``link`` at ``now``.

        The link is modelled as a work-conserving queue fed by its live reservations
        (each adds ``nbytes`` at its ``ts``) and drained at the reservations' path rate:
        sharing between flows does not change how fast the link empties, so this needs
        no per-flow rate guess.
        """
        holders = self._holders.get(link)
        if not holders:
            return 0.0
        msgs = sorted((self._entries[f].msg for f in holders), key=lambda m: m.key)
        backlog, t_prev = 0.0, msgs[0].ts
        for m in msgs:
            rate = m.rate_bps / 8.0
            backlog = max(0.0, backlog - rate * (m.ts - t_prev)) + m.nbytes
            t_prev = m.ts
        return max(0.0, backlog - msgs[-1].rate_bps / 8.0 * (now - t_prev))
