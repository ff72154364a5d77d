"""The replicated reservation table: what every replica agrees on, and nothing else.

A :class:`ReservationTable` holds RESERVE, RENEW and RELEASE messages and the assignment
of paths they imply (the rules are in :mod:`ark.core.protocol`). It knows no host: the
local flows, their ports and the decisions they get live in
:class:`ark.core.protocol.ArkCore`, which drives one table per host in an agent. Table
operations return the flows whose assignment may have changed, so that whoever owns those
flows can bring them in line; several cores can therefore share one table when their
message sets are equal (the simulator's hosts, see :class:`ArkCore` ``table=``).

One input is the replica's own: how far behind its clock it measured each owner's clock
(:meth:`ReservationTable.set_clock`, zero while the owner is within the clock bound). A
reservation of owner Y, compared with a later one of owner X, holds until its stated end
plus how far Y's clock runs behind X's (by this replica's measurements of both): the two
owners' times then compare as their true instants do, so a skewed owner's flows end no
earlier than they really do, and the skewed owner, measuring the others itself, judges
the same pairs alike. Digests compare the stated ends, so replicas that measured a clock a
little differently still agree on the message set.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ark.core.messages import FlowId, Key, Message, Release, Renew, Reserve

POLICIES = ("ark", "ark-balance", "ark-split")
# Policies under which a reservation that finds no free path shares its requested one.
SHARING_POLICIES = ("ark-balance", "ark-split")
INF = float("inf")
_NO_END_BUCKET = 2**62
_BUCKETS_PER_S = 10
_EVERYTHING: Key = (-INF, -1, -1)  # a deferred full recomputation

# What a table operation may have changed: these flows, or (None) every flow.
Changed = list[FlowId] | None
EVERY_FLOW: Changed = None


class Routes(Protocol):
    """What the core needs of a topology (``ark.core.topology.Fabric`` provides it)."""

    def stages(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]: ...

    def n_paths(self, src: int, dst: int) -> int: ...

    def path_rate_bps(self, src: int, dst: int, path: int) -> float: ...

    @property
    def n_hosts(self) -> int: ...


class CoreError(ValueError):
    """A local API misuse (unknown host, unknown flow, bad argument)."""


def _bucket_of(t: float) -> int:
    """The 100 ms digest bucket of a time; clamped, so no finite or infinite time overflows."""
    v = t * _BUCKETS_PER_S
    if v != v:
        raise CoreError("time: NaN")
    if v >= _NO_END_BUCKET:
        return _NO_END_BUCKET
    return -_NO_END_BUCKET if v <= -_NO_END_BUCKET else math.floor(v)


# Retained reservations per owner a replica keeps for each live one the owner may hold,
# when CoreLimits.max_retained_per_host is not given (see CoreLimits).
RETAINED_PER_LIVE = 4


@dataclass(frozen=True)
class CoreLimits:
    """Bounds on what other hosts and local clients can make a replica keep.

    ``max_flows_per_host``: live (not yet released) reservations of this host: beyond it
    the host's own requests get plain ECMP. Peers do not count live reservations: whether
    a RELEASE has arrived yet depends on delivery order, and a rule that does would make
    replicas disagree about which RESERVE was admitted. ``max_retained_per_host`` (0:
    ``RETAINED_PER_LIVE`` x ``max_flows_per_host``): reservations of one owner a replica
    retains, live or ended until forgotten: the memory bound, a RESERVE beyond it is
    dropped and counted; the owner stops reserving ``max_flows_per_host`` short of it, so
    that a peer forgetting later than the owner still has room (see
    :meth:`owner_retained`). ``max_early_per_host``: releases and renewals of one owner's
    still unknown flows kept for later; ``max_dports``: destination ports with path maps
    and port buckets at once (the least recently used idle one is dropped).
    """

    max_flows_per_host: int = 4096
    max_early_per_host: int = 1024
    max_dports: int = 8
    max_retained_per_host: int = 0

    def __post_init__(self) -> None:
        if self.max_retained_per_host and self.max_retained_per_host < 2 * self.max_flows_per_host:
            raise CoreError(f"max_retained_per_host: must be 0 or >= 2 x max_flows_per_host "
                            f"({2 * self.max_flows_per_host}); got {self.max_retained_per_host}")

    @property
    def retained_per_host(self) -> int:
        """Reservations of one owner a replica retains (live or ended, until forgotten)."""
        return self.max_retained_per_host or RETAINED_PER_LIVE * self.max_flows_per_host

    @property
    def owner_retained(self) -> int:
        """Retained reservations of its own at which a host stops reserving: a margin of
        ``max_flows_per_host`` ends below what peers keep, for peers that forget later."""
        return self.retained_per_host - self.max_flows_per_host

    @classmethod
    def unbounded(cls) -> CoreLimits:
        """For a replica that only trusted code feeds (the simulator, benchmarks)."""
        return cls(2**62, 2**62, 2**16)


def deadline_after(t: float, offset: float, *, strict: bool) -> float:
    """The first float ``d`` with ``d - offset >= t`` (``> t`` when ``strict``).

    ``t + offset`` alone can round so that a tick at it still finds nothing due, and a
    caller that sleeps until the deadline would wake forever.
    """
    d = t + offset
    while d - offset < t or (strict and d - offset == t):
        d = math.nextafter(d, INF)
    return d


@dataclass(slots=True)
class Entry:
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
    # How much longer than its stated end the reservation holds links for this replica's
    # own requests (its owner's clock runs that far behind ours), and the most it holds
    # against any owner's (ReservationTable.set_clock): both 0 unless a clock is off.
    late: float = 0.0
    late_any: float = 0.0

    @property
    def end(self) -> float:
        """When the reservation stops holding links here: its stated end, plus ``late``."""
        r = self.released
        return (self.expires if r is None or r > self.expires else r) + self.late

    @property
    def sweep_end(self) -> float:
        """The latest it holds against any owner's reservation: stated end plus ``late_any``."""
        r = self.released
        return (self.expires if r is None or r > self.expires else r) + self.late_any

    @property
    def stated_end(self) -> float:
        """The end its owner's messages state (min of release and lease expiry)."""
        r = self.released
        return self.expires if r is None or r > self.expires else r


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
    capped: int = 0  # own requests given plain ECMP: this host at a cap of its own (CoreLimits)
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
    stages: list[tuple[int, ...]] = field(default_factory=list)  # by stage id
    by_sids: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    # Per tuple of stage ids: each path's links (shared by every pair with those stages).
    path_links: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = field(default_factory=dict)


class _Sweep:
    """Links held by earlier reservations, as a sweep moves forward in key order.

    A reservation whose owner's clock runs behind another's (``Entry.late_any``) holds until
    its ``sweep_end`` (the latest it may hold for anyone), but for a later reservation of owner
    X only until its stated end plus how far its owner runs behind X (``lag``): its own
    owner's reservations follow one another as on the owner (``grace``: those in between)."""

    __slots__ = ("active", "grace", "held", "lag", "retire")

    def __init__(self, lag: Callable[[int, int], float] | None = None) -> None:
        self.held: dict[int, int] = {}
        self.retire: list[tuple[float, Key]] = []
        self.active: dict[Key, tuple[int, ...]] = {}
        self.grace: dict[Key, float] = {}  # key -> the end its owner stated, when earlier
        self.lag = lag

    def add(self, key: Key, links: tuple[int, ...], entry: Entry) -> None:
        for lk in links:
            self.held[lk] = self.held.get(lk, 0) + 1
        self.active[key] = links
        heapq.heappush(self.retire, (entry.sweep_end, key))
        if entry.late_any:
            self.grace[key] = entry.stated_end

    def retire_until(self, ts: float) -> None:
        """Forget reservations that ended at or before ``ts``."""
        retire = self.retire
        while retire and retire[0][0] <= ts:
            _, k = heapq.heappop(retire)
            for lk in self.active.pop(k):
                self.held[lk] -= 1
            if self.grace:
                self.grace.pop(k, None)

    def held_for(self, key: Key) -> Callable[[int], bool]:
        """Is a link held at ``key``'s instant, for the reservation with that key?"""
        held = self.held
        if not self.grace or self.lag is None:
            return lambda lk: held.get(lk, 0) > 0
        own: dict[int, int] = {}
        for k, stated in self.grace.items():
            if stated + self.lag(k[1], key[1]) <= key[0]:
                for lk in self.active[k]:
                    own[lk] = own.get(lk, 0) + 1
        return lambda lk: held.get(lk, 0) - own.get(lk, 0) > 0


def _check_table_args(policy: str, retention_s: float, expiry_grace_s: float) -> None:
    if policy not in POLICIES:
        raise CoreError(f"policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
    if retention_s <= 0:
        raise CoreError(f"retention_s: must be > 0; got {retention_s}")
    if expiry_grace_s < 0 or expiry_grace_s >= retention_s:
        raise CoreError(f"expiry_grace_s: must be in [0, retention_s); got {expiry_grace_s}")


class ReservationTable:
    """One replica's reservations and the paths they hold (see the module docstring)."""

    def __init__(
        self,
        routes: Routes,
        *,
        policy: str = "ark",
        retention_s: float = 5.0,
        expiry_grace_s: float = 0.25,
        counters: Counters | None = None,
        limits: CoreLimits | None = None,
        bookkeeping_grid: bool = False,
        backlog_index: bool = False,
    ) -> None:
        _check_table_args(policy, retention_s, expiry_grace_s)
        self.routes = routes
        self.n_hosts = routes.n_hosts
        self.policy = policy
        self.retention_s = retention_s
        self.expiry_grace_s = expiry_grace_s
        self.purge_slack_s = retention_s / 10  # forgetting in batches (see next_deadline)
        # Bookkeeping deadlines on a grid of purge_slack_s (see next_deadline): what an agent
        # wants (one wakeup for many ends); a simulator keeps one deadline per end.
        self.bookkeeping_grid = bookkeeping_grid
        self.counters = counters if counters is not None else Counters()
        self._entries: dict[FlowId, Entry] = {}
        self._keys: list[Key] = []
        self._early_release: dict[FlowId, float] = {}
        self._early_renew: dict[FlowId, Renew] = {}
        self._early_heap: list[tuple[float, FlowId]] = []  # (ts, flow) of kept early messages
        self._holders: dict[int, set[FlowId]] = {}
        # Per link: its holders' backlog fold (last key, bytes left, its ts, its rate), kept
        # as holders arrive in key order; dropped when one leaves or comes out of order. With
        # backlog_index (an arbiter's), a link that lost one (_churned) keeps a tree of the
        # fold's steps instead (_LinkBacklog: O(log n) a holder; equal up to rounding).
        self._backlog: dict[int, tuple[Key, float, float, float]] = {}
        self._trees: dict[int, _LinkBacklog] | None = {} if backlog_index else None
        self._churned: set[int] = set()
        self._stages = _StageIndex()
        self._stage_cache: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        # Per host pair, per path: the links the path holds (what links() answers).
        self._path_links: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
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
        # Flows whose end changed since the digest was last brought up to date: folded in
        # when a digest is asked for (a HELLO), not on every message.
        self._digest_dirty: set[FlowId] = set()
        self.limits = limits or CoreLimits.unbounded()
        self._retained_cap = self.limits.retained_per_host  # read for every RESERVE received
        self._per_owner: dict[int, int] = {}  # entries retained per owner host
        self._early_per_owner: dict[int, int] = {}
        self._purge_heap: list[tuple[float, FlowId]] = []  # for forgetting
        self._horizon = -INF
        # Recomputation is deferred while messages arrive in a batch (see settle()); what a
        # settled recomputation changed waits for take_changed().
        self._deferred: Key | None = None
        # True while a recomputation is deferred or its changes wait for take_changed().
        self.dirty = False
        self._changed: list[FlowId] = []
        self._changed_all = False
        self._handlers: dict[type, Callable[[Any], Changed]] = {
            Reserve: self._receive_reserve, Release: self.on_release, Renew: self.on_renew,
        }
        # Per owner host: how far behind this replica's its clock runs (set_clock; < 0:
        # ahead), and the margin added to a positive difference between two of them.
        self._behind: dict[int, float] = {}
        self._clock_margin = 0.0

    # ------------------------------------------------------------------ lookups
    def get(self, flow: FlowId) -> Entry | None:
        return self._entries.get(flow)

    def __contains__(self, flow: object) -> bool:
        return flow in self._entries

    def holders(self, link: int) -> set[FlowId]:
        """Flows whose reservation holds ``link`` now (do not modify)."""
        return self._holders.get(link) or set()

    def pair_sids(self, src: int, dst: int) -> tuple[int, ...]:
        """The stage ids of ``src`` -> ``dst`` (what :meth:`lowest_free` reads)."""
        sids = self._stages.pair_sids.get((src, dst))
        if sids is None:
            self.stage_list(src, dst)
            sids = self._stages.pair_sids[(src, dst)]
        return sids

    def lowest_free(self, sids: tuple[int, ...], n: int, usable: int = -1) -> int | None:
        """The lowest path whose links at every stage ``sids`` are free (and ``usable``)."""
        busy = 0
        masks = self._stages.masks
        for sid in sids:
            busy |= masks[sid]
        free = ~busy & ((1 << n) - 1) & usable
        return (free & -free).bit_length() - 1 if free else None

    # ------------------------------------------------------------------ owners' clocks
    def set_clock(self, owner: int, behind: float, margin: float = 0.0) -> None:
        """``owner``'s clock runs ``behind`` seconds behind this replica's (negative: ahead),
        as this replica measured it; 0 while it is within the clock bound. A reservation of
        Y compared with a later one of X then holds until its stated end plus
        :meth:`lag` (Y, X). A change recomputes the table (it is rare: the caller rounds)."""
        if not (math.isfinite(behind) and math.isfinite(margin) and margin >= 0.0):
            raise ValueError(f"behind: expected finite numbers; got {behind!r} (margin {margin!r})")
        if behind == self._behind.get(owner, 0.0) and (margin == self._clock_margin or not self._behind):
            return
        if behind:
            self._behind[owner] = behind
        else:
            self._behind.pop(owner, None)
        self._clock_margin = margin
        for e in self._entries.values():
            owner = e.msg.flow[0]
            late, late_any = self.lag(owner, -1), self._late_of(owner)
            if (late, late_any) != (e.late, e.late_any):
                e.late, e.late_any = late, late_any
                self._push_end(e)
        if self._entries:
            self._defer(_EVERYTHING)  # any pair's lag may have changed

    def behind(self, owner: int) -> float:
        """What :meth:`set_clock` last set for ``owner`` (0: within the bound)."""
        return self._behind.get(owner, 0.0)

    def lag(self, y: int, x: int) -> float:
        """How much longer than its stated end a reservation of owner ``y`` holds against a
        later one of owner ``x``: how far ``y``'s clock runs behind ``x``'s, plus the margin
        (0 when it does not run behind; this replica's own clock, and ``x = -1``, count as
        0: ``lag(y, -1)`` is how long it holds for this replica's own requests)."""
        b = self._behind
        d = b.get(y, 0.0) - b.get(x, 0.0)
        return d + self._clock_margin if d > 0 else 0.0

    def _late_of(self, owner: int) -> float:
        """The most ``lag(owner, x)`` can be, over every owner x (this replica included)."""
        b = self._behind
        if not b:
            return 0.0
        d = b.get(owner, 0.0) - min(0.0, min(b.values()))
        return d + self._clock_margin if d > 0 else 0.0

    # ------------------------------------------------------------------ messages
    def receive(self, msg: Message) -> Changed:
        """Apply one message (validated like a replica does); returns what may have changed."""
        self.counters.received += 1
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counters.invalid += 1
            return []
        return handler(msg)

    def _receive_reserve(self, msg: Reserve) -> Changed:
        return self.insert(msg) if self.admissible(msg) and self.has_room(msg) else []

    def has_room(self, msg: Reserve) -> bool:
        """Is its owner under its share of the table (:class:`CoreLimits`
        ``retained_per_host``)? Counted if not."""
        if self._per_owner.get(msg.flow[0], 0) >= self._retained_cap:
            self.counters.overflow += 1
            return False
        return True

    def owner_count(self, host: int) -> int:
        """Reservations of ``host`` this replica retains (live or ended, until forgotten)."""
        return self._per_owner.get(host, 0)

    def early_messages(self) -> int:
        """Releases and renewals kept for flows whose reservation has not arrived yet."""
        return len(self._early_release) + len(self._early_renew)

    def knows(self, flow: FlowId) -> bool:
        """Does this replica keep anything about ``flow`` (a reservation, an early message)?"""
        return flow in self._entries or flow in self._early_release or flow in self._early_renew

    def admissible(self, msg: Reserve) -> bool:
        """A valid RESERVE, not stale, not known yet (else counted and refused)."""
        if not self._valid_reserve(msg):
            self.counters.invalid += 1
            return False
        if self._ended_before(msg, self._horizon):
            self.counters.stale += 1
            return False
        old = self._entries.get(msg.flow)
        if old is not None:
            if old.msg == msg:
                self.counters.duplicates += 1
            else:
                self.counters.invalid += 1
            return False
        return True

    def on_release(self, msg: Release) -> Changed:
        entry = self._entries.get(msg.flow)
        if entry is None:
            if msg.ts < self._horizon:
                self.counters.stale += 1
            elif msg.flow in self._early_release and self._early_release[msg.flow] <= msg.ts:
                self.counters.duplicates += 1
            elif self._early_room(msg.flow, msg.flow not in self._early_release):
                self._early_release[msg.flow] = msg.ts
                self._early_pushed(msg.ts, msg.flow)
            return []
        if entry.released is not None and entry.released <= msg.ts:
            # Two RELEASEs for one flow (a predecessor's, after a restart): the
            # earliest wins on every replica, whatever the arrival order.
            self.counters.duplicates += 1
            return []
        if msg.ts < entry.msg.ts:
            self.counters.invalid += 1
            return []
        return self.apply_release(msg)

    def on_renew(self, msg: Renew) -> Changed:
        entry = self._entries.get(msg.flow)
        if entry is None:
            if msg.expires < self._horizon:
                self.counters.stale += 1
            else:
                old_r = self._early_renew.get(msg.flow)
                if (old_r is None or old_r.expires < msg.expires) and self._early_room(msg.flow, old_r is None):
                    self._early_renew[msg.flow] = msg
                    self._early_pushed(msg.ts, msg.flow)
            return []
        if msg.ts < entry.msg.ts or msg.expires < entry.msg.ts:
            self.counters.invalid += 1
            return []
        if msg.expires <= entry.expires:
            self.counters.duplicates += 1
            return []
        # A renewal that arrives after the lease lapsed here still applies: the
        # table is a function of the message set, whatever the arrival times.
        return self.apply_renew(entry, msg)

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

    def _early_pushed(self, ts: float, flow: FlowId) -> None:
        """Index a kept early message for forgetting (by its ``ts``); entries left behind by
        messages since consumed or replaced are skipped, and compacted when they pile up."""
        heap = self._early_heap
        heapq.heappush(heap, (ts, flow))
        if len(heap) > 1024 + 2 * (len(self._early_release) + len(self._early_renew)):
            live = [(t, f) for f, t in self._early_release.items()]
            live += [(r.ts, f) for f, r in self._early_renew.items()]
            heapq.heapify(live)
            self._early_heap = live

    def _early_ts(self, flow: FlowId) -> float:
        """The earliest ``ts`` of the early messages kept for ``flow`` (inf: none)."""
        t = self._early_release.get(flow, INF)
        r = self._early_renew.get(flow)
        return t if r is None or r.ts > t else r.ts

    def _early_gone(self, flow: FlowId) -> None:
        n = self._early_per_owner.get(flow[0], 0) - 1
        if n > 0:
            self._early_per_owner[flow[0]] = n
        else:
            self._early_per_owner.pop(flow[0], None)

    def insert(self, msg: Reserve, pinned: bool = False) -> Changed:
        """Add an admissible RESERVE; the changed flows include ``msg.flow`` itself.
        ``pinned``: it holds ``msg.path`` (shared as ``msg.shared``) whatever else this
        table holds, and no recomputation moves it (someone else decided it: an arbiter)."""
        entry = Entry(msg, None, None, False, msg.expires)  # positional: the hottest constructor
        if self._behind:
            entry.late, entry.late_any = self.lag(msg.flow[0], -1), self._late_of(msg.flow[0])
        if pinned:
            entry.path, entry.shared, entry.frozen = msg.path, msg.shared, True
        key = msg.key
        # The fast path is exact when the holders index equals "entries whose end is
        # after msg.ts": no larger key exists and nothing ended early after msg.ts.
        fast = (
            self._deferred is None
            and not self._behind  # pairs of owners then compare their own way (_Sweep)
            and (not self._keys or key > self._keys[-1])
            and msg.ts >= self._max_released
            and msg.ts >= self._expired_upto
        )
        self._entries[msg.flow] = entry
        self._per_owner[msg.flow[0]] = self._per_owner.get(msg.flow[0], 0) + 1
        if fast or (self._keys and key > self._keys[-1]):
            self._keys.append(key)
        else:
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
        if pinned:
            if entry.released is None and entry.end > self._expired_upto:
                self._hold(msg.flow, self.links(msg, msg.path))
            if not fast:
                self._defer(key)  # later keys may now be decided otherwise
            return [msg.flow]
        if not fast:
            self._defer(key)  # settle() evaluates it, with whatever else arrives in the batch
            return []
        holders = self._holders
        links = self.links(msg, msg.path)
        free = not msg.shared
        for lk in links:  # a plain loop: this is every reservation's path
            if free and holders.get(lk):
                free = False
        if free:
            entry.path = msg.path  # the common case: requested path free
        else:
            entries, ts = self._entries, msg.ts

            def held(lk: int) -> bool:
                hs = holders.get(lk)
                return hs is not None and any(entries[f].end > ts for f in hs)

            entry.path, entry.shared = self.assign(msg, held)
            if entry.path is not None:
                links = self.links(msg, entry.path)
        if entry.path is not None:
            self._hold(msg.flow, links, entry)
        return [msg.flow]

    def apply_release(self, msg: Release) -> Changed:
        entry = self._entries[msg.flow]
        old_end, old_stated = entry.end, entry.stated_end
        entry.released = msg.ts
        new_end = entry.end
        self._push_end(entry)
        # Invariant of the fast insert path: every released entry is out of the holders
        # index and its end is <= _max_released. (A RELEASE that arrived proves the flow
        # over, whatever its owner's clock: for our own requests it is gone at once.)
        self._max_released = max(self._max_released, new_end)
        if entry.held:
            self._unhold(msg.flow, self.links(entry.msg, entry.path))  # type: ignore[arg-type]
        # With clocks judged off, later reservations compare with the stated end first.
        since = min(new_end, entry.stated_end) if entry.late_any else new_end
        if (new_end != old_end or entry.stated_end != old_stated) and self._later_start_at_or_after(entry, since):
            # Someone reserved at or after this release instant: their evaluation
            # may change now that this flow is known to be gone by then.
            self._defer((since, -1, -1))
        return []

    def apply_renew(self, entry: Entry, msg: Renew) -> Changed:
        old_end, old_stated = entry.end, entry.stated_end
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
        else:
            since = min(old_end, old_stated) if entry.late_any else old_end
            if self._later_start_at_or_after(entry, since):
                self._defer((since, -1, -1))
        return []

    def _defer(self, start: Key) -> None:
        self._deferred = start if self._deferred is None else min(self._deferred, start)
        self.dirty = True

    def settle(self) -> None:
        """Run a deferred recomputation now (its changes wait for :meth:`take_changed`).

        Messages that force a re-evaluation (a key older than the newest, a release or
        renewal that changes the past) defer it, so that a batch of messages costs one
        recomputation from the earliest affected key. Every view settles first, so
        nothing observable is stale.
        """
        if self._deferred is None:
            return
        start, self._deferred = self._deferred, None
        changed = self._recompute_from(start)
        if changed is None:
            self._changed_all = True
        else:
            self._changed.extend(changed)

    def take_changed(self) -> Changed:
        """Settle, then the flows whose assignment changed since the last call (None: all)."""
        if not self.dirty:
            return []  # the common case: nothing pending, nothing to report
        self.settle()
        self.dirty = False
        if self._changed_all:
            self._changed_all, self._changed = False, []
            return EVERY_FLOW
        out, self._changed = self._changed, []
        return out

    def recompute(self) -> Changed:
        """Evaluate every reservation again and rebuild the holders index."""
        self.counters.recomputes += 1
        self._evaluate(self._keys, self._sweep())
        # Rebuild the holders index and masks from scratch.
        self._holders = {}
        self._backlog = {}
        if self._trees is not None:
            self._trees, self._churned = {}, set()
        masks = self._stages.masks
        for i in range(len(masks)):
            masks[i] = 0
        upto = self._expired_upto
        self._live = {f for f, e in self._entries.items() if e.end > upto}
        for f, e in self._entries.items():
            e.held = False
            if e.path is not None and e.released is None and e.end > upto:
                self._hold(f, self.links(e.msg, e.path))
        return EVERY_FLOW

    def _recompute_from(self, start: Key) -> Changed:
        """Re-evaluate only the reservations with keys >= ``start``.

        Earlier keys cannot depend on later ones, and everything earlier that is still
        active at ``start`` is in ``_live``; so this equals the full recomputation while
        costing (active + suffix) instead of (everything retained).
        """
        if start == _EVERYTHING:
            return self.recompute()
        t0 = start[0]
        keys, entries = self._keys, self._entries
        i = bisect_left(keys, start)
        if i >= len(keys):
            return []
        self.counters.partial_recomputes += 1
        k0 = keys[i]
        sweep = self._sweep()
        # Entries still active at t0: all in _live when t0 is after the expiry horizon,
        # else found by one scan (cheap: no assignment is evaluated for them).
        # (With an owner's clock judged off, one may hold past its end here against others.)
        for f in self._live if t0 >= self._expired_upto and not self._behind else entries:
            e = entries[f]
            if e.path is not None and e.msg.key < k0 and e.sweep_end > t0:
                sweep.add(e.msg.key, self.links(e.msg, e.path), e)
        changed = self._evaluate(keys[i:], sweep)
        upto = self._expired_upto
        out: list[FlowId] = []
        for e, old_path in changed:
            f = e.msg.flow
            if e.held:
                self._unhold(f, self.links(e.msg, old_path))  # type: ignore[arg-type]
            if e.path is not None and e.released is None and e.end > upto:
                self._hold(f, self.links(e.msg, e.path))
            out.append(f)
        return out

    def tick(self, now: float) -> list[FlowId]:
        """Let time pass: expire leases, forget old reservations.

        Returns the flows whose lease ran out (they no longer hold a path).
        """
        self.settle()
        expired: list[FlowId] = []
        # An end may arrive at or before the point already passed (a RELEASE delayed by more
        # than the grace): it is due at once, or its deadline would never move on.
        self._expired_upto = upto = max(self._expired_upto, now - self.expiry_grace_s)
        heap = self._end_heap
        while heap and heap[0][0] <= upto:
            end, flow = heapq.heappop(heap)
            e = self._entries.get(flow)
            if e is None or e.end != end:
                continue
            self._live.discard(flow)
            if not e.held:
                continue
            self._unhold(flow, self.links(e.msg, e.path))  # type: ignore[arg-type]
            if e.released is None:
                self.counters.expired += 1
                expired.append(flow)
        while self._expiry_heap and self._expiry_heap[0][0] <= upto:
            heapq.heappop(self._expiry_heap)  # handled above through the end heap
        self.forget_ended(now)
        return expired

    def forget_ended(self, now: float) -> None:
        """Forget now what ended more than ``retention_s`` ago (what :meth:`tick` forgets):
        an entry past that waits only for the bookkeeping grid, and nobody needs it."""
        horizon = now - self.retention_s
        if horizon > self._horizon:
            self._horizon = horizon
            self._forget(horizon)

    def _forget(self, horizon: float) -> None:
        heap = self._purge_heap
        while heap and heap[0][0] < horizon:
            end, flow = heapq.heappop(heap)
            e = self._entries.get(flow)
            if e is None or e.end != end:
                continue
            if e.held:  # unreachable: the grace is shorter than the retention
                self._unhold(flow, self.links(e.msg, e.path))  # type: ignore[arg-type]
            del self._entries[flow]
            n = self._per_owner[flow[0]] - 1
            if n:
                self._per_owner[flow[0]] = n
            else:
                del self._per_owner[flow[0]]
            self._live.discard(flow)
            self._digest_dirty.add(flow)
            i = bisect_left(self._keys, e.msg.key)
            del self._keys[i]
            # Later reservations that started while this one was active (for their owner:
            # see lag) keep the assignment it helped decide.
            keys = self._keys
            if not e.late_any:
                while i < len(keys) and keys[i][0] < end:
                    self._entries[(keys[i][1], keys[i][2])].frozen = True
                    i += 1
                continue
            stated, owner = e.stated_end, flow[0]
            while i < len(keys) and keys[i][0] < e.sweep_end:
                if keys[i][0] < stated + self.lag(owner, keys[i][1]):
                    self._entries[(keys[i][1], keys[i][2])].frozen = True
                i += 1
        heap = self._early_heap
        while heap and heap[0][0] < horizon:
            _, f = heapq.heappop(heap)
            if self._early_release.get(f, INF) < horizon:
                del self._early_release[f]
                self._early_gone(f)
            r = self._early_renew.get(f)
            if r is not None and r.ts < horizon:
                del self._early_renew[f]
                self._early_gone(f)

    def adopt(self, assignments: dict[FlowId, tuple[int | None, bool] | None]) -> Changed:
        """Set assignments that cannot be recomputed here (a joiner's, decided by
        :class:`ark.core.node.Node` from its peers' snapshots): ``(path, shared)`` is taken
        and frozen; ``None`` thaws the entry, so that it is recomputed from what this replica
        holds (a value taken before lost its backing). Which entries may be set, and from whose
        word, is the caller's judgement: the table only checks that the path exists."""
        self.settle()
        changed = False
        for f, value in assignments.items():
            e = self._entries.get(f)
            if e is None:
                continue
            if value is None:
                changed |= e.frozen
                e.frozen = False
                continue
            path, shared = value
            if path is not None and not 0 <= path < self.routes.n_paths(e.msg.src, e.msg.dst):
                self.counters.invalid += 1
                continue
            if not e.frozen or (e.path, e.shared) != (path, shared):
                e.path, e.shared, e.frozen = path, shared, True
                changed = True
        return self.recompute() if changed else []

    def assignment(self, flow: FlowId) -> tuple[float, bool, int | None, bool] | None:
        """``(ts, frozen, path, shared)`` of a reservation this replica holds, else None."""
        e = self._entries.get(flow)
        return None if e is None else (e.msg.ts, e.frozen, e.path, e.shared)

    def next_deadline(self) -> float:
        """The earliest instant at which :meth:`tick` has work (``inf``: none).

        A lease that runs out stops holding links ``expiry_grace_s`` after it, exactly then.
        What is left is bookkeeping (an ended reservation leaves the live set, one that ended
        ``retention_s`` ago is forgotten) and only bounds memory: it waits ``purge_slack_s``
        longer, and with ``bookkeeping_grid`` until the next multiple of ``purge_slack_s``, so
        that one wakeup serves every end in between instead of one wakeup per flow. Heap
        entries that a renewal, a release or forgetting left behind are dropped here rather
        than woken for.
        """
        t = INF
        heap, entries = self._expiry_heap, self._entries
        while heap:
            end, f = heap[0]
            e = entries.get(f)
            if e is not None and e.released is None and e.end == end:
                t = deadline_after(end, self.expiry_grace_s, strict=False)
                break
            heapq.heappop(heap)  # renewed, released or forgotten since: nothing expires then
        slack = self.purge_slack_s
        grid = self._on_grid if self.bookkeeping_grid else float
        if self._end_heap:
            t = min(t, grid(deadline_after(self._end_heap[0][0], self.expiry_grace_s + slack, strict=False)))
        if self._purge_heap:
            t = min(t, grid(deadline_after(self._purge_heap[0][0], self.retention_s + slack, strict=True)))
        heap = self._early_heap
        while heap and self._early_ts(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # a message consumed or replaced since: nothing to forget then
        if heap:
            t = min(t, grid(deadline_after(heap[0][0], self.retention_s + slack, strict=True)))
        return t

    def _on_grid(self, t: float) -> float:
        """The first multiple of ``purge_slack_s`` at or after ``t``."""
        if not t < 1e15:  # far beyond any clock: as it is (and no overflow)
            return t
        q = math.ceil(t / self.purge_slack_s) * self.purge_slack_s
        return q if q >= t else math.nextafter(q, INF)

    def frozen(self) -> dict[FlowId, tuple[int | None, bool]]:
        """Assignments that can no longer be recomputed here (see :class:`Entry` ``frozen``)."""
        self.settle()
        return {f: (e.path, e.shared) for f, e in self._entries.items() if e.frozen}

    def snapshot(self) -> list[Message]:
        """Every message this replica holds, for a peer that (re)joins.

        The table is a function of the message set, so a replica that applies these
        converges to this one's table.
        """
        self.settle()
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

    def table(self, at: float | None = None) -> dict[FlowId, tuple[int, bool]]:
        """Reservations holding links: flow -> (path, shared).

        ``at=None``: what this replica counts as held now (leases expire after the grace).
        ``at=T``: exactly the reservations that hold links at instant ``T`` by their stated
        ends, a function of the messages held and the paths they got (for comparing
        replicas whose clocks differ; what one replica holds past a stated end for an owner
        it measured behind is its own judgement, see :meth:`set_clock`).
        """
        self.settle()
        if at is None:
            return {f: (e.path, e.shared) for f, e in self._entries.items() if e.held and e.path is not None}
        return {
            f: (e.path, e.shared)
            for f, e in self._entries.items()
            if e.path is not None and e.msg.ts <= at < e.stated_end
        }

    def entries(self) -> dict[FlowId, tuple[Reserve, float | None, int | None, bool]]:
        """Everything the replica knows: flow -> (reserve, released ts, path, shared)."""
        self.settle()
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
        self._fold_digest()
        lo = _bucket_of(since)
        hi = _NO_END_BUCKET + 1 if until == INF else _bucket_of(until)
        owners = self._digest_buckets.values() if owner is None else [self._digest_buckets.get(owner, {})]
        x = 0
        for buckets in owners:
            for b, v in buckets.items():
                if lo <= b < hi:
                    x ^= v
        return (x & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")

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
        self.settle()
        return {lk: frozenset(s) for lk, s in self._holders.items() if s}

    def exclusive_conflicts(self, at: float | None = None) -> list[int]:
        """Links held by two flows of which one claims them alone (must stay empty).

        ``at``: judge the reservations active at that instant (see :meth:`table`); two of
        them conflict only while the earlier still holds for the later one's owner (see
        :meth:`lag`).
        """
        self.settle()
        users: dict[int, list[Entry]] = {}
        for e in self._entries.values():
            if e.path is not None and (e.held if at is None else e.msg.ts <= at < e.end):
                for lk in self.links(e.msg, e.path):
                    users.setdefault(lk, []).append(e)
        return sorted(lk for lk, es in users.items() if len(es) > 1 and self._any_conflict(es, at))

    def _any_conflict(self, es: list[Entry], at: float | None) -> bool:
        for i, a in enumerate(es):
            for b in es[i + 1:]:
                if a.shared and b.shared:
                    continue
                first, later = (a, b) if a.msg.key < b.msg.key else (b, a)
                if at is None or first.late_any == 0 or at < first.stated_end + self.lag(first.msg.flow[0],
                                                                                         later.msg.flow[0]):
                    return True
        return False

    def stage_list(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
        stages = self._stage_cache.get((src, dst))
        if stages is not None:
            return stages
        idx = self._stages
        sids = []
        for st in self.routes.stages(src, dst):
            sid = idx.ids.get(st)
            if sid is None:
                sid = idx.ids[st] = len(idx.masks)
                idx.stages.append(st)
                m = 0
                for k, lk in enumerate(st):
                    idx.by_link.setdefault(lk, []).append((sid, k))
                    if self._holders.get(lk):
                        m |= 1 << k
                idx.masks.append(m)
            sids.append(sid)
        key = idx.pair_sids[(src, dst)] = tuple(sids)
        # Every pair between the same two leaves has the same stages: keep one copy of them
        # (a 3-tier fabric of 1,024 GPUs has ~90,000 pairs but ~1,000 leaf pairs).
        shared = idx.by_sids.get(key)
        if shared is None:
            shared = idx.by_sids[key] = tuple(idx.stages[sid] for sid in key)
        self._stage_cache[(src, dst)] = shared
        return shared

    def _valid_reserve(self, msg: Reserve) -> bool:
        n = self.n_hosts
        if not (0 <= msg.src < n and 0 <= msg.dst < n and msg.src != msg.dst):
            return False
        return msg.path < self.routes.n_paths(msg.src, msg.dst)

    def links(self, msg: Reserve, path: int) -> tuple[int, ...]:
        by_path = self._path_links.get((msg.src, msg.dst))
        if by_path is None:
            stages = self.stage_list(msg.src, msg.dst)
            sids = self._stages.pair_sids[(msg.src, msg.dst)]
            by_path = self._stages.path_links.get(sids)
            if by_path is None:
                by_path = self._stages.path_links[sids] = tuple(
                    tuple(st[k] for st in stages) for k in range(len(stages[0]))) if stages else ((),)
            self._path_links[(msg.src, msg.dst)] = by_path  # a pair on one leaf: its one path holds no link
        return by_path[path]

    def _hold(self, flow: FlowId, links: Sequence[int], entry: Entry | None = None) -> None:
        entry = entry or self._entries[flow]
        entry.held = True
        holders, folds, trees = self._holders, self._backlog, self._trees
        for lk in links:
            if folds:
                _fold_in(folds, lk, entry.msg)
            if trees:
                tree = trees.get(lk)
                if tree is not None and not tree.append(entry.msg):
                    del trees[lk]
            s = holders.get(lk)
            if not s:
                if s is None:
                    s = holders[lk] = set()
                masks = self._stages.masks
                for sid, k in self._stages.by_link.get(lk, ()):
                    masks[sid] |= 1 << k
            s.add(flow)

    def _unhold(self, flow: FlowId, links: Sequence[int]) -> None:
        self._entries[flow].held = False
        trees = self._trees
        for lk in links:
            if self._backlog.pop(lk, None) is not None and trees is not None:
                self._churned.add(lk)
            if trees:
                tree = trees.get(lk)
                if tree is not None:
                    tree.remove(flow)
            s = self._holders[lk]
            s.discard(flow)
            if not s:
                for sid, k in self._stages.by_link.get(lk, ()):
                    self._stages.masks[sid] &= ~(1 << k)

    def assign(self, msg: Reserve, held: Callable[[int], bool]) -> tuple[int | None, bool]:
        """Rule 1-3 of the module docstring, against a view of held links."""
        stages = self.stage_list(msg.src, msg.dst)
        if msg.shared:
            return msg.path, True
        if not any(held(st[msg.path]) for st in stages):
            return msg.path, False
        for k in range(len(stages[0])):
            if not any(held(st[k]) for st in stages):
                return k, False
        if self.policy in SHARING_POLICIES:
            return msg.path, True
        return None, False

    def _fold_digest(self) -> None:
        """Bring the per-owner digest buckets up to date with every end changed since."""
        dirty, entries = self._digest_dirty, self._entries
        for f in dirty:
            e = entries.get(f)
            self._digest_set(f, None if e is None else e.stated_end)
        dirty.clear()

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

    def _push_end(self, entry: Entry) -> None:
        end = entry.end
        dirty = self._digest_dirty
        dirty.add(entry.msg.flow)
        if len(dirty) > 4096 + 2 * len(self._entries):  # nobody asks for digests (a simulator)
            self._fold_digest()
        if end > self._expired_upto:
            self._live.add(entry.msg.flow)
        else:
            self._live.discard(entry.msg.flow)
        if end != INF:
            heapq.heappush(self._end_heap, (end, entry.msg.flow))
            heapq.heappush(self._purge_heap, (end, entry.msg.flow))
            if entry.released is None:
                heapq.heappush(self._expiry_heap, (end, entry.msg.flow))

    def _ended_before(self, msg: Reserve, t: float) -> bool:
        if msg.expires == INF and msg.ts < t:
            return True  # no lease: an unknown reservation that old cannot be judged
        end = msg.expires
        renew = self._early_renew.get(msg.flow)
        if renew is not None:  # renewed, perhaps well past its first lease, then perhaps released
            end = max(end, renew.expires)
        rel = self._early_release.get(msg.flow)
        if rel is not None:
            end = min(end, rel)
        return end < t

    def _later_start_at_or_after(self, entry: Entry, t: float) -> bool:
        """Is there a reservation with a larger key that started at or after ``t``?"""
        last = self._keys[-1]
        return last != entry.msg.key and last[0] >= t

    def _sweep(self) -> _Sweep:
        return _Sweep(self.lag if self._behind else None)

    def _evaluate(self, keys: Sequence[Key], sweep: _Sweep) -> list[tuple[Entry, int | None]]:
        """Rules 1-3 for ``keys`` in order; returns (entry, old path) of those that moved."""
        changed: list[tuple[Entry, int | None]] = []
        held = sweep.held
        plain = lambda lk: held.get(lk, 0) > 0  # noqa: E731  (every clock within the bound)
        for key in keys:
            e = self._entries[(key[1], key[2])]
            sweep.retire_until(key[0])
            if not e.frozen:
                old = (e.path, e.shared)
                e.path, e.shared = self.assign(e.msg, sweep.held_for(key) if sweep.grace else plain)
                if (e.path, e.shared) != old:
                    changed.append((e, old[0]))
            if e.path is not None:
                sweep.add(key, self.links(e.msg, e.path), e)
        return changed

    def link_backlog(self, link: int, now: float) -> float:
        """Reserved bytes still to send on ``link`` at ``now`` (see :func:`backlog`)."""
        holders = self._holders.get(link)
        if not holders:
            return 0.0
        cached = self._backlog.get(link)
        trees = self._trees
        if cached is None and trees is not None:
            tree = trees.get(link)
            if tree is None and link in self._churned:
                self._churned.discard(link)
                tree = trees[link] = _LinkBacklog(sorted((self._entries[f].msg for f in holders), key=lambda m: m.key))
            if tree is not None:
                return tree.backlog(now)
        if cached is None:
            ordered = sorted((self._entries[f].msg for f in holders), key=lambda m: m.key)
            left, t_prev = _fold(ordered)
            cached = self._backlog[link] = (ordered[-1].key, left, t_prev, ordered[-1].rate_bps)
        _, left, t_prev, rate = cached
        return _drained(left, t_prev, rate, now)


# A run of a link's holders, as the fold's step composed over them: bytes left after its
# last one = max(a, left before its first + c + r_in * (time of the one before its first)),
# with times from the tree's origin; None: no holder in it.
_Run = tuple[float, float, float, float, float, float]  # a, c, r_in, t_in, t_out, r_out


def _join(x: _Run | None, y: _Run | None) -> _Run | None:
    if x is None:
        return y
    if y is None:
        return x
    a1, c1, r1, t1, tx, _ = x
    a2, c2, r2, _, t2, rout = y
    k = c2 + r2 * tx
    return (max(a2, a1 + k), c1 + k, r1, t1, t2, rout)


class _LinkBacklog:
    """One link's holders in key order as a segment tree of the backlog fold's steps
    (:func:`backlog`): the step of a holder ``m`` after one at time ``tp`` is
    ``left -> max(n, left + n - r (t - tp))`` (``n`` its bytes, ``r`` its rate in bytes a
    second, ``t`` its time), and such steps compose into the same form (:func:`_join`), so
    a holder arriving last or leaving anywhere costs O(log n) and the backlog O(1)."""

    def __init__(self, msgs: Sequence[Reserve]) -> None:
        self.t0 = msgs[0].ts if msgs else 0.0
        self.cap = 1 << max(4, len(msgs) * 2).bit_length()
        self.node: list[_Run | None] = [None] * (2 * self.cap)
        self.pos: dict[FlowId, int] = {}
        self.last_key: Key | None = None  # the latest holder's key: one after it may be appended
        self.filled = 0  # leaves used (those of holders gone included): the next one's index
        for m in msgs:
            self._put(m)
        for i in range(self.cap - 1, 0, -1):
            self.node[i] = _join(self.node[2 * i], self.node[2 * i + 1])

    def _put(self, m: Reserve) -> int:
        t, r = m.ts - self.t0, m.rate_bps / 8.0
        i = self.cap + self.filled
        self.node[i] = (float(m.nbytes), m.nbytes - r * t, r, t, t, r)
        self.pos[m.flow] = i
        self.filled += 1
        self.last_key = m.key
        return i

    def _up(self, i: int) -> None:
        node = self.node
        i >>= 1
        while i:
            node[i] = _join(node[2 * i], node[2 * i + 1])
            i >>= 1

    def append(self, m: Reserve) -> bool:
        """A new holder; False (the tree no longer holds the link's fold) unless it comes
        after every holder."""
        if (self.last_key is not None and m.key <= self.last_key) or m.flow in self.pos:
            return False
        if self.filled == self.cap:  # full: dropped, built again at the next ask, twice the live ones
            return False
        self._up(self._put(m))
        return True

    def remove(self, flow: FlowId) -> None:
        i = self.pos.pop(flow, None)
        if i is not None:
            self.node[i] = None
            self._up(i)

    def backlog(self, now: float) -> float:
        root = self.node[1]
        if root is None:
            return 0.0
        a, c, r_in, t_in, t_out, r_out = root
        left = max(a, c + r_in * t_in)
        return max(0.0, left - r_out * (now - self.t0 - t_out))


def _fold_in(folds: dict[int, tuple[Key, float, float, float]], link: int, m: Reserve) -> None:
    """One more holder of ``link`` in its kept backlog fold (:meth:`ReservationTable.link_backlog`):
    :func:`_step` when it comes after every holder folded; else the fold is dropped."""
    f = folds.get(link)
    if f is None:
        return
    key, left, t_prev, _ = f
    if m.key > key:
        folds[link] = (m.key, _step(left, t_prev, m), m.ts, m.rate_bps)
    else:
        del folds[link]


def _step(left: float, t_prev: float, m: Reserve) -> float:
    """The backlog fold's one step: bytes left once ``m`` arrives, ``left`` having been
    left at ``t_prev`` (drained at ``m``'s rate meanwhile, never below empty)."""
    return max(0.0, left - m.rate_bps / 8.0 * (m.ts - t_prev)) + m.nbytes


def _fold(ordered: Sequence[Reserve]) -> tuple[float, float]:
    """Bytes left just after the last of ``ordered`` (one link's holders in key order, at
    least one), and its time."""
    left, t_prev = 0.0, ordered[0].ts
    for m in ordered:
        left = _step(left, t_prev, m)
        t_prev = m.ts
    return left, t_prev


def _drained(left: float, t_prev: float, rate_bps: float, now: float) -> float:
    """Bytes left at ``now`` of ``left`` at ``t_prev``, drained at ``rate_bps``."""
    return max(0.0, left - rate_bps / 8.0 * (now - t_prev))


def backlog(msgs: Sequence[Reserve], now: float) -> float:
    """Bytes the reservations ``msgs`` of one link still have to send at ``now``.

    The link is modelled as a work-conserving queue fed by its live reservations (each
    adds ``nbytes`` at its ``ts``) and drained at the reservations' path rate: sharing
    between flows does not change how fast the link empties, so this needs no per-flow
    rate guess.
    """
    if not msgs:
        return 0.0
    ordered = sorted(msgs, key=lambda m: m.key)
    left, t_prev = _fold(ordered)
    return _drained(left, t_prev, ordered[-1].rate_bps, now)


def least_backlogged(stages: tuple[tuple[int, ...], ...], n: int, backlog_of: Callable[[int], float],
                     usable: int = -1) -> int:
    """The usable path whose busiest link has the least reserved backlog (tie: lowest
    index): where ``ark-balance`` and ``ark-split`` put a flow that finds no path free.
    ``backlog_of(link)``: bytes still to send on a link (the table's, or a host's view)."""
    best, best_cost = 0, float("inf")
    seen: dict[int, float] = {}  # a link lies on many paths: its backlog once per decision
    for k in range(n):
        if not usable >> k & 1:
            continue
        cost = 0.0
        for st in stages:
            lk = st[k]
            b = seen.get(lk)
            if b is None:
                b = seen[lk] = backlog_of(lk)
            cost = max(cost, b)
            if cost >= best_cost:
                break  # this path cannot win any more
        if cost < best_cost:
            best, best_cost = k, cost
    return best
