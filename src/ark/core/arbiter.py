"""The arbiter: one process that decides for every host, with the replicas' own table.

The replicated table is a deterministic function of the set of reservations, so one
process holding it can decide for everyone: a host sends one request and gets one answer
per decision, plus one release, instead of hearing every reservation of the cluster. This
is the sans-IO state machine (``now`` passed in, bytes in and out); ``ark arbiter``
(:mod:`ark.agent.arbiter`) moves its bytes, and agents talk to it through
:class:`ark.core.arbiter_host.ArbiterLink`.

Decisions
---------
Every decision is an ordinary RESERVE of the asking host in one
:class:`~ark.core.table.ReservationTable`, chosen by the same rules as a host's own
:class:`~ark.core.protocol.ArkCore` (lowest free path; none free: plain ECMP under ``ark``,
the least-backlogged path, shared, under ``ark-balance`` and ``ark-split``; the parts of
one transfer avoid each other's paths while others remain). The arbiter stamps its
decisions with strictly increasing times, so each insert takes the table's in-order path
and no later decision can move an earlier one: one decider, no races. Leases expire here
as on replicas; renewals and releases name flows the arbiter handed out, and only their
owner (the authenticated sender) may name them.

Two arbiters, epochs and takeover
---------------------------------
Arbiters are ranked (the cluster file's order). Each one's epoch is
``generation x arbiters + rank``, so two arbiters never lead with the same epoch, and a
new leader always takes a generation above every epoch it has seen. The leader sends
every table message it applies to the follower (:class:`~ark.core.arbiter_wire.Changes`)
and a :class:`~ark.core.arbiter_wire.Beat` every ``heartbeat_s``; a follower that missed
any asks for the whole table again (and again two beats later while it has not got it).
A follower that hears no leader for ``takeover_s`` leads with a new epoch, on the table
it holds (rank r waits two beats more per rank, so that at a cold start the first rank
leads). An arbiter that learns of a higher epoch
than its own (a host's message, the other arbiter's beat) stops leading and follows.
An arbiter starts from the highest epoch it led or heard of before (``seen_epoch``, kept
across restarts by ``ark arbiter``): it follows any leader of that epoch or above, and
leads only a generation above it. Transitions (``_LEADING``/``_FOLLOWING``) all go through
:meth:`Arbiter._become`.

The leader lease: a leader answers hosts only while every arbiter it needs has
acknowledged (echoed, at once) one of its beats sent less than ``lease_s`` ago on its own
clock; ``lease_s`` is ``takeover_s`` shrunk by the clocks' rate bound (``clock_drift``)
and a margin (``lease_margin_s``), so it ends before any such follower, counting
``takeover_s`` of silence on its clock, can lead. It needs every other arbiter but the
leader it took over from, when that one's lease needed it (that leader answers no more
without its acknowledgements, which it does not give to an older epoch). A stopped
process resumes with its lease run out. The argument is in docs/arbiter.md.

Every flow id carries the epoch that granted it (``seq = epoch << 32 | n``). A new leader
takes renewals only of flows its table holds: those it followed, and those a host
registers again (:class:`~ark.core.arbiter_wire.Register`), each judged like a new request
on its old path only. What an old leader granted and nobody registered ends with its
lease.

Bounds (what one listed host can make the arbiter keep or do): live flows per host
(beyond: plain ECMP with the reason), a token bucket per host that every message kind
draws on by the work it asks for (an ask one token per part, a renewal or release one per
flow, a ping one, a registration one per lease judged anew; beyond: plain ECMP, leases left
as they stand, pings unanswered), so that what one host makes the followers apply is
bounded too; 16 parts per lease, 64 flows per message, the last 64 answers per host kept
for retries (a repeated request id gets the same answer and changes nothing).

Epochs from the other arbiters are believed only up to ``max_epoch_jump`` above the
highest seen (beyond: counted and dropped), and an arbiter that has no epoch left to lead
with (2**30) follows, counted, instead of failing: no message can end it.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from ark.core import arbiter_wire as w
from ark.core.messages import FlowId, Message, ProtocolError, Release, Renew, Reserve, decode, encode
from ark.core.table import (
    INF,
    SHARING_POLICIES,
    CoreError,
    CoreLimits,
    Counters,
    ReservationTable,
    Routes,
    least_backlogged,
)

_M = TypeVar("_M")
LeaseFn = Callable[[int, float], float]  # (nbytes, path rate bps) -> lease seconds

SAME_LEAF = "same leaf"
NO_FREE_PATH = "no free path"
RATE_LIMITED = "rate limited"
ANSWERS_KEPT = 64  # per host: answers a retried request id gets again
SEQ_SHIFT = 32


def _lease_s(takeover_s: float, heartbeat_s: float, drift: float, margin: float | None) -> float:
    """The leader lease: ``takeover_s`` measured by a clock up to ``drift`` fast, read on
    one up to ``drift`` slow, less ``margin`` (default half a beat): the longest a
    handler may take between reading the clock and its answer leaving."""
    if not (math.isfinite(drift) and 0 <= drift <= 0.1):
        raise CoreError(f"clock_drift: must be 0..0.1 (a rate bound); got {drift}")
    margin = heartbeat_s / 2 if margin is None else margin
    if not (math.isfinite(margin) and margin >= 0):
        raise CoreError(f"lease_margin_s: must be a finite number >= 0; got {margin}")
    lease = takeover_s * (1 - drift) / (1 + drift) - margin
    if not lease > heartbeat_s:
        raise CoreError(f"lease_margin_s: leaves a lease of {lease:.3f} s, not above heartbeat_s ({heartbeat_s}); "
                        f"got {margin} with takeover_s {takeover_s}, clock_drift {drift}")
    return lease


class ArbiterOut(NamedTuple):
    """Bytes for a host (``host`` >= 0) or for another arbiter (``arbiter`` >= 0)."""

    host: int
    arbiter: int
    data: bytes


@dataclass(frozen=True)
class ArbiterLimits:
    """What one listed host can make the arbiter keep or do."""

    max_flows_per_host: int = 4096  # live reservations; beyond: plain ECMP
    rate_per_host: float = 2000.0  # tokens per second: one per part, flow or ping; beyond: plain ECMP
    burst_per_host: int = 256
    max_epoch_jump: int = 1 << 16  # an arbiter's epoch more than this above the highest seen: refused

    def __post_init__(self) -> None:
        if not 1 <= self.max_flows_per_host <= 1 << 20:
            raise CoreError(f"max_flows_per_host: must be 1..{1 << 20}; got {self.max_flows_per_host}")
        if not (math.isfinite(self.rate_per_host) and self.rate_per_host > 0):
            raise CoreError(f"rate_per_host: must be a finite number > 0; got {self.rate_per_host}")
        if not 1 <= self.burst_per_host <= 1 << 20:
            raise CoreError(f"burst_per_host: must be 1..{1 << 20}; got {self.burst_per_host}")
        if not 1 <= self.max_epoch_jump < 1 << 30:
            raise CoreError(f"max_epoch_jump: must be 1..{(1 << 30) - 1}; got {self.max_epoch_jump}")


@dataclass
class ArbiterCounters:
    asks: int = 0
    granted: int = 0  # parts reserved
    ecmp: int = 0  # parts answered with plain ECMP (no free path, caps, rate)
    capped: int = 0
    rate_limited: int = 0  # messages (asks, renewals, releases, pings, registrations) beyond the host's tokens
    renewed: int = 0
    released: int = 0
    registered: int = 0
    foreign: int = 0  # a flow named by a host that does not own it
    unknown: int = 0  # renew or release of a flow not held here
    invalid: int = 0  # undecodable or out-of-range messages
    refused: int = 0  # asked while not leading
    no_lease: int = 0  # asked while leading without a current lease: refused
    paused: int = 0  # gaps between two events longer than the lease: this process was stopped
    newer_epoch_seen: int = 0  # requests from hosts that have heard a newer leader
    gaps: int = 0  # changes missed by a follower (it asks for the whole table again)
    retries: int = 0  # repeated request ids answered from the kept answers
    takeovers: int = 0
    stepped_down: int = 0
    syncs: int = 0
    changes_applied: int = 0
    epoch_jumps: int = 0  # an arbiter's message more than max_epoch_jump above the highest epoch seen
    epoch_exhausted: int = 0  # times it could not lead: no epoch left below 2**30


@dataclass
class _Host:
    tokens: float
    at: float
    live: set[FlowId] = field(default_factory=set)
    answers: OrderedDict[int, bytes] = field(default_factory=OrderedDict)


_LEADING, _FOLLOWING = "leading", "following"


class Arbiter:
    """One arbiter: ``rank`` of ``arbiters``; it leads at once when it is the only one."""

    def __init__(
        self, routes: Routes, *, rank: int = 0, arbiters: int = 1, policy: str = "ark", lease: LeaseFn | None = None,
        limits: ArbiterLimits | None = None, heartbeat_s: float = 0.25, takeover_s: float = 1.0,
        retention_s: float = 5.0, expiry_grace_s: float = 0.25, seen_epoch: int = 0, clock_drift: float = 1e-3,
        lease_margin_s: float | None = None,
    ) -> None:
        if not 1 <= arbiters <= 16 or not 0 <= rank < arbiters:
            raise CoreError(f"rank: must be 0..{arbiters - 1} of 1..16 arbiters; got {rank} of {arbiters}")
        if not 0 < heartbeat_s < takeover_s:
            raise CoreError(f"takeover_s: must be > heartbeat_s ({heartbeat_s}) > 0; got {takeover_s}")
        if not 0 <= seen_epoch < 1 << 30:
            raise CoreError(f"seen_epoch: must be 0..{(1 << 30) - 1}; got {seen_epoch}")
        self.lease_s = _lease_s(takeover_s, heartbeat_s, clock_drift, lease_margin_s)
        self.routes, self.rank, self.arbiters, self.policy = routes, rank, arbiters, policy
        self.limits = limits or ArbiterLimits()
        self.heartbeat_s, self.takeover_s = heartbeat_s, takeover_s
        self.counters = ArbiterCounters()
        self.table_counters = Counters()
        self._lease = lease
        self._retention, self._grace = retention_s, expiry_grace_s
        self.table = self._new_table()
        # seen_epoch: the highest epoch this arbiter led or heard of before it (re)started
        # (kept across restarts). It follows a leader of that epoch or above, whatever its
        # rank (its own epoch of that generation may be higher: a standby restarting beside
        # a live leader must follow it, not lead on an empty table), and it leads a
        # generation above it.
        self.epoch = seen_epoch // arbiters * arbiters + rank
        self.seen_epoch = seen_epoch
        self.role = _FOLLOWING
        self.synced = arbiters == 1  # holds the leader's whole table (or is the only arbiter)
        self._n = 0  # flows granted in this epoch
        self._last_ts = -INF
        self._hosts: dict[int, _Host] = {}
        self._leader_heard = -INF
        self._started: float | None = None
        self._next_beat = -INF
        self._syncing = False
        self._sync_asked = -INF  # when the last SyncAsk went out (one lost is asked again)
        self._sync_at = -1  # the stream position of the table being fetched
        # Path rates per (src, dst, path): every pair of a large fabric asks, so the cache is bounded.
        self._rate = functools.lru_cache(maxsize=1 << 16)(routes.path_rate_bps)
        self._following = -1  # the epoch whose table this follower holds or is fetching
        self._sent = 0  # table messages sent to followers in this epoch
        self._applied = 0  # table messages applied from the leader's stream in its epoch
        self._changes: list[Message] = []  # applied here, not yet sent to followers (flush)
        # The leader lease (see _lease_held): acknowledgements of this leader's beats per
        # rank (the beat's send time on this clock), the ranks whose acknowledgements it
        # takes, and what a follower last heard of its leader.
        self._acked: dict[int, float] = {}
        self._needs: set[int] = set()
        self._beat_sent = -INF  # the last leading beat's send time (own clock)
        self._heard = (-1, -1.0)  # the last leading beat followed: its epoch and send time (its leader's clock)
        self._needed_by = -1  # that beat's rank, when its leader's lease takes this arbiter's acknowledgements
        self._last_event = -INF

    def _new_table(self) -> ReservationTable:
        lim = CoreLimits(max_flows_per_host=self.limits.max_flows_per_host)
        return ReservationTable(self.routes, policy=self.policy, retention_s=self._retention,
                                expiry_grace_s=self._grace, counters=self.table_counters, limits=lim,
                                backlog_index=True)

    @property
    def leading(self) -> bool:
        return self.role == _LEADING

    # ------------------------------------------------------------------ time
    def start(self, now: float) -> list[ArbiterOut]:
        self._started = now
        if self.arbiters == 1:
            self._become(_LEADING, now)
        return self.tick(now)

    def tick(self, now: float) -> list[ArbiterOut]:
        """Expire leases; beat; take over from a silent leader."""
        self._note(now)
        for f in self.table.tick(now):
            self._ended(f)
        out: list[ArbiterOut] = []
        if not self.leading and self.arbiters > 1 and self._started is not None and now >= self._takeover_at():
            self._become(_LEADING, now)
        if now >= self._next_beat:
            self._next_beat = now + self.heartbeat_s
            out += self._to_arbiters(self._beat(now))
        return out

    def _beat(self, now: float) -> w.Beat:
        """A leader's beat carries its clock and the ranks its lease needs; a follower's
        acknowledges the last leading beat it heard."""
        if self.leading:
            self._beat_sent = now
            return w.Beat(self.epoch, True, self.synced, now, needs=sum(1 << r for r in self._needs))
        epoch, sent = self._heard
        return w.Beat(self.epoch, False, self.synced, now, sent if epoch >= 0 else -1.0, max(epoch, 0))

    def _note(self, now: float) -> None:
        """Every event: a gap longer than the lease since the last one means this process
        was stopped (SIGSTOP, a VM stall), counted. A leader's lease has then run out by
        itself: its acknowledgements are of beats sent before the stop, so it answers
        nothing until its followers acknowledge a beat sent after it."""
        if now - self._last_event > self.lease_s and self._last_event > -INF:
            self.counters.paused += 1
        self._last_event = max(self._last_event, now)

    def _lease_held(self, now: float) -> bool:
        """The leader lease: every rank it needs acknowledged a beat sent less than
        ``lease_s`` ago on this clock. Such a follower heard that beat after it was sent,
        and leads only after ``takeover_s`` of silence on its own clock; ``lease_s`` is
        that, shrunk by the clocks' rate bound and the margin (docs/arbiter.md)."""
        return all(self._acked.get(r, -INF) + self.lease_s > now for r in self._needs)

    def next_deadline(self) -> float:
        t = min(self._next_beat, self.table.next_deadline())
        if not self.leading and self.arbiters > 1 and self._started is not None:
            t = min(t, self._takeover_at())
        return t

    def _takeover_at(self) -> float:
        """When a follower leads if it hears no leader: ``takeover_s`` of silence, plus two
        beats per rank, so that at a cold start the first rank leads and the others hear it."""
        assert self._started is not None
        return max(self._leader_heard, self._started) + self.takeover_s + 2 * self.rank * self.heartbeat_s

    def _become(self, role: str, now: float, epoch: int | None = None) -> None:
        """Every change of role: leading takes a generation above every epoch seen."""
        if role == _LEADING and not self.leading:
            if not self._lead_anew():
                self._leader_heard = now  # try again after takeover_s (and never busy-wait)
                return
            self._recount(now)
            self.counters.takeovers += self.arbiters > 1
            self._next_beat = now  # tell the others at once
            # The lease takes every other rank's acknowledgements, but for the leader this
            # one followed if that leader's lease took its own: that leader answers no
            # more without them, and this one gives none to an older epoch.
            self._needs = set(range(self.arbiters)) - {self.rank, self._needed_by}
            self._acked = {}
        elif role == _FOLLOWING and self.leading:
            self.counters.stepped_down += 1
            self.synced = False
        self._heard, self._needed_by = (-1, -1.0), -1
        if epoch is not None:
            self.seen_epoch = max(self.seen_epoch, epoch)
        self.role = role

    def _lead_anew(self) -> bool:
        """A new epoch, a generation above every epoch seen: at a takeover, and when an
        epoch's 2**32 flow ids are used up (followers see the new epoch and fetch the table).
        False, counted, when none is left below 2**30: the arbiter does not lead."""
        generation = self.seen_epoch // self.arbiters + 1
        epoch = generation * self.arbiters + self.rank
        if epoch >= 1 << 30:
            self.counters.epoch_exhausted += 1
            return False
        self.epoch = self.seen_epoch = epoch
        self._n, self._sent, self._changes = 0, 0, []
        self._next_beat = -INF  # beat at once: followers acknowledge beats of this epoch
        return True

    # ------------------------------------------------------------------ hosts
    def on_host(self, host: int, data: bytes, now: float) -> list[ArbiterOut]:
        """One message from ``host`` (the transport authenticated it)."""
        self._note(now)
        msg = self._decoded(w.decode_from_host, data, 0 <= host < self.routes.n_hosts)
        if msg is None:
            return []
        if msg.epoch > self.epoch:
            # The host has heard a newer leader. Only an arbiter's beat makes this one step
            # down (a host's word would let any listed host stop the arbiter); the host itself
            # refuses answers of an epoch below the highest it has seen.
            self.counters.newer_epoch_seen += 1
        if not self.leading:
            self.counters.refused += 1
            leader = self.seen_epoch % self.arbiters if self.seen_epoch != self.epoch else -1
            return [self._reply(host, w.Refused(msg.rid, self.seen_epoch, leader, "not leading"))]
        if not self._lease_held(now):  # another arbiter may lead by now: answer nothing (kept answers neither)
            self.counters.no_lease += 1
            return [self._reply(host, w.Refused(msg.rid, self.seen_epoch, -1, "no lease"))]
        st = self._host(host, now)
        kept = st.answers.get(msg.rid)
        # Every message costs at least one token, taken before any work: a retry or a ping
        # one, a fresh message one per part, flow or lease it names.
        paid = self._within_rate(st, now, 1 if kept is not None else _cost(msg))
        if (kept is not None or isinstance(msg, w.Ping)) and not paid:
            self.counters.rate_limited += 1  # a retry or a ping beyond the host's tokens: unanswered
            return []
        if kept is not None:
            self.counters.retries += 1
            return [ArbiterOut(host, -1, kept)]
        self.counters.rate_limited += not paid
        reply = self._answer(host, st, msg, now, paid)
        data_out = w.encode(reply)
        st.answers[msg.rid] = data_out
        if len(st.answers) > ANSWERS_KEPT:
            st.answers.popitem(last=False)
        return [ArbiterOut(host, -1, data_out)]

    def flush(self) -> list[ArbiterOut]:
        """The table messages applied since the last flush, for the followers: a driver
        calls this once per batch of requests (one message to each follower per batch)."""
        changes, self._changes = self._changes, []
        if not changes or self.arbiters == 1:
            return []
        out: list[ArbiterOut] = []
        step = w.MAX_CHANGES_PER_MESSAGE
        for i in range(0, len(changes), step):
            chunk = [encode(m) for m in changes[i:i + step]]
            out += self._to_arbiters(w.Changes(self.epoch, self._sent, chunk))
            self._sent += len(chunk)
        return out

    def _answer(self, host: int, st: _Host, msg: w.FromHost, now: float, paid: bool) -> w.ToHost:
        """The answer to a fresh message; ``paid``: the host had its tokens (see :func:`_cost`)."""
        if isinstance(msg, w.Ask):  # beyond the tokens: no grant, no decision, no flow id (the host goes ECMP)
            return w.Grant(msg.rid, self.epoch, self._ask(host, st, msg, now) if paid else [])
        if isinstance(msg, w.Extend):  # beyond the host's tokens: each lease it holds as it stands, not renewed
            return w.Extended(msg.rid, self.epoch, [self._extend(host, f, now) if paid else
                                                    self._left(st, f, now) for f in msg.flows])
        if isinstance(msg, w.Drop):
            # Released whatever is left of the host's tokens (a release only frees, and each
            # of its reservations was paid for), but only flows it holds: one set look-up each.
            for f in msg.flows:
                if f in st.live:
                    self._drop(host, f, now)
                elif f[0] != host:
                    self.counters.foreign += 1
                else:
                    self.counters.unknown += 1
            return w.Dropped(msg.rid, self.epoch)
        if isinstance(msg, w.Register):
            return w.Grant(msg.rid, self.epoch, [self._register(host, st, h, now, paid) for h in msg.held])
        return w.Pong(msg.rid, self.epoch)

    def _left(self, st: _Host, flow: FlowId, now: float) -> float:
        """What is left of a lease the host holds, -1 for any other flow (no renewal)."""
        e = self.table.get(flow) if flow in st.live else None
        if e is None or e.released is not None or e.end <= now or e.path is None:
            return -1.0
        return 86400.0 if self._lease is None else min(e.expires - now, 86400.0)

    def _ended(self, flow: FlowId) -> None:
        st = self._hosts.get(flow[0])
        if st is not None:
            st.live.discard(flow)

    def _host(self, host: int, now: float) -> _Host:
        st = self._hosts.get(host)
        if st is None:
            st = self._hosts[host] = _Host(float(self.limits.burst_per_host), now)
        return st

    def _within_rate(self, st: _Host, now: float, cost: int = 1) -> bool:
        """Take ``cost`` tokens (a message's parts or flows) if the host has them (at most
        a burst's worth is asked for; the rest is owed, paid back by the refill)."""
        lim = self.limits
        st.tokens = min(float(lim.burst_per_host), st.tokens + max(0.0, now - st.at) * lim.rate_per_host)
        st.at = max(st.at, now)
        if st.tokens < min(cost, lim.burst_per_host):
            return False
        st.tokens -= cost
        return True

    def _ask(self, host: int, st: _Host, msg: w.Ask, now: float) -> list[w.Part]:
        self.counters.asks += 1
        n_hosts = self.routes.n_hosts
        if msg.dst >= n_hosts or msg.dst == host:
            self.counters.invalid += 1
            return []
        q, r = divmod(msg.nbytes, msg.parts)
        parts: list[w.Part] = []
        avoid = msg.avoid
        for i in range(msg.parts):
            part = self._decide(host, st, msg.dst, msg.dport, q + (i < r), now, avoid, "")
            parts.append(part)
            if part.reserved:
                avoid |= 1 << part.path
        return parts

    def _decoded(self, decode_fn: Callable[[bytes], _M], data: bytes, known_sender: bool) -> _M | None:
        """The message, or None, counted as invalid: undecodable, or from a sender out of range."""
        try:
            if known_sender:
                return decode_fn(data)
        except w.ArbiterWireError:
            pass
        self.counters.invalid += 1
        return None

    def _flow(self, host: int) -> FlowId:
        if self._n >= (1 << SEQ_SHIFT) - 1 and not self._lead_anew():  # ids used up: lead on in a new epoch
            self._become(_FOLLOWING, self._last_ts)  # none left: stop leading (counted), never reuse an id
            raise CoreError("epoch: exhausted (2**30 epochs); the arbiter follows")
        self._n += 1
        return (host, self.epoch << SEQ_SHIFT | self._n)

    def _stamp(self, now: float) -> float:
        """Strictly increasing decision times: every insert is in key order."""
        ts = now if now > self._last_ts else math.nextafter(self._last_ts, INF)
        self._last_ts = ts
        return ts

    def _decide(self, host: int, st: _Host, dst: int, dport: int, nbytes: int, now: float, avoid: int, why: str,
                flow: FlowId | None = None, only: int = -1) -> w.Part:
        """One part: ``only`` >= 0 keeps it to that path (a registered lease whose port
        leads there) or plain ECMP."""
        flow = flow or self._flow(host)
        stages = self.table.stage_list(host, dst)
        if not stages:
            return self._ecmp(flow, SAME_LEAF)
        if not why:
            why = self._capped(host, st)
        if why:
            return self._ecmp(flow, why)
        n = len(stages[0])
        every = (1 << n) - 1
        if only >= n:
            self.counters.invalid += 1
            return self._ecmp(flow, "no such path")
        usable = 1 << only if only >= 0 else every & ~avoid or every
        path = self.table.lowest_free(self.table.pair_sids(host, dst), n, usable)
        shared = False
        if path is None:
            if self.policy not in SHARING_POLICIES:
                return self._ecmp(flow, NO_FREE_PATH)
            ts = now
            path, shared = least_backlogged(stages, n, lambda lk: self.table.link_backlog(lk, ts), usable), True
        return self._reserve(flow, dst, dport, path, nbytes, shared, now, st)

    def _capped(self, host: int, st: _Host) -> str:
        """Why ``host`` may reserve no more now ("" when it may): its live reservations, and
        what a follower retains of it (ended ones until forgotten), as on replicas."""
        lim = self.table.limits
        why = ""
        if len(st.live) >= lim.max_flows_per_host:
            why = f"cap: {lim.max_flows_per_host} live reservations"
        elif self.table.owner_count(host) >= lim.owner_retained:
            why = f"cap: {lim.owner_retained} reservations retained"
        self.counters.capped += bool(why)
        return why

    def _ecmp(self, flow: FlowId, why: str) -> w.Part:
        self.counters.ecmp += 1
        return w.Part(flow, 0, False, False, 0.0, why)

    def _reserve(self, flow: FlowId, dst: int, dport: int, path: int, nbytes: int, shared: bool, now: float,
                 st: _Host) -> w.Part:
        host = flow[0]
        rate = float(self._rate(host, dst, path))
        ts = self._stamp(now)
        lease_s = self._lease(nbytes, rate) if self._lease else INF
        msg = Reserve(flow, ts, host, dst, dport, path, 0, nbytes, rate, shared, ts + lease_s)
        self.table.insert(msg)
        self._changes.append(msg)
        st.live.add(flow)
        self.counters.granted += 1
        return w.Part(flow, path, True, shared, min(lease_s, 86400.0))

    def _owned(self, host: int, flow: tuple[int, int]) -> bool:
        if flow[0] != host:
            self.counters.foreign += 1
            return False
        return True

    def _extend(self, host: int, flow: tuple[int, int], now: float) -> float:
        """The lease left of ``flow`` after renewing it."""
        if not self._owned(host, flow):
            return -1.0
        e = self.table.get(flow)
        if e is None or e.released is not None or e.end <= now or e.path is None:
            self.counters.unknown += 1
            return -1.0
        if self._lease is None:
            return 86400.0
        ts = self._stamp(now)
        expires = ts + self._lease(e.msg.nbytes, e.msg.rate_bps)
        if expires > e.expires:
            msg = Renew(flow, ts, expires)
            self.table.apply_renew(e, msg)
            self._changes.append(msg)
        self.counters.renewed += 1
        return min(e.expires - now, 86400.0)

    def _drop(self, host: int, flow: tuple[int, int], now: float) -> None:
        if not self._owned(host, flow):
            return
        e = self.table.get(flow)
        if e is None or e.released is not None:
            self.counters.unknown += 1
            return
        msg = Release(flow, self._stamp(max(now, e.msg.ts)))
        self.table.apply_release(msg)
        self._ended(flow)
        self._changes.append(msg)
        self.counters.released += 1

    def _register(self, host: int, st: _Host, held: w.Held, now: float, paid: bool) -> w.Part:
        """A lease the host holds from an earlier leader: kept if this table holds it,
        else judged as a new request on its old path only (the host's port leads there;
        its id is kept): taken, shared, or plain ECMP (``paid`` False: beyond the host's
        tokens, rate limited)."""
        self.counters.registered += 1
        flow = held.flow
        if not self._owned(host, flow) or held.dst >= self.routes.n_hosts or held.dst == host:
            self.counters.invalid += 1
            return w.Part(flow, 0, False, False, 0.0, "refused")
        e = self.table.get(flow)
        if e is not None and e.released is None and e.end > now and e.path is not None:
            st.live.add(flow)
            return w.Part(flow, e.path, True, e.shared, min(e.end - now, 86400.0))
        if e is not None or flow[1] >> SEQ_SHIFT >= self.epoch:
            # Ended here, or an id of this epoch or a later one that this table never held: not a real lease.
            self.counters.unknown += 1
            return w.Part(flow, 0, False, False, 0.0, "unknown")
        why = "" if paid else RATE_LIMITED
        return self._decide(host, st, held.dst, held.dport, held.nbytes, now, 0, why, flow=flow, only=held.path)

    def _reply(self, host: int, msg: w.ToHost) -> ArbiterOut:
        return ArbiterOut(host, -1, w.encode(msg))

    # ------------------------------------------------------------------ arbiters
    def _to_arbiters(self, msg: w.Between) -> list[ArbiterOut]:
        data = w.encode(msg)
        return [ArbiterOut(-1, r, data) for r in range(self.arbiters) if r != self.rank]

    def on_arbiter(self, rank: int, data: bytes, now: float) -> list[ArbiterOut]:
        """One message from arbiter ``rank`` (the transport authenticated it)."""
        self._note(now)
        msg = self._decoded(w.decode_between, data, 0 <= rank < self.arbiters and rank != self.rank)
        if msg is None:
            return []
        if msg.epoch % self.arbiters != rank:  # an epoch is its leader's: rank r leads only epochs = r mod n
            self.counters.invalid += 1
            return []
        if msg.epoch > max(self.seen_epoch, self.epoch) + self.limits.max_epoch_jump:
            self.counters.epoch_jumps += 1  # no leader gets there in steps of a generation: a forged epoch
            return []
        if isinstance(msg, w.SyncAsk):
            return self._sync_reply(rank) if self.leading else []
        leader = isinstance(msg, w.Changes | w.SyncPart) or (isinstance(msg, w.Beat) and msg.leading)
        if not leader:
            if isinstance(msg, w.Beat):
                self._acknowledged(rank, msg)
            return []
        if msg.epoch < self.seen_epoch or (msg.epoch == self.epoch and self.leading):
            return []  # an old leader (it steps down when it hears our beat)
        if self.leading:
            self._become(_FOLLOWING, now, msg.epoch)
        self.seen_epoch = msg.epoch
        self._leader_heard = now
        if msg.epoch != self._heard[0]:
            self._heard, self._needed_by = (msg.epoch, -1.0), -1  # a new leader: what its lease takes, unknown yet
        if isinstance(msg, w.Beat):
            return self._heard_beat(rank, msg, now)
        if isinstance(msg, w.SyncPart):
            self._apply_sync(msg)
            return []
        if isinstance(msg, w.Changes):
            if self.synced and msg.epoch == self._following and msg.at == self._applied:
                self._apply(msg.msgs)
                self._applied += len(msg.msgs)
                return []
            if self.synced:  # a gap in the stream (a reconnect lost some): fetch the whole table
                self.counters.gaps += 1
                self.synced = False
            return self._ask_sync(rank, msg.epoch, now)
        return []

    def _heard_beat(self, rank: int, msg: w.Beat, now: float) -> list[ArbiterOut]:
        """The leader's beat: acknowledged at once (its lease runs from when it was sent)."""
        self._heard = (msg.epoch, max(self._heard[1], msg.sent))
        self._needed_by = rank if msg.needs >> self.rank & 1 else -1
        out = self._to_rank(rank, self._beat(now))
        if not self.synced or msg.epoch != self._following:
            out += self._ask_sync(rank, msg.epoch, now)
        return out

    def _acknowledged(self, rank: int, msg: w.Beat) -> None:
        """A follower's beat: an acknowledgement of one of this leader's beats renews the
        lease from when that beat was sent; a rank that acknowledges is needed from then on."""
        if self.leading and msg.echo_epoch == self.epoch and 0 <= msg.echo <= self._beat_sent:
            self._acked[rank] = max(self._acked.get(rank, -INF), msg.echo)
            self._needs.add(rank)

    def _ask_sync(self, rank: int, epoch: int, now: float) -> list[ArbiterOut]:
        # Asked already: wait for the answer, two beats; the SyncAsk or a SyncPart may be
        # lost (a one-way cut, a reconnect), and an unsynced follower would lead on part of
        # the table.
        if self._syncing and epoch == self._following and now - self._sync_asked < 2 * self.heartbeat_s:
            return []
        self._syncing, self._following, self.synced = True, epoch, False
        self._sync_asked = now
        return self._to_rank(rank, w.SyncAsk(self.epoch))

    def _to_rank(self, rank: int, msg: w.Between) -> list[ArbiterOut]:
        return [ArbiterOut(-1, rank, w.encode(msg))]

    def _sync_reply(self, rank: int) -> list[ArbiterOut]:
        self.counters.syncs += 1
        msgs = [encode(m) for m in self.table.snapshot()]
        step = w.MAX_CHANGES_PER_MESSAGE
        chunks = [msgs[i:i + step] for i in range(0, len(msgs), step)] or [[]]
        # The stream's position travels with the snapshot: the follower takes Changes from there.
        return [ArbiterOut(-1, rank, w.encode(w.SyncPart(self.epoch, i == 0, i == len(chunks) - 1, self._sent, c)))
                for i, c in enumerate(chunks)]

    def _apply_sync(self, msg: w.SyncPart) -> None:
        if msg.first:
            self.table = self._new_table()
            self._hosts = {}
            self._syncing, self._sync_at = True, msg.at
        if not self._syncing or msg.at != self._sync_at:  # a part of an earlier answer (asked again)
            return
        self._apply(msg.msgs)
        if msg.last:
            self._syncing, self.synced, self._applied = False, True, msg.at

    def _apply(self, msgs: list[bytes]) -> None:
        for raw in msgs:
            try:
                m = decode(raw)
            except ProtocolError:
                self.counters.invalid += 1
                continue
            self.table.receive(m)
            self.counters.changes_applied += 1
            if isinstance(m, Reserve):
                self._last_ts = max(self._last_ts, m.ts)
        self.table.settle()
        self.table.take_changed()

    def _recount(self, now: float) -> None:
        """Live flows per host, from the table: a follower's caps when it takes over."""
        for st in self._hosts.values():
            st.live = set()
        for f in self.table.entries():
            e = self.table.get(f)
            if e is not None and e.released is None and e.end > now:
                self._host(f[0], now).live.add(f)

    # ------------------------------------------------------------------ views
    def status(self, now: float | None = None) -> dict[str, object]:
        """``flows``: reservations in the table (ended ones until forgotten); ``live``
        (given ``now``): those neither released nor expired."""
        st: dict[str, object] = {"rank": self.rank, "epoch": self.epoch, "seen_epoch": self.seen_epoch,
                                 "role": self.role, "synced": self.synced, "flows": len(self.table.table())}
        if now is not None:
            st["lease"] = self.leading and self._lease_held(now)  # answering hosts now
            st["live"] = sum(1 for f in self.table.entries() if (e := self.table.get(f)) is not None
                             and e.released is None and e.end > now)
        st["counters"] = dict(self.counters.__dict__)
        return st


def _cost(msg: w.FromHost) -> int:
    """A fresh message's tokens: one per part asked, flow named or lease registered, and
    never less than one, whatever it turns out to need."""
    if isinstance(msg, w.Ask):
        n = msg.parts
    elif isinstance(msg, w.Extend | w.Drop):
        n = len(msg.flows)
    elif isinstance(msg, w.Register):
        n = len(msg.held)
    else:
        n = 1
    return max(1, n)
