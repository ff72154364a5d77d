"""A host's side of the arbiter protocol: which arbiter to ask, retries, fallback, epochs.

Sans-IO, ``now`` passed in: :meth:`ArbiterLink.ask`, :meth:`~ArbiterLink.extend` and
:meth:`~ArbiterLink.drop` turn a request into bytes for one arbiter; answers go in through
:meth:`~ArbiterLink.on_arbiter`, timers through :meth:`~ArbiterLink.tick`; finished requests
come out of :meth:`~ArbiterLink.take_done`, each with the caller's tag and the answer, or
``None`` when no arbiter answered (the caller then goes on with plain ECMP).

Rules:

* a request goes to the arbiter that answered last; ``Refused`` naming a leader sends it
  there at once (same request id: an arbiter that already answered it answers the same);
  no answer within ``timeout_s`` sends it to the next arbiter; when every arbiter has been
  tried, it is finished unanswered;
* after an unanswered request the link is *down*: new requests finish unanswered at once
  (no wait), and every arbiter is pinged each ``probe_s`` until one leads;
* an answer of an epoch below the highest this host has seen comes from an old leader and
  is dropped (its request goes on to the next arbiter), unless nothing of that highest
  epoch has been heard for ``forget_epoch_s`` (both arbiters restarted and begin again
  below it: by then every lease the old epoch granted has ended);
* an answer of an epoch more than ``max_epoch_jump`` above the highest seen is dropped and
  counted (no leader gets there in steps of a generation; it would make this host refuse
  the real leader), and so is an answer that does not fit its request (a grant of more
  parts than were asked, or of flows not registered; another kind of answer): the request
  goes on to the next arbiter;
* an answer of a new leader (an epoch above the highest seen) makes the host hand in the
  leases it holds from earlier epochs (``Register``, from the ``held`` callback), so that
  the new leader knows them; its answer says which the host still holds. It also tells the
  new leader again of the releases of earlier epochs' flows made within ``forget_epoch_s``
  (an old leader may have acknowledged one and died before its follower heard it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ark.core import arbiter_wire as w
from ark.core.messages import FlowId
from ark.core.node import Lease, Node
from ark.core.table import CoreError

NO_ARBITER = "no arbiter answered"
MAX_PENDING = 65536  # requests in flight; beyond: finished unanswered at once


class LinkOut(NamedTuple):
    """Bytes for arbiter ``rank``."""

    rank: int
    data: bytes


class Done(NamedTuple):
    """A finished request: the caller's ``tag`` and the answer (None: no arbiter answered);
    ``asked_at``: when the request was first sent."""

    tag: Hashable
    answer: w.Grant | w.Extended | w.Dropped | w.Pong | None
    asked_at: float = -math.inf

    def left(self, lease_s: float, now: float) -> float:
        """What is left at ``now`` of a lease the answer gave ``lease_s`` for. The arbiter's
        lease began when it decided, which is after the request was first sent (a retry can
        get an answer kept from the first try): counted from then, the host's lease never
        outlives the arbiter's, however long the answer took."""
        return max(0.0, lease_s - max(0.0, now - self.asked_at))


@dataclass
class LinkCounters:
    sent: int = 0
    answered: int = 0
    unanswered: int = 0  # finished with no arbiter's answer: the caller fell back to ECMP
    timeouts: int = 0
    refused: int = 0
    redirected: int = 0  # sent on to the leader a Refused named
    stale_epoch: int = 0  # answers of an epoch below the highest seen: dropped
    epoch_forgotten: int = 0  # the highest epoch given up after forget_epoch_s of silence
    invalid: int = 0
    epoch_jumps: int = 0  # answers more than max_epoch_jump above the highest epoch seen: dropped
    misfits: int = 0  # answers that do not fit their request (more parts than asked, ...): dropped
    unknown_rid: int = 0  # answers to no request in flight (late, duplicated)
    registered: int = 0  # leases handed in to a new leader
    leaders: int = 0  # changes of the arbiter answering


@dataclass
class _Pending:
    tag: Hashable
    msg: w.FromHost
    rank: int
    sent_at: float  # the last time it was sent (to ``rank``)
    asked_at: float  # the first time
    tried: set[int] = field(default_factory=set)


class ArbiterLink:
    """One host's link to ``arbiters`` ranked arbiters. ``incarnation``: the host process's,
    at most 2**30 - 1; request ids start at ``incarnation << 32`` so that a restarted host
    never reuses an id the arbiter kept an answer for (it would get that answer again)."""

    def __init__(self, arbiters: int, *, timeout_s: float = 0.1, probe_s: float = 0.2, forget_epoch_s: float = 30.0,
                 held: Callable[[float], list[w.Held]] | None = None, incarnation: int = 0,
                 max_epoch_jump: int = 1 << 16) -> None:
        if not 1 <= arbiters <= 16:
            raise CoreError(f"arbiters: must be 1..16; got {arbiters}")
        for name, v in (("timeout_s", timeout_s), ("probe_s", probe_s), ("forget_epoch_s", forget_epoch_s)):
            if not (math.isfinite(v) and v > 0):
                raise CoreError(f"{name}: must be a finite number > 0; got {v}")
        if not 0 <= incarnation < 1 << 30:
            raise CoreError(f"incarnation: must be 0..{(1 << 30) - 1}; got {incarnation}")
        if not 1 <= max_epoch_jump < 1 << 30:
            raise CoreError(f"max_epoch_jump: must be 1..{(1 << 30) - 1}; got {max_epoch_jump}")
        self.max_epoch_jump = max_epoch_jump
        self.arbiters = arbiters
        self.timeout_s, self.probe_s, self.forget_epoch_s = timeout_s, probe_s, forget_epoch_s
        self._held = held or (lambda now: [])
        self.counters = LinkCounters()
        self.leader = 0  # the rank asked first
        self.epoch = 0  # the highest epoch heard
        self._epoch_heard = -math.inf
        self.up = True  # False after an unanswered request, until an arbiter leads again
        self.down_since: float | None = None
        self.down_s = 0.0  # time spent down, in total
        self._rid = incarnation << 32
        self._pending: dict[int, _Pending] = {}
        self._done: list[Done] = []
        self._next_probe = math.inf
        self._pings: set[int] = set()
        self._undropped: list[tuple[int, int]] = []  # releases no arbiter took (sent to the next leader)
        # Releases a leader acknowledged: a leader that dies before its follower hears one
        # leaves the new leader holding the path until the lease ends, so each is told again
        # to the next leader while its lease could still run (bounded: the oldest go first).
        self._released: deque[tuple[float, tuple[int, int]]] = deque(maxlen=MAX_PENDING)

    # ------------------------------------------------------------------ requests
    def ask(self, tag: Hashable, dst: int, nbytes: int, dport: int, parts: int, now: float) -> list[LinkOut]:
        return self._request(tag, w.Ask(self._next_rid(), self.epoch, dst, nbytes, dport, parts), now)

    def extend(self, tag: Hashable, flows: list[tuple[int, int]], now: float) -> list[LinkOut]:
        return self._chunks(tag, flows, lambda chunk: w.Extend(self._next_rid(), self.epoch, chunk), now)

    def drop(self, flows: list[tuple[int, int]], now: float) -> list[LinkOut]:
        """Release at the arbiter; nobody waits for it (unanswered, the lease ends there)."""
        self._released.extend((now, f) for f in flows)
        return self._chunks(None, flows, lambda chunk: w.Drop(self._next_rid(), self.epoch, chunk), now)

    def _chunks(self, tag: Hashable, flows: list[tuple[int, int]], make: Callable[[list[tuple[int, int]]], w.FromHost],
                now: float) -> list[LinkOut]:
        if not flows:
            raise CoreError("flows: at least one")
        if len(flows) > w.MAX_FLOWS_PER_MESSAGE:
            raise CoreError(f"flows: at most {w.MAX_FLOWS_PER_MESSAGE} in one request; got {len(flows)}")
        return self._request(tag, make(flows), now)

    def _chunks_of(self, tag: Hashable, flows: list[tuple[int, int]],
                   make: Callable[[list[tuple[int, int]]], w.FromHost], now: float) -> list[LinkOut]:
        step = w.MAX_FLOWS_PER_MESSAGE
        return [o for i in range(0, len(flows), step) for o in self._request(tag, make(flows[i:i + step]), now)]

    def hello(self, rank: int) -> list[LinkOut]:
        """A ping for arbiter ``rank`` on a new connection, whose answer finishes nothing
        (an arbiter counts a connection as this host's once it has spoken)."""
        rid = self._next_rid()
        if len(self._pings) >= 1024:  # unanswered ones (bounded: an arbiter may never answer)
            self._pings.clear()
        self._pings.add(rid)
        return [LinkOut(rank, w.encode(w.Ping(rid, self.epoch)))]

    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _request(self, tag: Hashable, msg: w.FromHost, now: float) -> list[LinkOut]:
        if not self.up or len(self._pending) >= MAX_PENDING:
            self._finish(tag, None, now)
            if isinstance(msg, w.Drop) and len(self._undropped) < MAX_PENDING:
                self._undropped.extend(msg.flows)  # sent to the leader found next (its epoch may be this one)
            return []
        p = self._pending[msg.rid] = _Pending(tag, msg, self.leader, now, now)
        return self._send(p, now)

    def _send(self, p: _Pending, now: float) -> list[LinkOut]:
        p.tried.add(p.rank)
        p.sent_at = now
        self.counters.sent += 1
        return [LinkOut(p.rank, w.encode(p.msg))]

    def _finish(self, tag: Hashable, answer: w.Grant | w.Extended | w.Dropped | w.Pong | None,
                asked_at: float) -> None:
        if answer is None:
            self.counters.unanswered += 1
        else:
            self.counters.answered += 1
        if tag is not None:
            self._done.append(Done(tag, answer, asked_at))

    def take_done(self) -> list[Done]:
        done, self._done = self._done, []
        return done

    # ------------------------------------------------------------------ answers
    def on_arbiter(self, rank: int, data: bytes, now: float) -> list[LinkOut]:
        """One message from arbiter ``rank`` (the transport authenticated it)."""
        try:
            if not 0 <= rank < self.arbiters:
                raise w.ArbiterWireError("rank")
            msg = w.decode_to_host(data)
        except w.ArbiterWireError:
            self.counters.invalid += 1
            return []
        if self.epoch and msg.epoch > self.epoch + self.max_epoch_jump:
            self.counters.epoch_jumps += 1
            return []
        if not self._current(msg.epoch, now):
            self.counters.stale_epoch += 1
            return []
        if isinstance(msg, w.Refused):
            return self._on_refused(rank, msg, now)
        p = self._pending.get(msg.rid)
        if p is not None and not _fits(p.msg, msg):  # from whichever arbiter: a late answer too
            self.counters.misfits += 1
            return self._next(p, now) if p.rank == rank else []  # another's: the request waits on
        out = self._leads(rank, msg.epoch, now)
        if msg.rid in self._pings:
            self._pings.discard(msg.rid)
            return out
        p = self._pending.pop(msg.rid, None)
        if p is None:
            self.counters.unknown_rid += 1
            return out
        self._finish(p.tag, msg, p.asked_at)
        return out

    def _current(self, epoch: int, now: float) -> bool:
        """Is an answer of ``epoch`` from a leader this host may believe?"""
        if epoch >= self.epoch:
            return True
        if now - self._epoch_heard > self.forget_epoch_s:  # both arbiters began again below it
            self.counters.epoch_forgotten += 1
            self.epoch = epoch
            return True
        return False

    def _leads(self, rank: int, epoch: int, now: float) -> list[LinkOut]:
        """``rank`` answered as leader with ``epoch``: ask it from now on; a new epoch (or
        an arbiter found after none answered) gets this host's older leases registered."""
        newer = epoch > self.epoch
        self.epoch = max(self.epoch, epoch)
        self._epoch_heard = now
        if rank != self.leader:
            self.leader = rank
            self.counters.leaders += 1
        came_up = not self.up
        if came_up:
            self.up = True
            assert self.down_since is not None
            self.down_s += now - self.down_since
            self.down_since = None
            self._next_probe = math.inf
        return self._register(now) if newer or came_up else []

    def _register(self, now: float) -> list[LinkOut]:
        """Hand the new leader the leases held from earlier epochs, and the releases no
        arbiter took."""
        undropped, self._undropped = self._undropped, []
        while self._released and now - self._released[0][0] >= self.forget_epoch_s:  # every lease it had is over
            self._released.popleft()
        again = [f for _, f in self._released if f[1] >> 32 < self.epoch]
        undropped = list(dict.fromkeys([*undropped, *again]))
        out = self._chunks_of(None, undropped, lambda chunk: w.Drop(self._next_rid(), self.epoch, chunk), now)
        held = [h for h in self._held(now) if h.flow[1] >> 32 < self.epoch]
        step = w.MAX_FLOWS_PER_MESSAGE
        for i in range(0, len(held), step):
            chunk = held[i:i + step]
            self.counters.registered += len(chunk)
            out += self._request(("register", tuple(h.flow for h in chunk)), w.Register(self._next_rid(), self.epoch,
                                                                                     chunk), now)
        return out

    def _on_refused(self, rank: int, msg: w.Refused, now: float) -> list[LinkOut]:
        self.counters.refused += 1
        if msg.rid in self._pings:
            self._pings.discard(msg.rid)
            return []
        p = self._pending.get(msg.rid)
        if p is None or p.rank != rank:
            self.counters.unknown_rid += p is None
            return []
        to = msg.leader if 0 <= msg.leader < self.arbiters and msg.leader not in p.tried else None
        if to is not None:
            self.counters.redirected += 1
        return self._next(p, now, to)

    def _next(self, p: _Pending, now: float, to: int | None = None) -> list[LinkOut]:
        """Send ``p`` to ``to`` or the next arbiter not tried yet; none left: unanswered."""
        if to is None:
            to = next((r for r in ((p.rank + i) % self.arbiters for i in range(1, self.arbiters))
                       if r not in p.tried), None)
        if to is None:
            del self._pending[p.msg.rid]
            self._finish(p.tag, None, p.asked_at)
            if isinstance(p.msg, w.Drop) and len(self._undropped) < MAX_PENDING:
                self._undropped.extend(p.msg.flows)  # the next leader may hold them: told when found
            self._go_down(now)
            return []
        p.rank = to
        return self._send(p, now)

    def _go_down(self, now: float) -> None:
        if self.up:
            self.up = False
            self.down_since = now
            self._next_probe = now

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[LinkOut]:
        """Requests past ``timeout_s`` go on to the next arbiter; probes while down."""
        out: list[LinkOut] = []
        # The same sum as next_deadline's: now - sent_at >= timeout_s can be false at that
        # deadline (rounding), and the caller's timer would fire again and again.
        for p in [p for p in self._pending.values() if now >= p.sent_at + self.timeout_s]:
            self.counters.timeouts += 1
            out += self._next(p, now)
        if not self.up and now >= self._next_probe:
            self._next_probe = now + self.probe_s
            self._pings = set()
            for r in range(self.arbiters):
                rid = self._next_rid()
                self._pings.add(rid)
                out.append(LinkOut(r, w.encode(w.Ping(rid, self.epoch))))
        return out

    def next_deadline(self) -> float:
        t = self._next_probe if not self.up else math.inf
        if self._pending:
            t = min(t, min(p.sent_at for p in self._pending.values()) + self.timeout_s)
        return t

    def status(self, now: float) -> dict[str, object]:
        return {"leader": self.leader, "epoch": self.epoch, "up": self.up, "pending": len(self._pending),
                "down_s": round(self.down_s + (now - self.down_since if self.down_since is not None else 0.0), 3),
                "counters": dict(vars(self.counters))}


def _fits(asked: w.FromHost, answer: w.ToHost) -> bool:
    """Is ``answer`` one an arbiter gives to ``asked``: its kind, no more parts than were
    asked for, only flows that were registered, a lease per renewed flow?"""
    if isinstance(asked, w.Ask):
        return isinstance(answer, w.Grant) and len(answer.parts) <= asked.parts
    if isinstance(asked, w.Register):
        named = {h.flow for h in asked.held}
        return isinstance(answer, w.Grant) and len(answer.parts) <= len(named) and all(
            p.flow in named for p in answer.parts)
    if isinstance(asked, w.Extend):
        return isinstance(answer, w.Extended) and len(answer.lease_s) == len(asked.flows)
    return isinstance(answer, w.Dropped if isinstance(asked, w.Drop) else w.Pong)


# ---------------------------------------------------------------------- answers on a node
# What a host does with an arbiter's answers, on its Node (which keeps its flows' ports and
# leases): one place for the agent (ark.agent.arbiter_link) and the fault harness.
NOT_HELD = "not held by the arbiter"


class Placed(NamedTuple):
    """A grant part on this host: its ``lease``; ``drop``: flows the arbiter holds for
    nothing (release them there); ``bad``: the part named an id this node cannot take."""

    lease: Lease
    drop: list[FlowId]
    bad: bool = False


def place_part(node: Node, part: w.Part | None, dst: int, nbytes: int, dport: int, now: float,
               lease_s: float | None = None) -> Placed:
    """One part's lease: on the granted path with a port of this host's maps; plain ECMP
    under the arbiter's id when it reserved nothing, or under one of the node's own when no
    arbiter answered (``part`` None) or its id cannot be taken (not this host's, or held).
    ``lease_s``: what is left of the part's lease (default: all of it)."""
    if part is not None:
        left = part.lease_s if lease_s is None else lease_s
        try:
            lease = node.place(part.flow, dst, nbytes, now, dport, part.path if part.reserved else None,
                               shared=part.shared, lease_s=left, why=part.why)
        except CoreError:
            mine = part.reserved and part.flow[0] == node.host
            return Placed(node.reserve(dst, nbytes, now, dport, unreserved=NO_ARBITER)[0],
                          [part.flow] if mine else [], True)
        # No port of that path free here: the arbiter need not keep it.
        return Placed(lease, [part.flow] if part.reserved and not lease.reserved else [])
    return Placed(node.reserve(dst, nbytes, now, dport, unreserved=NO_ARBITER)[0], [])


def renewed_lease(node: Node, flow: FlowId, lease_s: float | None, answered: bool, now: float) -> Lease:
    """A flow's lease after a renewal: ``lease_s`` is the arbiter's answer for it (-1: it
    does not hold it; None: it was not asked, or ``answered`` False: nobody answered). Not
    the arbiter's (ECMP): renewed here. No answer: as it stands, never extended."""
    r = node.resolve(flow)
    if lease_s is not None and lease_s >= 0:
        return node.extend_to(r, lease_s, now)
    if lease_s is not None and answered:
        return node.unreserve(r, NOT_HELD, now)
    local = node.core.local_flows().get(r)
    return node.renew(flow, now)[0] if not (local and local[3]) else node.lease_of(flow, now)


def apply_registration(node: Node, flows: Sequence[FlowId], answer: object, now: float,
                       left: Callable[[float], float] = lambda s: s) -> tuple[list[FlowId], list[FlowId]]:
    """A new leader's verdict on this host's registered leases: kept on their path (their
    lease extended by ``left(lease_s)``), or unreserved. Returns (kept, lost): lost are
    those the leader reserved elsewhere, to be released there. A flow it did not answer
    stands until its lease ends (and is registered again with the next leader)."""
    parts = {p.flow: p for p in answer.parts} if isinstance(answer, w.Grant) else {}
    kept: list[FlowId] = []
    lost: list[FlowId] = []
    for f in flows:
        local = node.core.local_flows().get(f)
        p = parts.get(f)
        if local is None or not local[3] or p is None:
            continue
        if p.reserved and p.path == local[1]:
            node.extend_to(f, left(p.lease_s), now)
            kept.append(f)
        else:
            node.unreserve(f, p.why or NOT_HELD, now)
            if p.reserved:
                lost.append(f)
    return kept, lost


def held_leases(node: Node, now: float) -> list[w.Held]:
    """The node's live reservations, as a registration names them."""
    return [w.Held(f, dst, dport, path, nbytes, shared, min(left, 86400.0))
            for f, dst, dport, path, nbytes, shared, left in node.reserved_leases(now)]
