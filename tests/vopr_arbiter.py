"""A deterministic fault harness (VOPR-style) for the arbiter mode.

Hosts keep no replica: each is a :class:`~ark.core.node.Node` with no peers (its own flows'
ports and leases) and an :class:`~ark.core.arbiter_host.ArbiterLink`, glued together as
the agent glues them (:class:`ark.agent.arbiter_link.ArbiterForwarder`: ``_granted``,
``_part_lease``, ``renew``/``_renewed``, ``_registered``; a release is a ``Drop`` of the
reserved parts, then ``Node.release``). One to three :class:`~ark.core.arbiter.Arbiter`
decide for them. Six hosts on three leaves, three paths between leaves.

One seed fixes everything: how many arbiters (two in 5/8 of the seeds, three in 2/8, one
in 1/8), the policy (``ark``; a third ``ark-balance``), ``arbiter_timeout_s`` (``TIMEOUT``;
a third twice that), the fault mix and the workload. Time is simulated: one event heap
of messages, timers, client actions and faults; every arbiter's and host's timer fires at
its ``next_deadline``. ``python -m tests.vopr_arbiter SEED`` reruns a seed and prints its
trace.

Faults (each seed draws its mix, :class:`Faults`):

* messages: lost (0, 1, 5 or 20 %), held back up to ``SLOW_MAX`` (0, 1 or 5 %), delayed
  by up to 5 ms plus up to 10 ms of jitter. Between a host and an arbiter they are also
  duplicated (0, 2 or 10 %) and reordered; between two arbiters (one TCP connection each
  way under ZeroMQ) they keep their order and are never duplicated;
* clocks: each arbiter off true time by up to 2 ms (hosts and arbiters exchange durations);
* partitions (half the seeds, 5 % of the steps, healed after 0.05-1.5 s): a host cut from
  one arbiter or from all, the arbiters cut from each other (three times in ten one way
  only), split brain (each host reaches one arbiter, the arbiters not each other);
* arbiter crashes (60 % of the seeds, 3 % of the steps), the leader four times in five;
  seven in ten restart 0.2-2 s later as a restarted ``ark arbiter`` does: an empty table,
  and the epoch it kept (the highest it led or heard of);
* host crashes (40 % of the seeds, 3 % of the steps): its flows are never released nor
  renewed; seven in ten restart 0.05-1.5 s later with a new incarnation and a fresh link;
* pauses (half the seeds, 3 % of the steps): a process stopped for 0.05 s to ``PAUSE_MAX``
  (SIGSTOP, a GC pause, a VM stall), an arbiter six times in ten (the leader three times in
  four), else a host. It handles nothing meanwhile and its clock runs on; what came for it
  is handed over on resuming as a ZeroMQ ROUTER does (each sender's in order, the senders
  in turn), before its timers fire. With the partitions between the arbiters above (hosts
  reaching both), this is what a leader lease is for.

The workload (40 % of the steps): an ask from a random host to one on another leaf, of
one part or (a third) of 2-5 parts; three in four clients renew every third of the
shortest lease; each is released after 0.01-1.2 s; 5 % of the steps a client dies: its
flows are never released and must expire. Twice per run (after 45 and 90 steps) a quiet
point: faults off, everything healed and restarted, the workload held.

Invariants (a violation raises :class:`Violation` naming the seed):

1. *One exclusive holder per link in the current epoch.* After every event, no live
   arbiter's table has a link held by two flows one of which claims it alone
   (``exclusive_conflicts`` at its clock; under ``ark-balance``, two that claim it alone).
   Across hosts, after every event that changes what hosts hold or what the leader holds:
   among the flows live hosts hold as reserved (lease not over by their clock) whose ids
   carry the highest epoch an arbiter leads with, no link has two exclusive holders, and
   that leader holds each of them on the same path (its links, the grace included).
   Across epochs: two exclusive holders of a link under different epochs, where the older
   one's lease was set by an answer that left its arbiter after the newer epoch's first
   answer, is a violation (an old leader answered from a stale table); one that left
   before is the window the design allows (granted within its leader's lease, not in the
   new leader's table: changes lost with a cut or a crash), counted (``cross_epoch``).
2. *A dead host's leases end everywhere* within :data:`DEAD_BOUND` of its crash: no live
   arbiter's table holds one of its flows live after that.
3. *ECMP without an arbiter, and recovery.* Every ask finishes within ``arbiters x
   arbiter_timeout_s`` (each arbiter tried once; plus the time its host was stopped); one no arbiter answered gives leases of
   plain ECMP that say ``no arbiter answered``. An ask begun :func:`recover_bound` after
   the last fault (a message lost, duplicated, or held back until it arrives; a partition
   begun, lasting or healed; an arbiter crashed or restarted; no arbiter running; a
   leader whose lease needs a crashed arbiter; a process stopped, until it resumes) is
   answered, unless its host has heard of an epoch above every live arbiter's: then
   ``FORGET`` later (it refuses the lower epoch that long, by design).
4. *At quiet points* (partitions healed, crashed arbiters and hosts restarted, faults off
   for :func:`recover_bound` after the last one, nothing in flight but beats): exactly one
   arbiter leads, the others follow it synced, and a follower's table equals the leader's
   (same live flows, paths and shared flags); an ask from every live host is answered by
   that leader (its epoch); the leader holds every reserved local flow of every live host
   on the same path.
5. *No takeover from a heard leader.* An arbiter starts to lead while the leader of the
   highest epoch is alive, has led for a takeover period and no message between arbiters
   was lost or held back (nor a cut between them) in that period: a violation (the old
   leader steps down and takes the new one's table, whatever that lacks).
6. *Leaders answer in turn.* Once an answer of some epoch has left an arbiter (true time),
   no answer of a lower epoch leaves any arbiter (a leader answers only within its lease,
   and a follower leads only after that lease has surely ended).
"""

from __future__ import annotations

import heapq
import math
import random
import sys
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ark.core import arbiter_wire as w
from ark.core.arbiter import Arbiter, ArbiterOut
from ark.core.arbiter_host import (
    NO_ARBITER,
    ArbiterLink,
    Done,
    LinkOut,
    apply_registration,
    held_leases,
    place_part,
    renewed_lease,
)
from ark.core.lease import LeasePolicy
from ark.core.messages import FlowId
from ark.core.node import Lease, Node
from ark.core.pathmap import PathMapCache
from ark.core.table import CoreError
from ark.core.topology import spine_leaf

FABRIC = spine_leaf(leaves=3, spines=3, gpus_per_leaf=2, hash="crc32")
MAPS = PathMapCache(FABRIC)
N = FABRIC.n_hosts
STAGES = {(s, d): FABRIC.stages(s, d) for s in range(N) for d in range(N) if s != d}
DPORT = 4791

# The real defaults halved: takeover_s 1.0, beats and probes every takeover_s / 5,
# arbiter_timeout_s 0.1 (a third of the seeds: 0.2), the arbiter's expiry grace 0.25.
TAKEOVER = 0.5
BEAT = TAKEOVER / 5
PROBE = TAKEOVER / 5
TIMEOUT = 0.05
GRACE = 0.125
LEASE = LeasePolicy(min_s=0.3, slack=2.0, max_s=1.5)
FORGET = LEASE.max_s + TAKEOVER  # forget_epoch_s, as the agent sets it
RETENTION = 2.0
NBYTES = (10**6, 10**8, 10**9)
LONGEST_LEASE = LEASE(max(NBYTES), min(FABRIC.path_rate_bps(0, 2, p) for p in range(3)))
RENEW_EVERY = LEASE.min_s / 3
GRANT_TAG, REFUSED_TAG, BEAT_TAG = 11, 15, 21  # a message's second byte: its kind (after the array's header)
PAUSE_MAX = 2.0  # a process stopped up to this long (four takeover periods)

# Message timing: a base delay plus jitter, and now and then a message held back up to
# SLOW_MAX more (a retransmission or two: longer than the grace). D_MAX bounds how long any
# message can be in flight, D_FAST one that is not held back.
MAX_DELAY, MAX_JITTER, SLOW_MAX = 5e-3, 10e-3, 0.3
D_FAST = MAX_DELAY + MAX_JITTER
D_MAX = D_FAST + SLOW_MAX
MAX_SKEW = 2e-3  # arbiters' clock offsets are within +-MAX_SKEW

# Invariant 2. A dead host sends nothing more, but what it sent may still arrive: a renewal,
# a registration or an ask delivered up to D_MAX after the crash starts a lease of at most
# LONGEST_LEASE there (from the arbiter's decision, by its clock); a follower judges the
# leader's times by its own clock (2 x MAX_SKEW apart at most). "Live" is the table's own
# verdict at the arbiter's clock (``table(at=now)``: stamped at or before, ending after):
# the links stay counted GRACE longer, which only errs on the safe side. A takeover does not stretch
# it: a new leader keeps the leases it followed with their end and renews none on its own.
DEAD_BOUND = D_MAX + LONGEST_LEASE + 2 * MAX_SKEW


def recover_bound(arbiters: int, timeout: float) -> float:
    """Invariant 3: how long after the last fault an ask must be answered.

    A follower leads ``TAKEOVER + 2 x rank x BEAT`` after the last beat it heard of a
    leader (at most ``BEAT`` before the fault) and tells the other arbiters at once (a
    leader of a lower epoch steps down on that beat, another ``BEAT`` at most); a down
    link pings every ``PROBE`` and is up on the first leader's answer; a request already
    out when the fault struck takes at most ``arbiters x timeout`` to finish; each of
    these steps may wait for a message in flight (``D_FAST``: a message held back counts
    as a fault until it arrives).
    """
    return TAKEOVER + (2 * (arbiters - 1) + 2) * BEAT + PROBE + arbiters * timeout + 6 * D_FAST




class Violation(AssertionError):
    pass


def two_exclusive(table: Any, held: dict[FlowId, tuple[int, bool]]) -> list[int]:
    """Links with two holders that claim them alone (a shared flow may sit on any link
    under the sharing policies; ``exclusive_conflicts`` judges them under ``ark``)."""
    users: dict[int, int] = {}
    for f, (path, shared) in held.items():
        if not shared:
            for lk in table.links(table.get(f).msg, path):
                users[lk] = users.get(lk, 0) + 1
    return sorted(lk for lk, n in users.items() if n > 1)


@dataclass
class Faults:
    loss: float
    dup: float
    delay: float
    jitter: float
    slow: float  # chance a message is held back up to SLOW_MAX more
    skew: float  # arbiters' clock offsets, within +-skew
    partitions: bool
    arbiter_crashes: bool
    host_crashes: bool
    pauses: bool = False  # processes stopped (SIGSTOP, a VM stall) and resumed: arbiters and hosts

    @classmethod
    def draw(cls, rng: random.Random) -> Faults:
        return cls(
            loss=rng.choice([0.0, 0.0, 0.0, 0.01, 0.05, 0.2]),
            dup=rng.choice([0.0, 0.0, 0.02, 0.1]),
            delay=rng.choice([20e-6, 1e-3, MAX_DELAY]),
            jitter=rng.choice([0.0, 1e-3, MAX_JITTER]),
            slow=rng.choice([0.0, 0.0, 0.01, 0.05]),
            skew=rng.choice([0.0, 1e-4, MAX_SKEW]),
            partitions=rng.random() < 0.5,
            arbiter_crashes=rng.random() < 0.6,
            host_crashes=rng.random() < 0.4,
            pauses=rng.random() < 0.5,
        )

    def quiet(self) -> Faults:
        return Faults(0.0, 0.0, self.delay, self.jitter, 0.0, self.skew, False, False, False, False)


@dataclass
class Client:
    """One transfer (a lease of one or more parts) of a process on a host."""

    cid: int
    host: int
    inc: int
    dst: int
    flows: list[FlowId]
    renews: bool
    alive: bool = True  # False: the process died, it neither renews nor releases


@dataclass
class Host:
    """A host under ``control = "arbiter"``: a Node with no peers and an ArbiterLink."""

    index: int
    inc: int
    node: Node
    link: ArbiterLink
    clients: dict[int, Client] = field(default_factory=dict)
    asks: dict[int, float] = field(default_factory=dict)  # cid -> when asked (its clock)
    # Reserved flows: the epoch of the answer that last set the lease (a grant, a renewal,
    # a registration). A flow's id keeps the epoch that first granted it.
    lease_epoch: dict[FlowId, int] = field(default_factory=dict)
    lease_at: dict[FlowId, float] = field(default_factory=dict)  # when that answer left its arbiter (true time)
    bad_grants: int = 0


@dataclass
class Summary:
    asks: int = 0
    granted: int = 0  # parts reserved at the host
    ecmp: int = 0  # parts the arbiter answered with plain ECMP
    unanswered: int = 0  # asks no arbiter answered
    renewed: int = 0
    unreserved: int = 0  # flows the arbiter no longer held, or a new leader could not keep
    registered_kept: int = 0
    released: int = 0
    expired_clients: int = 0
    arbiter_crashes: int = 0
    arbiter_restarts: int = 0
    host_crashes: int = 0
    host_restarts: int = 0
    partitions: int = 0
    pauses: int = 0  # arbiter and host processes stopped and resumed
    no_lease: int = 0  # answers a leader refused for want of a lease
    takeovers: int = 0
    quiet_checks: int = 0
    cross_epoch: int = 0  # flows of different epochs seen holding one link alone, the older granted before the
    # newer epoch's first answer (the documented window: what the new leader's table lacks)
    judged: int = 0  # asks begun a recovery bound after the last fault: they must be answered
    dead_judged: int = 0  # crashed host incarnations past DEAD_BOUND: nothing of theirs may be live
    bad_grants: int = 0
    timer_spins: int = 0  # timers that fired at their deadline and found nothing due (see Sim._wake)


class Sim:
    """One seed's cluster: arbiters ``N .. N + arbiters - 1`` and hosts ``0 .. N - 1`` as
    endpoints of one simulated network."""

    def __init__(self, seed: int, *, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        self.n_arbs = rng.choice([1, 2, 2, 2, 2, 2, 3, 3])
        self.policy = rng.choice(["ark", "ark", "ark-balance"])
        self.faults = self.drawn = Faults.draw(rng)
        self.timeout = rng.choice([TIMEOUT, TIMEOUT, 2 * TIMEOUT])  # arbiter_timeout_s
        self.recover = recover_bound(self.n_arbs, self.timeout)
        self.trace: list[str] | None = [] if trace else None
        self.summary = Summary()
        self.t = 1.0
        self.steps = 0
        self.heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = 0
        # Clocks: arbiters are offset from true time by up to the seed's skew (hosts and
        # arbiters exchange durations only, so hosts' offsets would change nothing).
        self.off = [0.0] * N + [rng.uniform(-self.faults.skew, self.faults.skew) for _ in range(self.n_arbs)]
        self.last = [-math.inf] * (N + self.n_arbs)  # each endpoint's clock never steps back
        self.cuts: dict[int, frozenset[tuple[int, int]]] = {}
        self.fifo: dict[tuple[int, int], float] = {}  # arbiter -> arbiter: the last delivery time
        self.dirty = False  # invariant 1 across hosts is due (see run_until)
        self.overlaps: set[frozenset[FlowId]] = set()  # links held by flows of two epochs, seen
        self.blocked: frozenset[tuple[int, int]] = frozenset()
        self.due: list[tuple[float, int]] = [(math.inf, 0)] * (N + self.n_arbs)  # (local deadline, token)
        self.spins: dict[int, int] = {}  # endpoint -> timer wakes in a row that found nothing due
        self._ticked = -1  # the endpoint whose timer is being handled
        self.last_fault = self.t
        self.arbs: list[Arbiter | None] = [None] * self.n_arbs
        self.kept = [0] * self.n_arbs  # the epoch each arbiter keeps (its state_dir): the highest led or heard of
        self.led_since = [math.inf] * self.n_arbs  # when each began to lead
        self.top_epoch = -1  # the highest epoch any arbiter has led
        self.arb_fault = self.t  # the last fault between arbiters (a message lost or held back, a cut)
        self.hosts: list[Host | None] = [None] * N
        self.incs = [0] * N
        self.cid = 0
        self.flow_owner: dict[FlowId, tuple[int, int]] = {}  # granted flow -> (host, incarnation) that asked
        self.dead: list[tuple[float, int, int]] = []  # (must be gone by, host, incarnation)
        self.gone: set[tuple[int, int]] = set()  # dead incarnations past their bound
        self.quiet = False
        self._quiet_until = self.t
        self.probes: dict[int, tuple[int, Any]] = {}  # quiet points' asks: cid -> (host, answer)
        # Pauses: endpoint -> when it resumes, the events that waited for it, its time stopped in all.
        self.paused: dict[int, float] = {}
        self.deferred: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
        self.paused_s = [0.0] * (N + self.n_arbs)
        self.ask_paused: dict[int, float] = {}  # cid -> its host's paused_s when it asked
        # Invariant 6: the first answer (true time) of each epoch, the highest epoch that answered,
        # and when each answer left (host, rid, epoch) -> true time.
        self.first_answer: dict[int, float] = {}
        self.top_answered = -1
        self.answer_sent: dict[tuple[int, int, int], float] = {}
        for r in range(self.n_arbs):
            self._start_arbiter(r, 0)
        for i in range(N):
            self._start_host(i)

    # ------------------------------------------------------------------ plumbing
    def log(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.t:9.4f} {what}")

    def fail(self, what: str) -> None:
        raise Violation(f"seed {self.seed}, step {self.steps}, t={self.t:.4f}: {what}  "
                        f"(rerun: python -m tests.vopr_arbiter {self.seed})")

    def local(self, ep: int) -> float:
        now = max(self.t + self.off[ep], self.last[ep])
        self.last[ep] = now
        return now

    def _push(self, at: float, kind: str, data: tuple[Any, ...]) -> None:
        heapq.heappush(self.heap, (at, self.seq, kind, data))
        self.seq += 1

    def _fault(self, until: float | None = None) -> None:
        """A fault now (or one whose effect lasts ``until``)."""
        self.last_fault = max(self.last_fault, self.t if until is None else until)

    def _send(self, src: int, dst: int, data: bytes, inc: int = 0) -> None:
        """One message (``inc``: the sending host's incarnation).

        Between a host and an arbiter, messages may be lost, duplicated, delayed and
        reordered. Between two arbiters (one TCP connection each way under ZeroMQ) they may
        be lost or delayed but keep their order and are never duplicated: the stream's
        positions detect a gap, and the design counts on that order.
        """
        f = self.faults
        stream = src >= N and dst >= N
        if (src, dst) in self.blocked or (f.loss and self.rng.random() < f.loss):
            self._fault()
            if stream:
                self.arb_fault = max(self.arb_fault, self.t)
            return
        copies = 1
        if f.dup and not stream and self.rng.random() < f.dup:
            copies = 2
            self._fault()
        for _ in range(copies):
            at = self.t + f.delay + self.rng.random() * f.jitter
            if f.slow and self.rng.random() < f.slow:
                at += self.rng.random() * SLOW_MAX
                self._fault(at)
                if stream:
                    self.arb_fault = max(self.arb_fault, at)
            if stream:
                at = max(at, self.fifo.get((src, dst), at))
                self.fifo[(src, dst)] = at
            self._push(at, "msg", (src, dst, data, inc))

    def _wake(self, ep: int, deadline: float) -> None:
        """Make sure endpoint ``ep`` ticks at ``deadline`` (its clock)."""
        if deadline == math.inf or deadline >= self.due[ep][0]:
            return
        at = max(self.t, deadline - self.off[ep])
        if ep == self._ticked and deadline <= self.last[ep]:
            # Just ticked, and still due: the tick did not do what next_deadline promised
            # (ArbiterLink compares now - sent_at >= timeout_s against sent_at + timeout_s,
            # which rounding can leave short). A real clock moves on; so does this one.
            self.summary.timer_spins += 1
            at = math.nextafter(self.t, math.inf)
            deadline = max(deadline, math.nextafter(self.last[ep], math.inf))
            n = self.spins.get(ep, 0) + 1
            self.spins[ep] = n
            if n > 100:
                self.fail(f"endpoint {ep}: its timer fires again and again (next_deadline does not move)")
        elif ep == self._ticked:
            self.spins[ep] = 0
        token = self.due[ep][1] + 1
        self.due[ep] = (deadline, token)
        self._push(at, "wake", (ep, token, deadline))

    # ------------------------------------------------------------------ arbiters
    def _start_arbiter(self, r: int, seen_epoch: int) -> None:
        arb = Arbiter(FABRIC, rank=r, arbiters=self.n_arbs, policy=self.policy, lease=LEASE, heartbeat_s=BEAT,
                      takeover_s=TAKEOVER, retention_s=RETENTION, expiry_grace_s=GRACE, seen_epoch=seen_epoch)
        self.arbs[r] = arb
        ep = N + r
        self.due[ep] = (math.inf, self.due[ep][1])
        self._arb_out(r, arb.start(self.local(ep)))
        if arb.leading:  # the only arbiter leads at once
            self.led_since[r] = self.t
            self.top_epoch = max(self.top_epoch, arb.epoch)
        self._after_arbiter(r)

    def _arb_out(self, r: int, outs: list[ArbiterOut], inc_of: int = 0) -> None:
        ep = N + r
        for o in outs:
            if o.host >= 0:
                if o.data[1] == GRANT_TAG:  # remember whose flows it names
                    self._note_grant(o.host, inc_of, o.data)
                if o.data[1] != REFUSED_TAG:
                    self._note_answer(r, o.host, o.data)
                self._send(ep, o.host, o.data)
            elif o.arbiter >= 0:
                self._send(ep, N + o.arbiter, o.data)

    def _note_answer(self, r: int, host: int, data: bytes) -> None:
        """Invariant 6: once an epoch has answered, no lower epoch answers again (a leader
        answers only within its lease, and a follower leads only after that lease ended)."""
        msg = w.decode_to_host(data)
        e = msg.epoch
        if e < self.top_answered:
            self.fail(f"arbiter {r} answered host {host} ({type(msg).__name__} {msg.rid}) at epoch {e}, after epoch "
                      f"{self.top_answered} began answering at {self.first_answer[self.top_answered]:.4f}: two "
                      f"leaders answered in overlapping windows")
        self.first_answer.setdefault(e, self.t)
        self.top_answered = max(self.top_answered, e)
        self.answer_sent.setdefault((host, msg.rid, e), self.t)

    def _note_grant(self, host: int, inc: int, data: bytes) -> None:
        try:
            msg = w.decode_to_host(data)
        except w.ArbiterWireError:
            return
        if isinstance(msg, w.Grant):
            for p in msg.parts:
                self.flow_owner.setdefault(p.flow, (host, inc))

    def _after_arbiter(self, r: int) -> None:
        arb = self.arbs[r]
        if arb is None:
            return
        self.kept[r] = max(self.kept[r], arb.seen_epoch)  # what ark arbiter keeps (state_dir)
        self._wake(N + r, arb.next_deadline())
        now = self.local(N + r)
        table = arb.table.table(at=now)
        bad = arb.table.exclusive_conflicts(at=now) if self.policy == "ark" else two_exclusive(arb.table, table)
        if bad:
            self.fail(f"arbiter {r} ({arb.role}, epoch {arb.epoch}) has links held by two winners: {bad} {table}")
        if self.gone:
            for f in table:
                if self.flow_owner.get(f) in self.gone:
                    self.fail(f"arbiter {r} still holds flow {f} of dead host incarnation {self.flow_owner[f]}"
                              f" (bound {DEAD_BOUND:.3f} s after its crash): {arb.table.get(f)}")

    def _crash_arbiter(self) -> None:
        up = [r for r in range(self.n_arbs) if self.arbs[r] is not None]
        if not up:
            return
        leading = [r for r in up if self.arbs[r].leading]  # type: ignore[union-attr]
        r = self.rng.choice(leading) if leading and self.rng.random() < 0.8 else self.rng.choice(up)
        arb = self.arbs[r]
        assert arb is not None
        self.log(f"arbiter {r} crashes ({arb.role}, epoch {arb.epoch})")
        self._unpause(N + r)
        self.summary.takeovers += arb.counters.takeovers
        self.summary.no_lease += arb.counters.no_lease
        self.arbs[r] = None
        self.dirty = True
        self.summary.arbiter_crashes += 1
        self._fault()
        if self.rng.random() < 0.7:
            self._push(self.t + self.rng.uniform(0.2, 2.0), "arestart", (r,))

    def _fair(self, msgs: list[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, tuple[Any, ...]]]:
        """What waited, as a ZeroMQ ROUTER hands it over: each sender's in order, the senders
        taken in turn (so a host's ask can come before the other arbiter's beat that waited longer)."""
        by: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
        for e in msgs:
            by.setdefault(e[1][0], []).append(e)
        queues = [by[k] for k in sorted(by)]
        self.rng.shuffle(queues)
        return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]

    def _dead_later(self, host: int, inc: int) -> None:
        """Invariant 2: a dead host's message that waited at a stopped arbiter arrives only
        now; what it starts ends within DEAD_BOUND of now."""
        if (host, inc) not in self.gone and not any(d[1:] == (host, inc) for d in self.dead):
            return
        self.gone.discard((host, inc))
        self.dead = sorted([d for d in self.dead if d[1:] != (host, inc)] + [(self.t + DEAD_BOUND, host, inc)])

    def _unpause(self, ep: int) -> None:
        """A stopped process that dies: what waited for it is lost with it."""
        if self.paused.pop(ep, None) is not None:
            self.deferred.pop(ep, None)

    def _restart_arbiter(self, r: int) -> None:
        if self.arbs[r] is not None:
            return
        self.log(f"arbiter {r} restarts from epoch {self.kept[r]}")
        self.summary.arbiter_restarts += 1
        self._fault()
        self._start_arbiter(r, self.kept[r])

    # ------------------------------------------------------------------ hosts
    def _start_host(self, i: int) -> None:
        self.incs[i] += 1
        inc = self.incs[i]
        # Incarnations count seconds in the real agent: far above any epoch (ids never meet).
        node = Node(i, FABRIC, MAPS, [], incarnation=1_000_000 + inc, seed=self.seed * 31 + i, lease=LEASE,
                    heartbeat_s=10.0)
        h = Host(i, inc, node, None)  # type: ignore[arg-type]
        h.link = ArbiterLink(self.n_arbs, timeout_s=self.timeout, probe_s=PROBE, forget_epoch_s=FORGET,
                             held=lambda now: self._held(h, now), incarnation=node.incarnation)
        self.hosts[i] = h
        self.due[i] = (math.inf, self.due[i][1])
        node.start(self.local(i))
        self._after_host(h)

    def _held(self, h: Host, now: float) -> list[w.Held]:
        return held_leases(h.node, now)

    def _link_out(self, h: Host, outs: list[LinkOut]) -> None:
        for o in outs:
            self._send(h.index, N + o.rank, o.data, h.inc)

    def _after_host(self, h: Host) -> None:
        """As the agent after each batch: send, then handle what finished; arm the timer."""
        self._finish(h)
        now = self.local(h.index)
        self._wake(h.index, min(h.node.next_deadline(now), h.link.next_deadline()))

    def _finish(self, h: Host) -> None:
        for done in h.link.take_done():
            self._done(h, done)

    def _done(self, h: Host, done: Done) -> None:
        tag: Any = done.tag
        now = self.local(h.index)
        if tag[0] == "reserve":
            self._granted(h, tag, done, now)
        elif tag[0] == "renew":
            _, _cid, flows, held = tag
            lease_s = done.answer.lease_s if isinstance(done.answer, w.Extended) else None
            left = [done.left(x, now) if x >= 0 else x for x in lease_s or ()]
            epoch = done.answer.epoch if isinstance(done.answer, w.Extended) else -1
            self._renewed(h, list(flows), dict(zip(held, left, strict=False)), now, answered=lease_s is not None,
                          epoch=epoch, at=self._sent_at(h, done.answer))
        elif tag[0] == "register":
            self._registered(h, tag[1], done, now)

    # The agent's glue (ark.agent.arbiter_link.ArbiterForwarder), on this host's node and link.
    def _granted(self, h: Host, tag: tuple[Any, ...], done: Done, now: float) -> None:
        _, cid, dst, nbytes, parts, renews, probe = tag
        answer = done.answer
        asked = h.asks.pop(cid)
        limit = self.n_arbs * self.timeout + 1e-9 + self.paused_s[h.index] - self.ask_paused.pop(cid, 0.0)
        if self.t - asked > limit:
            self.fail(f"host {h.index} ask {cid} took {self.t - asked:.4f} s to finish (more than {limit:.3f}: "
                      f"each of {self.n_arbs} arbiters tried once)")
        grant = answer if isinstance(answer, w.Grant) and answer.parts else None
        q, r = divmod(nbytes, parts)
        shares: list[w.Part | None] = list(grant.parts) if grant is not None else [None] * parts
        epoch = grant.epoch if grant is not None else -1
        leases = [self._part_lease(h, part, dst, q + (i < r), now, done, epoch) for i, part in enumerate(shares)]
        self.summary.asks += 1
        self._judge(h, cid, asked, answer is not None)
        if answer is None:
            self.summary.unanswered += 1
            for le in leases:
                if le.reserved or le.fallback != NO_ARBITER:
                    self.fail(f"host {h.index}: no arbiter answered ask {cid} but its lease is {le}")
        else:
            self.summary.granted += sum(le.reserved for le in leases)
            self.summary.ecmp += sum(1 for p in shares if p is not None and not p.reserved)
        if probe:
            self.probes[cid] = (h.index, answer)
        self.log(f"host {h.index} ask {cid} -> {dst} x{parts}: "
                 + ("unanswered" if answer is None else f"epoch {answer.epoch} ")
                 + " ".join(f"{le.flow_id[1] >> 32}:{le.flow_id[1] & 0xFFFFFFFF}@{le.path if le.reserved else '-'}"
                            for le in leases))
        c = Client(cid, h.index, h.inc, dst, [le.flow_id for le in leases], renews)
        h.clients[cid] = c
        if probe:
            self._release(h, c)
            return
        self._push(self.t + self.rng.uniform(0.01, 1.2) + (0.0 if not self.quiet else self.quiet_left()), "finish",
                   (h.index, h.inc, cid))
        if renews:
            self._push(self.t + RENEW_EVERY, "renew", (h.index, h.inc, cid))
        self.dirty = True

    def _part_lease(self, h: Host, part: w.Part | None, dst: int, nbytes: int, now: float, done: Done,
                    epoch: int) -> Lease:
        placed = place_part(h.node, part, dst, nbytes, DPORT, now,
                            None if part is None else done.left(part.lease_s, now))
        h.bad_grants += placed.bad
        self.summary.bad_grants += placed.bad
        self._drop(h, placed.drop)
        lease = placed.lease
        if part is not None and part.reserved and lease.reserved and lease.path != part.path:
            self.fail(f"host {h.index}: granted {part.flow} on path {part.path}, its node put it on {lease.path}")
        if part is not None and lease.reserved:
            h.lease_epoch[lease.flow_id] = epoch
            h.lease_at[lease.flow_id] = self._sent_at(h, done.answer)
        return lease

    def _sent_at(self, h: Host, answer: Any) -> float:
        """When the answer left its arbiter (true time)."""
        return self.answer_sent.get((h.index, answer.rid, answer.epoch), self.t) if answer is not None else self.t

    def _drop(self, h: Host, flows: list[FlowId]) -> None:
        step = w.MAX_FLOWS_PER_MESSAGE
        for i in range(0, len(flows), step):
            self._link_out(h, h.link.drop(flows[i:i + step], self.local(h.index)))

    def _reserved(self, h: Host, flow: FlowId) -> bool:
        local = h.node.core.local_flows().get(h.node.resolve(flow))
        return bool(local and local[3])

    def _renew(self, h: Host, c: Client) -> None:
        node, now = h.node, self.local(h.index)
        try:
            for f in c.flows:  # all or nothing: a part that is gone fails the whole lease
                node.lease_of(f, now)
        except CoreError:  # its lease ended (not renewed in time): the client lets the rest go
            self.summary.expired_clients += 1
            self._release(h, c)
            return
        held = [node.resolve(f) for f in c.flows if self._reserved(h, f)]
        if not held:
            self._renewed(h, c.flows, {}, now)
        else:
            self._link_out(h, h.link.extend(("renew", c.cid, tuple(c.flows), tuple(held)), held, now))
        self._push(self.t + RENEW_EVERY, "renew", (h.index, h.inc, c.cid))

    def _renewed(self, h: Host, flows: list[FlowId], lease_s: dict[FlowId, float], now: float,
                 answered: bool = True, epoch: int = -1, at: float = -math.inf) -> None:
        node = h.node
        for f in flows:
            try:
                r = node.resolve(f)
                before = node.lease_of(r, now).expires
                lease = renewed_lease(node, f, lease_s.get(r), answered, now)
                if lease_s.get(r, -1) >= 0:
                    self._note_epoch(h, r, lease.expires > before, epoch, at)
                    self.summary.renewed += 1
                elif r in lease_s and answered:
                    self.summary.unreserved += 1
            except CoreError:
                continue  # released or expired while the answer was on its way (the agent answers an error)
        self.dirty = True

    @staticmethod
    def _note_epoch(h: Host, f: FlowId, moved: bool, epoch: int, at: float) -> None:
        """The flow's lease is that answer's (sent at ``at``) when it moved the end."""
        if moved or f not in h.lease_epoch:
            h.lease_epoch[f], h.lease_at[f] = epoch, at

    def _registered(self, h: Host, flows: tuple[FlowId, ...], done: Done, now: float) -> None:
        node, answer = h.node, done.answer
        before = {f: node.lease_of(f, now).expires for f in flows if node.holds(f)}
        reserved = [f for f in before if self._reserved(h, f)]
        kept, lost = apply_registration(node, flows, answer, now, lambda s: done.left(s, now))
        for f in kept:
            self._note_epoch(h, f, node.lease_of(f, now).expires > before[f], answer.epoch, self._sent_at(h, answer))
        self.summary.registered_kept += len(kept)
        self.summary.unreserved += sum(1 for f in reserved if f not in kept and not self._reserved(h, f))
        self._drop(h, lost)
        self.log(f"host {h.index} registered {len(flows)} with epoch {h.link.epoch}")
        self.dirty = True

    def _release(self, h: Host, c: Client) -> None:
        """The local API's release: a Drop of the reserved parts, then the node lets them go."""
        h.clients.pop(c.cid, None)
        node, now = h.node, self.local(h.index)
        self._drop(h, [node.resolve(f) for f in c.flows if self._reserved(h, f)])
        for f in c.flows:
            try:
                node.release(f, now)
                self.summary.released += 1
            except CoreError:
                pass  # expired meanwhile

    def _client(self, data: tuple[Any, ...]) -> tuple[Host, Client] | None:
        i, inc, cid = data
        h = self.hosts[i]
        if h is None or h.inc != inc:
            return None
        c = h.clients.get(cid)
        if c is None or not c.alive:
            return None
        return h, c

    def _crash_host(self) -> None:
        up = [i for i in range(N) if self.hosts[i] is not None]
        if len(up) <= 1:
            return
        i = self.rng.choice(up)
        h = self.hosts[i]
        assert h is not None
        self.log(f"host {i} crashes (incarnation {h.inc}, {len(h.clients)} clients)")
        self._unpause(i)
        self.hosts[i] = None
        self.summary.host_crashes += 1
        self.dead.append((self.t + DEAD_BOUND, i, h.inc))
        if self.rng.random() < 0.7:
            self._push(self.t + self.rng.uniform(0.05, 1.5), "hrestart", (i,))

    # ------------------------------------------------------------------ actions
    def ask(self, host: int | None = None, probe: bool = False) -> None:
        i = host if host is not None else self.rng.randrange(N)
        h = self.hosts[i]
        if h is None or i in self.paused:  # a stopped process asks nothing
            return
        dst = self.rng.choice([d for d in range(N) if FABRIC.hosts[d].leaf != FABRIC.hosts[i].leaf])
        nbytes = self.rng.choice(NBYTES)
        parts = self.rng.randint(2, 5) if self.rng.random() < 1 / 3 else 1
        renews = self.rng.random() < 0.75
        self.cid += 1
        cid = self.cid
        h.asks[cid] = self.local(i)
        self.ask_paused[cid] = self.paused_s[i]
        tag: Hashable = ("reserve", cid, dst, nbytes, parts, renews, probe)
        self._link_out(h, h.link.ask(tag, dst, nbytes, DPORT, parts, self.local(i)))
        self._after_host(h)

    def client_dies(self) -> None:
        live = [(h, c) for h in self.hosts if h is not None for c in h.clients.values() if c.alive]
        if live:
            _h, c = self.rng.choice(live)
            c.alive = False
            self.log(f"host {c.host} client {c.cid} dies holding {len(c.flows)} flows")

    def partition(self) -> None:
        a = self.n_arbs
        kind = self.rng.random()
        pairs: set[tuple[int, int]] = set()
        if kind < 0.5 or a == 1:  # a host cut from one arbiter or from all
            i = self.rng.randrange(N)
            rs = range(a) if self.rng.random() < 0.4 else [self.rng.randrange(a)]
            for r in rs:
                pairs |= {(i, N + r), (N + r, i)}
            what = f"host {i} cut from arbiters {list(rs)}"
        elif kind < 0.85:  # the arbiters cut from each other, sometimes one way only
            r1, r2 = self.rng.sample(range(a), 2)
            pairs.add((N + r1, N + r2))
            if self.rng.random() < 0.7:
                pairs.add((N + r2, N + r1))
            what = f"arbiters cut {sorted(pairs)}"
        else:  # split brain: each host reaches one arbiter, the arbiters not each other
            side = {i: self.rng.randrange(a) for i in range(N)}
            for i in range(N):
                for r in range(a):
                    if r != side[i]:
                        pairs |= {(i, N + r), (N + r, i)}
            for r1 in range(a):
                for r2 in range(a):
                    if r1 != r2:
                        pairs.add((N + r1, N + r2))
            what = f"split brain {side}"
        cut = self.seq
        self.cuts[cut] = frozenset(pairs)
        self.blocked = frozenset().union(*self.cuts.values())
        self.summary.partitions += 1
        self._fault()
        self.log(what)
        self._push(self.t + self.rng.uniform(0.05, 1.5), "heal", (cut,))

    def pause(self) -> None:
        """A process stopped (SIGSTOP, a GC pause, a VM stall): an arbiter (the leader three
        times in four) or a host. It handles nothing until it resumes; what comes for it
        waits, and then arrives at once (see _fair), before its timers fire. Its clock runs on."""
        arbs = [N + r for r in range(self.n_arbs) if self.arbs[r] is not None and N + r not in self.paused]
        hosts = [i for i in range(N) if self.hosts[i] is not None and i not in self.paused]
        leading = [ep for ep in arbs if self.arbs[ep - N].leading]  # type: ignore[union-attr]
        if arbs and (self.rng.random() < 0.6 or not hosts):
            ep = self.rng.choice(leading if leading and self.rng.random() < 0.75 else arbs)
        elif hosts:
            ep = self.rng.choice(hosts)
        else:
            return
        until = self.t + self.rng.uniform(0.05, PAUSE_MAX)
        self.paused[ep], self.deferred[ep] = self.t, []
        self.summary.pauses += 1
        self._fault(until)
        if ep >= N:
            self.arb_fault = max(self.arb_fault, until)
        self.log(f"{'arbiter' if ep >= N else 'host'} {ep - N if ep >= N else ep} stopped until {until:.4f}")
        self._push(until, "resume", (ep, self.t))

    def _resume(self, ep: int, start: float | None = None) -> None:
        """``start``: that stop's (a stop ended by a crash leaves its resume behind)."""
        if ep not in self.paused or start not in (None, self.paused[ep]):
            return
        start = self.paused.pop(ep)
        self.paused_s[ep] += self.t - start
        waited = self.deferred.pop(ep, [])
        for kind, data in waited:
            if kind == "msg" and data[0] < N:
                self._dead_later(data[0], data[3])
        for kind, data in self._fair([e for e in waited if e[0] == "msg"]) + [e for e in waited if e[0] != "msg"]:
            self._push(self.t, kind, data)
        self._fault()
        if ep >= N:
            self.arb_fault = max(self.arb_fault, self.t)
        self.log(f"{'arbiter' if ep >= N else 'host'} {ep - N if ep >= N else ep} resumes ({len(waited)} waited)")

    def step(self) -> None:
        self.steps += 1
        f = self.faults
        r = self.rng.random()
        if r < 0.40:
            self.ask()
        elif r < 0.45:
            self.client_dies()
        elif r < 0.48 and f.arbiter_crashes:
            self._crash_arbiter()
        elif r < 0.51 and f.host_crashes:
            self._crash_host()
        elif r < 0.56 and f.partitions:
            self.partition()
        elif r < 0.59 and f.pauses:
            self.pause()
        self.run_until(self.t + self.rng.choice([0.0, 1e-4, 1e-3, 0.02, 0.1]))

    # ------------------------------------------------------------------ events
    def run_until(self, target: float) -> None:
        while self.heap and self.heap[0][0] <= target:
            at, _, kind, data = heapq.heappop(self.heap)
            self.t = max(self.t, at)
            if self.blocked or not any(self.arbs) or self._needs_dead():
                self._fault()  # a partition lasts, no arbiter runs, or a leader's lease needs a dead one
                if any(a >= N and b >= N for a, b in self.blocked):
                    self.arb_fault = max(self.arb_fault, self.t)
            ep = data[1] if kind == "msg" else data[0] if kind in ("wake", "renew", "finish") else -1
            if ep in self.paused:  # a stopped process: what comes for it waits
                self.deferred[ep].append((kind, data))
                continue
            if kind == "resume":
                self._resume(*data)
            elif kind == "msg":
                self._deliver(*data)
            elif kind == "wake":
                self._on_wake(*data)
            elif kind == "renew":
                hc = self._client(data)
                if hc is not None and hc[1].renews:
                    self._renew(*hc)
                    self._after_host(hc[0])
            elif kind == "finish":
                hc = self._client(data)
                if hc is not None:
                    self._release(*hc)
                    self._after_host(hc[0])
            elif kind == "heal":
                self.cuts.pop(data[0], None)
                self.blocked = frozenset().union(*self.cuts.values())
                self._fault()
                self.log(f"partition healed ({len(self.cuts)} left)")
            elif kind == "arestart":
                self._restart_arbiter(data[0])
            elif kind == "hrestart" and self.hosts[data[0]] is None:
                self.summary.host_restarts += 1
                self._start_host(data[0])
                self.log(f"host {data[0]} restarts (incarnation {self.incs[data[0]]})")
            if self.dirty:  # hosts' holdings grew, or a leader's table or role changed
                self.dirty = False
                self._check_hosts()
            while self.dead and self.dead[0][0] <= self.t:
                _, i, inc = self.dead.pop(0)
                self.gone.add((i, inc))
                self.summary.dead_judged += 1
                for r in range(self.n_arbs):
                    self._after_arbiter(r)
        self.t = max(self.t, target)

    def _needs_dead(self) -> bool:
        """A leader whose lease takes a crashed arbiter's acknowledgements answers nothing
        until that one is back (it cannot tell a dead follower from one cut off)."""
        return any(a is not None and a.leading and any(self.arbs[r] is None for r in a._needs) for a in self.arbs)

    def _deliver(self, src: int, dst: int, data: bytes, inc: int) -> None:
        if (src, dst) in self.blocked:
            self._fault()
            return
        if dst >= N:  # to an arbiter
            r = dst - N
            arb = self.arbs[r]
            if arb is None:
                return
            now = self.local(dst)
            was = (arb.role, arb.epoch)
            if src < N:
                outs = arb.on_host(src, data, now)
                if self.rng.random() < 0.7:  # a batch ends: its changes go to the followers
                    outs += arb.flush()
                else:
                    self._push(self.t + 1e-4, "wake", (dst, -1, now))
            else:
                outs = arb.on_arbiter(src - N, data, now)
            self._arb_out(r, outs, inc)
            self._role_changed(r, was)
            self._after_arbiter(r)
            self.dirty = self.dirty or (src < N and arb.leading)
        else:  # to a host
            h = self.hosts[dst]
            if h is None:
                return
            self._link_out(h, h.link.on_arbiter(src - N, data, self.local(dst)))
            self._after_host(h)

    def _on_wake(self, ep: int, token: int, deadline: float) -> None:
        if ep >= N:
            r = ep - N
            arb = self.arbs[r]
            if arb is None:
                return
            if token == -1:  # the rest of a batch: flush its changes
                self._arb_out(r, arb.flush())
                return
            if token != self.due[ep][1]:
                return
            self.due[ep] = (math.inf, token)
            self.last[ep] = max(self.last[ep], deadline)
            self._ticked = ep
            was = (arb.role, arb.epoch)
            self._arb_out(r, arb.tick(self.local(ep)) + arb.flush())
            self._role_changed(r, was)
            self._after_arbiter(r)
            self._ticked = -1
            self.dirty = self.dirty or arb.leading
        else:
            h = self.hosts[ep]
            if h is None or token != self.due[ep][1]:
                return
            self.due[ep] = (math.inf, token)
            self.last[ep] = max(self.last[ep], deadline)
            self._ticked = ep
            now = self.local(ep)
            if now >= h.node.next_deadline(now):
                h.node.tick(now)  # local leases run out (no peers: nothing to send)
            if now >= h.link.next_deadline():
                self._link_out(h, h.link.tick(now))
            self._after_host(h)
            self._ticked = -1

    def _role_changed(self, r: int, was: tuple[str, int]) -> None:
        arb = self.arbs[r]
        if arb is None or (arb.role, arb.epoch) == was:
            return
        self.dirty = True
        self.log(f"arbiter {r}: {was[0]}/{was[1]} -> {arb.role}/{arb.epoch}")
        if arb.leading:
            self._judge_takeover(arb)
            self.led_since[r] = self.t
            self.top_epoch = max(self.top_epoch, arb.epoch)

    def _judge_takeover(self, arb: Arbiter) -> None:
        """Invariant 5: no takeover from a live leader whose beats got through. The leader
        it replaces steps down on its beat and takes its table, so an arbiter that leads
        without cause (a restarted one holds nothing yet) throws away every reservation."""
        window = TAKEOVER + 2 * (self.n_arbs - 1) * BEAT + BEAT + D_FAST
        for lead in self.arbs:
            if (lead is None or lead is arb or not lead.leading or lead.epoch != self.top_epoch
                    or self.t - self.led_since[lead.rank] < window or self.t - self.arb_fault < window):
                continue
            now = self.local(N + lead.rank)
            lost = sorted(set(lead.table.table(at=now)) - set(arb.table.table(at=now)))
            self.fail(f"arbiter {arb.rank} took over (epoch {arb.epoch}) from arbiter {lead.rank}, leading epoch "
                      f"{lead.epoch} since {self.led_since[lead.rank]:.4f} and heard (no fault between arbiters "
                      f"since {self.arb_fault:.4f}); {len(lost)} of its live flows are not in the new leader's "
                      f"table: {lost[:8]}")

    # ------------------------------------------------------------------ invariants
    def leader(self) -> Arbiter | None:
        """The arbiter leading with the highest epoch (None: none leads)."""
        leading = [a for a in self.arbs if a is not None and a.leading]
        return max(leading, key=lambda a: a.epoch) if leading else None

    def _check_hosts(self) -> None:
        """Invariant 1 across hosts: the current epoch's flows, as hosts hold them.

        "The current epoch's": the lease a host holds was last set by an answer of the
        leader of the highest epoch. Most such flows carry that epoch in their id; one
        registered with that leader keeps the id of the epoch that first granted it. A flow
        of that epoch's id whose lease a later leader set (registered with it, that leader
        since gone, the old one still leading: split brain) is the other epoch's holder the
        design allows (seed 706: what the brief's "ids carry the epoch" would flag)."""
        lead = self.leader()
        if lead is None:
            return
        epoch = lead.epoch
        held = lead.table.table()  # links held at the leader (leases end GRACE after their lease)
        users: dict[int, list[tuple[FlowId, bool]]] = {}
        every: dict[int, list[tuple[FlowId, int, float]]] = {}  # exclusive holders of any epoch: (flow, epoch, sent)
        for h in self.hosts:
            if h is None:
                continue
            now = self.local(h.index)
            for f, dst, _dport, path, _nbytes, shared, _left in h.node.reserved_leases(now):
                if not shared:
                    for st in STAGES[h.index, dst]:
                        every.setdefault(st[path], []).append((f, h.lease_epoch.get(f, -1), h.lease_at.get(f, -1.0)))
                if h.lease_epoch.get(f) != epoch:
                    continue
                at = held.get(f)
                if at is None or at[0] != path:
                    self.fail(f"host {h.index} holds flow {f} of epoch {epoch} on path {path} (lease "
                              f"{h.node.lease_of(f, now)}); its leader, arbiter {lead.rank}, holds {at} "
                              f"({lead.table.get(f)})")
                for st in STAGES[h.index, dst]:
                    users.setdefault(st[path], []).append((f, at[1]))  # shared: the leader says (a registration may share it)
        for lk, us in users.items():
            if sum(not s for _f, s in us) > 1:
                self.fail(f"link {lk} held by {us}, all of epoch {epoch}")
        for lk, hs in every.items():
            if len(hs) > 1:
                self._across_epochs(lk, hs, epoch)

    def _across_epochs(self, lk: int, hs: list[tuple[FlowId, int, float]], epoch: int) -> None:
        """Invariant 1 across epochs: two exclusive holders of a link under different epochs.
        The older one's answer left before the newer epoch's first answer: the window the
        design allows (its leader granted it within its lease and the new leader's table
        lacks it; counted). It left after: a leader answered from a stale table."""
        for f, e, at in hs:
            for g, e2, _at2 in hs:
                if e < e2 and at >= self.first_answer.get(e2, math.inf):
                    self.fail(f"link {lk} held by flow {f} (answered at epoch {e} at {at:.4f}) and flow {g} of "
                              f"epoch {e2}, which began answering at {self.first_answer[e2]:.4f}: an old leader "
                              f"answered from a stale table")
        fs = frozenset(f for f, _e, _at in hs)
        if fs not in self.overlaps:
            self.overlaps.add(fs)
            self.summary.cross_epoch += 1
            self.log(f"link {lk} held by {sorted(fs)} (epochs {[f[1] >> 32 for f in fs]}; the leader's is {epoch})")

    def _judge(self, h: Host, cid: int, asked: float, answered: bool) -> None:
        """Invariant 3: an ask begun long enough after the last fault is answered."""
        bound = self.recover
        up = [a for a in self.arbs if a is not None]
        if up and h.link.epoch > max(a.seen_epoch for a in up):
            bound += FORGET  # it heard a leader that is gone; it refuses lower epochs that long
        if asked - self.last_fault < bound:
            return
        self.summary.judged += 1
        if not answered:
            self.fail(f"host {h.index} ask {cid} (asked at {asked:.4f}) unanswered although the last fault was "
                      f"at {self.last_fault:.4f} (bound {bound:.3f} s); arbiters "
                      f"{[None if a is None else (a.role, a.epoch, a.synced) for a in self.arbs]}, link "
                      f"{h.link.status(self.local(h.index))}")

    def quiet_left(self) -> float:
        return self._quiet_until - self.t

    def quiesce(self) -> None:
        """Heal, restart what crashed, turn faults off and hold the workload until
        everything has recovered; then ask once from every host and drain."""
        self.quiet = True
        self.cuts.clear()
        self.blocked = frozenset()
        for ep in sorted(self.paused):
            self._resume(ep)
        for r in range(self.n_arbs):
            self._restart_arbiter(r)
        for i in range(N):
            if self.hosts[i] is None:
                self.summary.host_restarts += 1
                self._start_host(i)
        period = max(self.t, self.last_fault) - self.t + self.recover  # messages held back still arrive
        self._quiet_until = self.t + period
        held = []
        for e in self.heap:
            if e[2] == "finish":
                held.append((e[0] + period, e[1], e[2], e[3]))
            elif e[2] not in ("arestart", "hrestart", "heal", "resume"):
                held.append(e)
        self.heap = held
        heapq.heapify(self.heap)
        saved = self.faults
        self.faults = saved.quiet()
        self._fault()
        self.run_until(self.t + period)
        self.probes = {}
        for i in range(N):
            self.ask(i, probe=True)
        self.run_until(self.t + self.n_arbs * self.timeout + 2 * D_FAST)
        for _ in range(1000):  # drain: nothing in flight but beats
            busy = [e[0] for e in self.heap if e[2] == "msg" and e[3][2][1] != BEAT_TAG]
            if not busy:
                break
            self.run_until(min(busy))
        self.check_quiet()
        self.faults = saved
        self.quiet = False

    def check_quiet(self) -> None:
        self.summary.quiet_checks += 1
        lead = self.leader()
        arbs = [a for a in self.arbs if a is not None]
        if lead is None or sum(a.leading for a in arbs) != 1:
            self.fail(f"quiet: not exactly one leader: {[(a.rank, a.role, a.epoch) for a in arbs]}")
        for a in arbs:
            if a is not lead and (not a.synced or a.seen_epoch != lead.epoch):
                self.fail(f"quiet: arbiter {a.rank} ({a.role}, seen {a.seen_epoch}, synced {a.synced}) does not "
                          f"follow the leader {lead.rank} (epoch {lead.epoch})")
        at = self.local(N + lead.rank)
        want = lead.table.table(at=at)
        for a in arbs:
            if a is not lead:
                got = a.table.table(at=at)
                if got != want:
                    diff = {f: (want.get(f), got.get(f)) for f in set(want) | set(got) if want.get(f) != got.get(f)}
                    self.fail(f"quiet: follower {a.rank}'s table differs from the leader's: {diff}")
        for cid, (i, answer) in sorted(self.probes.items()):
            if not isinstance(answer, w.Grant) or answer.epoch != lead.epoch:
                h = self.hosts[i]
                self.fail(f"quiet: host {i}'s ask {cid} was answered {answer!r}, not by the leader (epoch "
                          f"{lead.epoch}); link {h.link.status(self.local(i)) if h else None}")
        if len(self.probes) != sum(h is not None for h in self.hosts):
            self.fail(f"quiet: asks unfinished: {self.probes}")
        held = lead.table.table()
        for h in self.hosts:
            if h is None:
                continue
            for f, _dst, _dport, path, *_ in h.node.reserved_leases(self.local(h.index)):
                if held.get(f, (None,))[0] != path:
                    self.fail(f"quiet: host {h.index} holds flow {f} on path {path}; the leader (epoch "
                              f"{lead.epoch}) holds {held.get(f)} ({lead.table.get(f)})")


def drive(sim: Sim, steps: int = 90, quiet_every: int = 45) -> Sim:
    for k in range(1, steps + 1):
        sim.step()
        if k % quiet_every == 0:
            sim.quiesce()
    for a in sim.arbs:
        if a is not None:
            sim.summary.takeovers += a.counters.takeovers
            sim.summary.no_lease += a.counters.no_lease
    return sim


def run(seed: int, steps: int = 90, quiet_every: int = 45, *, trace: bool = False) -> Sim:
    return drive(Sim(seed, trace=trace), steps, quiet_every)


def main(argv: list[str]) -> int:
    """``python -m tests.vopr_arbiter SEED...``: rerun seeds, printing each one's trace."""
    seeds = [int(a) for a in argv] or [0]
    for s in seeds:
        sim = Sim(s, trace=True)
        try:
            drive(sim)
        except Violation as e:
            print("\n".join(sim.trace or []))
            print(f"seed {s}: VIOLATION ({sim.n_arbs} arbiters, policy {sim.policy}, faults {sim.drawn})\n{e}")
            return 1
        print("\n".join(sim.trace or []))
        print(f"seed {s}: ok ({sim.steps} steps, {sim.n_arbs} arbiters, policy {sim.policy}, faults {sim.drawn}, "
              f"{sim.summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
