"""The ARK reservation protocol: a sans-IO replicated reservation table.

One :class:`ArkCore` runs per host. It never touches sockets, clocks or global random:
inputs are method calls with ``now`` passed in, outputs are messages to broadcast and
events for the local flows. The simulator, the agent and the testbed all drive it.

Table semantics (the same on every replica)
-------------------------------------------
The table is a pure function of the set of RESERVE and RELEASE messages a replica holds,
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
Reservations older than the retention horizon are *settled*: they keep their assignment
and late messages older than the horizon are dropped as stale. Most messages arrive in
key order and take an incremental fast path that gives exactly the full recomputation's
result; anything else triggers the full recomputation.

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
import random
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ark.messages import FlowId, Key, Message, Release, Reserve
from ark.pathmap import PathMap, PortBuckets
from ark.roce import flow_label_for_sport

POLICIES = ("ark", "ark-balance")


class Routes(Protocol):
    """What the core needs of a topology (``ark.topology.Fabric`` provides it)."""

    def stages(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]: ...

    def n_paths(self, src: int, dst: int) -> int: ...

    def path_rate_bps(self, src: int, dst: int, path: int) -> float: ...

    @property
    def n_hosts(self) -> int: ...


PathMaps = Callable[[int, int, int], PathMap]  # (src, dst, dport) -> map


class CoreError(ValueError):
    """A local API misuse (unknown host, unknown flow, bad argument)."""


@dataclass(slots=True)
class _Entry:
    msg: Reserve
    released: float | None = None
    path: int | None = None  # assigned path; None = holds nothing
    shared: bool = False


@dataclass(slots=True)
class _Own:
    flow: FlowId
    dst: int
    dport: int
    path: int
    port: int
    reserved: bool


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
    received: int = 0
    duplicates: int = 0
    stale: int = 0
    invalid: int = 0
    recomputes: int = 0


@dataclass
class _StageIndex:
    """Bitmask per stage: bit k set when link ``stage[k]`` has a holder.

    Stages are interned to small ints so that a lookup never hashes a K-long tuple.
    """

    ids: dict[tuple[int, ...], int] = field(default_factory=dict)
    masks: list[int] = field(default_factory=list)
    by_link: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    pair_sids: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)


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
    ) -> None:
        if policy not in POLICIES:
            raise CoreError(f"policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
        if not 0 <= host < routes.n_hosts:
            raise CoreError(f"host: must be 0..{routes.n_hosts - 1}; got {host}")
        if retention_s <= 0:
            raise CoreError(f"retention_s: must be > 0; got {retention_s}")
        self.host = host
        self.routes = routes
        self._n_hosts = routes.n_hosts
        self.policy = policy
        self.retention_s = retention_s
        self.counters = Counters()
        self._pathmaps = pathmaps
        self._rng = random.Random(seed)  # owned: ECMP fallback ports only
        self._seq = 0
        self._entries: dict[FlowId, _Entry] = {}
        self._keys: list[Key] = []
        self._early_release: dict[FlowId, float] = {}
        self._holders: dict[int, set[FlowId]] = {}
        self._stages = _StageIndex()
        self._stage_cache: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self._own: dict[FlowId, _Own] = {}
        self._buckets: dict[tuple[int, int], PortBuckets] = {}
        self._max_released = float("-inf")
        self._release_heap: list[tuple[float, FlowId]] = []
        self._rates: dict[tuple[int, int], float] = {}
        self._horizon = float("-inf")

    # ------------------------------------------------------------------ owner API
    def request(self, dst: int, nbytes: int, now: float, dport: int = 4791) -> Decision:
        """Pick a path and source port for a new flow to ``dst`` and reserve it."""
        if not 0 <= dst < self._n_hosts or dst == self.host:
            raise CoreError(f"dst: must be another host 0..{self._n_hosts - 1}; got {dst}")
        if nbytes < 0:
            raise CoreError(f"nbytes: must be >= 0; got {nbytes}")
        if not 0 <= dport <= 0xFFFF:
            raise CoreError(f"dport: must be 0..65535; got {dport}")
        self.counters.requests += 1
        self._seq += 1
        flow = (self.host, self._seq)
        buckets = self._bucket(dst, dport)
        stages = self._stage_list(self.host, dst)
        if not stages:  # intra-leaf: nothing to choose, nothing to reserve
            port = buckets.take(0)
            self._own[flow] = _Own(flow, dst, dport, 0, port, False)
            return Decision(
                flow, dst, dport, 0, port, flow_label_for_sport(port), False, False, False, ()
            )
        n = len(stages[0])
        free_path = self._lowest_free(self._stages.pair_sids[(self.host, dst)], n)
        shared = False
        if free_path is not None:
            path = free_path
        elif self.policy == "ark":
            self.counters.fallbacks += 1
            port = self._random_port(buckets)
            path = buckets.map.path_of(port)
            self._own[flow] = _Own(flow, dst, dport, path, port, False)
            return Decision(
                flow, dst, dport, path, port, flow_label_for_sport(port), False, False, True, ()
            )
        else:
            self.counters.fallbacks += 1
            self.counters.shared += 1
            path = self._balance_choice(stages, n, now)
            shared = True
        port = buckets.take(path)
        rate = self._rates.get((dst, path))
        if rate is None:
            rate = self._rates[(dst, path)] = float(self.routes.path_rate_bps(self.host, dst, path))
        msg = Reserve(flow, float(now), self.host, dst, dport, path, port, int(nbytes), float(rate), shared)
        self._own[flow] = _Own(flow, dst, dport, path, port, True)
        self.counters.reserved += 1
        # With skewed clocks our own key may lose at once to a peer's smaller key, and a
        # recomputation may move other local flows: report those as events.
        events = tuple(e for e in self._insert(msg) if e.flow != flow)
        own = self._own[flow]
        return Decision(
            flow, dst, dport, own.path, own.port, flow_label_for_sport(own.port),
            own.reserved, shared, shared or not own.reserved, (msg,), events,
        )

    def select_path(self, dst: int) -> int | None:
        """The lowest-index path to ``dst`` whose links are all free (None if none)."""
        stages = self._stage_list(self.host, dst)
        if not stages:
            return 0
        return self._lowest_free(self._stages.pair_sids[(self.host, dst)], len(stages[0]))

    def _lowest_free(self, sids: tuple[int, ...], n: int) -> int | None:
        busy = 0
        masks = self._stages.masks
        for sid in sids:
            busy |= masks[sid]
        free = ~busy & ((1 << n) - 1)
        return (free & -free).bit_length() - 1 if free else None

    def release(self, flow: FlowId, now: float) -> Released:
        """The local flow finished: free its port and broadcast RELEASE if it reserved."""
        own = self._own.pop(flow, None)
        if own is None:
            raise CoreError(f"flow: {flow} is not an active local flow")
        self._bucket(own.dst, own.dport).give(own.port)
        if flow not in self._entries:
            return Released((), ())
        msg = Release(flow, float(now))
        return Released((msg,), tuple(self._apply_release(msg)))

    def receive(self, msg: Message, now: float, sender: int | None = None) -> list[Repath]:
        """Apply a peer's message; returns changes to local flows (races lost)."""
        self.counters.received += 1
        if sender is not None and msg.flow[0] != sender:
            self.counters.invalid += 1
            return []
        if isinstance(msg, Reserve):
            if not self._valid_reserve(msg):
                self.counters.invalid += 1
                return []
            if msg.ts < self._horizon:
                self.counters.stale += 1
                return []
            old = self._entries.get(msg.flow)
            if old is not None:
                if old.msg == msg:
                    self.counters.duplicates += 1
                else:
                    self.counters.invalid += 1
                return []
            if msg.flow[0] == self.host and msg.flow not in self._own:
                # An echo of our own reservation we no longer know: ignore.
                self.counters.stale += 1
                return []
            return self._insert(msg)
        if isinstance(msg, Release):
            entry = self._entries.get(msg.flow)
            if entry is None:
                if msg.ts < self._horizon:
                    self.counters.stale += 1
                elif msg.flow in self._early_release:
                    self.counters.duplicates += 1
                else:
                    self._early_release[msg.flow] = msg.ts
                return []
            if entry.released is not None:
                self.counters.duplicates += 1
                return []
            if msg.ts < entry.msg.ts:
                self.counters.invalid += 1
                return []
            return self._apply_release(msg)
        self.counters.invalid += 1
        return []

    def tick(self, now: float) -> None:
        """Advance the retention horizon and forget long-released reservations."""
        horizon = now - self.retention_s
        if horizon <= self._horizon:
            return
        self._horizon = horizon
        heap = self._release_heap
        while heap and heap[0][0] < horizon:
            rts, flow = heapq.heappop(heap)
            e = self._entries.get(flow)
            if e is None or e.released != rts:
                continue
            del self._entries[flow]
            i = bisect_left(self._keys, e.msg.key)
            del self._keys[i]
        if self._early_release:
            for f in [f for f, t in self._early_release.items() if t < horizon]:
                del self._early_release[f]

    # ------------------------------------------------------------------ views
    def table(self) -> dict[FlowId, tuple[int, bool]]:
        """Live reservations that hold links: flow -> (path, shared)."""
        return {
            f: (e.path, e.shared)
            for f, e in self._entries.items()
            if e.released is None and e.path is not None
        }

    def entries(self) -> dict[FlowId, tuple[Reserve, float | None, int | None, bool]]:
        """Everything the replica knows: flow -> (reserve, released ts, path, shared)."""
        return {f: (e.msg, e.released, e.path, e.shared) for f, e in self._entries.items()}

    def digest(self) -> str:
        """Order-independent digest of the live table (paths, not ports)."""
        h = hashlib.sha256()
        for f in sorted(self.table()):
            p, s = self._entries[f].path, self._entries[f].shared
            h.update(f"{f[0]}:{f[1]}:{p}:{int(s)};".encode())
        return h.hexdigest()[:16]

    def link_holders(self) -> dict[int, frozenset[FlowId]]:
        return {lk: frozenset(s) for lk, s in self._holders.items() if s}

    def exclusive_conflicts(self) -> list[int]:
        """Links held by two flows of which one claims them alone (must stay empty)."""
        bad = []
        for lk, s in self._holders.items():
            if len(s) > 1 and any(not self._entries[f].shared for f in s):
                bad.append(lk)
        return bad

    def local_flows(self) -> dict[FlowId, tuple[int, int, int, bool]]:
        """Local flows: flow -> (dst, path, port, reserved)."""
        return {f: (o.dst, o.path, o.port, o.reserved) for f, o in self._own.items()}

    # ------------------------------------------------------------------ internals
    def _bucket(self, dst: int, dport: int) -> PortBuckets:
        b = self._buckets.get((dst, dport))
        if b is None:
            b = self._buckets[(dst, dport)] = PortBuckets(self._pathmaps(self.host, dst, dport))
        return b

    def _random_port(self, buckets: PortBuckets) -> int:
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
        for lk in links:
            s = self._holders.get(lk)
            if s is None:
                s = self._holders[lk] = set()
            if not s:
                for sid, k in self._stages.by_link.get(lk, ()):
                    self._stages.masks[sid] |= 1 << k
            s.add(flow)

    def _unhold(self, flow: FlowId, links: tuple[int, ...]) -> None:
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

    def _insert(self, msg: Reserve) -> list[Repath]:
        entry = _Entry(msg)
        key = msg.key
        fast = (not self._keys or key > self._keys[-1]) and msg.ts >= self._max_released
        early = self._early_release.pop(msg.flow, None)
        self._entries[msg.flow] = entry
        insort(self._keys, key)
        if early is not None:
            entry.released = early
            heapq.heappush(self._release_heap, (early, msg.flow))
            self._max_released = max(self._max_released, early)
            fast = False
        if not fast:
            return self._recompute()
        holders = self._holders
        stages = self._stage_list(msg.src, msg.dst)
        links = [st[msg.path] for st in stages]
        if not msg.shared and not any([holders.get(lk) for lk in links]):
            entry.path = msg.path  # the common case: requested path free
        else:
            entry.path, entry.shared = self._assign(msg, lambda lk: bool(holders.get(lk)))
            if entry.path is not None:
                links = [st[entry.path] for st in stages]
        if entry.path is not None:
            self._hold(msg.flow, links)
        if msg.flow[0] != self.host:
            return []
        return self._sync_own(msg.flow)

    def _apply_release(self, msg: Release) -> list[Repath]:
        entry = self._entries[msg.flow]
        entry.released = msg.ts
        heapq.heappush(self._release_heap, (msg.ts, msg.flow))
        self._max_released = max(self._max_released, msg.ts)
        last = self._keys[-1]
        if last[0] >= msg.ts and last != entry.msg.key:
            # Someone reserved at or after this release instant: their evaluation
            # may change now that this flow is known to be gone.
            return self._recompute()
        if entry.path is not None:
            self._unhold(msg.flow, self._links(entry.msg, entry.path))
        return []

    def _recompute(self) -> list[Repath]:
        self.counters.recomputes += 1
        held: dict[int, int] = {}
        retire: list[tuple[float, Key]] = []
        active_links: dict[Key, tuple[int, ...]] = {}
        for key in self._keys:
            e = self._entries[(key[1], key[2])]
            ts = e.msg.ts
            while retire and retire[0][0] <= ts:
                _, k = heapq.heappop(retire)
                for lk in active_links.pop(k):
                    held[lk] -= 1
            if ts >= self._horizon:  # settled entries keep their assignment
                e.path, e.shared = self._assign(e.msg, lambda lk: held.get(lk, 0) > 0)
            if e.path is not None:
                links = self._links(e.msg, e.path)
                for lk in links:
                    held[lk] = held.get(lk, 0) + 1
                active_links[key] = links
                heapq.heappush(retire, (e.released if e.released is not None else float("inf"), key))
        # Rebuild live holders and masks from scratch.
        self._holders = {}
        masks = self._stages.masks
        for i in range(len(masks)):
            masks[i] = 0
        for f, e in self._entries.items():
            if e.released is None and e.path is not None:
                self._hold(f, self._links(e.msg, e.path))
        events: list[Repath] = []
        for f in list(self._own):
            if f in self._entries:
                events.extend(self._sync_own(f))
        return events

    def _sync_own(self, flow: FlowId) -> list[Repath]:
        """Bring a local flow in line with its table entry; report what changed."""
        own = self._own.get(flow)
        entry = self._entries.get(flow)
        if own is None or entry is None:
            return []
        reserved = entry.path is not None and entry.released is None
        new_path = entry.path if entry.path is not None else own.path
        if new_path == own.path and reserved == own.reserved:
            return []
        old = own.path
        if new_path != own.path:
            buckets = self._bucket(own.dst, own.dport)
            buckets.give(own.port)
            own.port = buckets.take(new_path)
            own.path = new_path
        own.reserved = reserved
        self.counters.races_lost += 1
        return [Repath(flow, old, own.path, own.port, flow_label_for_sport(own.port), reserved)]

    def _balance_choice(self, stages: tuple[tuple[int, ...], ...], n: int, now: float) -> int:
        best, best_cost = 0, float("inf")
        for k in range(n):
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
