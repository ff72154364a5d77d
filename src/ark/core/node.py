"""One host's control-plane node: the reservation core plus replication, sans-IO.

:class:`Node` wraps :class:`ark.core.protocol.ArkCore` with everything a real deployment
needs between hosts, still without sockets or clocks (``now`` is passed in):

* an envelope per published message (:mod:`ark.core.envelope`) with a per-sender
  sequence number, so that a receiver sees gaps, and the owner's signature, so that a
  message another host relays can be checked;
* HELLO heartbeats carrying the sender's last sequence number (tail gaps, peer liveness),
  a digest of its own recent flows (anti-entropy: a mismatch triggers a sync) and its
  clock (offsets between hosts, :mod:`ark.core.clock`);
* SYNC request / reply: a (re)starting node, or one that saw a gap, asks the peer for
  every message it holds, in parts. The table is a function of the message set, so
  merging sets converges. The replying peer's own flows are always taken; a third host's
  only while that host is not synced with us or when they belong to an earlier
  incarnation of it (a live, synced host is authoritative for its current flows), only
  with that host's valid signature, and only in answer to a request we sent;
* after a restart the node releases, with real RELEASE messages, every reservation of
  its host that it does not own (its predecessor's), as soon as it learns of them;
* leases: a reservation lasts ``lease(nbytes, rate)`` (capped, :mod:`ark.core.lease`) and
  is renewed by the local client; a local flow whose client stops renewing is released,
  and a dead host's reservations end everywhere when their lease runs out;
* readiness: after :meth:`Node.start` the node refuses reservations until every peer has
  answered its sync request or ``sync_timeout_s`` has passed;
* hostile input: every field is checked against the node's clock and limits
  (:class:`NodeLimits`, :class:`~ark.core.protocol.CoreLimits`); what fails is counted and
  dropped, and no peer can make the node keep more than the limits allow.

The agent (``ark.agent.daemon``) moves the bytes this class returns; the fault harness in
the tests drives it over a simulated network with loss, duplication, reordering,
partitions, crashes and clock skew.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ark.core.clock import ClockWatch
from ark.core.envelope import (
    K_DATA,
    K_HELLO,
    K_SYNC_REP,
    K_SYNC_REQ,
    Envelope,
    SignedMessage,
    decode_envelope,
    encode_envelope,
    sync_parts,
)
from ark.core.lease import LeasePolicy
from ark.core.messages import (
    FlowId,
    Key,
    Message,
    ProtocolError,
    Release,
    Renew,
    Reserve,
    VersionError,
    decode,
    encode,
)
from ark.core.protocol import ArkCore, CoreError, CoreLimits, PathMaps, Repath, Routes
from ark.core.roce import flow_label_for_sport
from ark.core.scope import pair_links

__all__ = [
    "K_DATA", "K_HELLO", "K_SYNC_REP", "K_SYNC_REQ", "Lease", "LeasePolicy", "Node", "NodeLimits", "NotReady",
    "Output", "Publish", "Send", "decode_envelope", "encode_envelope",
]

Signer = Callable[[bytes], bytes]  # message bytes -> this host's signature
Verifier = Callable[[int, bytes, bytes], bool]  # (owner host, message bytes, signature) -> valid?
_KIND = {Reserve: 0, Renew: 1, Release: 2}
# Why a lease is plain ECMP (Lease.fallback), beside the core's (ark.core.protocol).
CLOCK_SKEWED = "clock skewed"
OUT_OF_SCOPE = "out of scope"
RACE_LOST = "race lost"  # reserved, then a smaller key took every path (or its path's last port)
PATH_MAP_CHANGED = "path map changed"  # its port now leads over another path than the one reserved
# Leases beyond max_local_flows are kept nowhere: bit 62 of the seq marks one, and the bits
# below hold its destination, destination port and source port, so that renew, lease and
# release answer from the id alone. Kept flows' seqs (incarnation << 32) stay below it.
_UNTRACKED = 1 << 62
MAX_SPLIT_PARTS = 16  # parts of one multi-path lease (more paths than a pair of hosts has is pointless)


class NotReady(CoreError):
    """The node is still resynchronising with its peers."""


class Publish(NamedTuple):
    """Bytes for every peer (the node's publish socket)."""

    data: bytes


class Send(NamedTuple):
    """Bytes for one peer (sync request or reply)."""

    peer: int
    data: bytes


Output = Publish | Send


class Lease(NamedTuple):
    """What a serving engine gets for one KV flow."""

    flow_id: FlowId
    dst: int
    path: int
    src_port: int
    flow_label: int | None  # None: the port range is outside what a flow label can reach
    expires: float
    reserved: bool
    # Why the flow is plain ECMP ("" when reserved): "no free path", "clock skewed",
    # "out of scope", "same leaf", "cap: ..." (a limit of this host, see NodeLimits).
    fallback: str = ""


@dataclass(frozen=True)
class NodeLimits:
    """What one peer or the local clients can make this node keep or do.

    ``max_local_flows``: live local flows; ``max_ahead``: out-of-order sequence numbers
    kept per peer (beyond: a gap, resolved by a sync); ``max_clock_offset_s``: a clock
    further than this from the majority's stops reservations (plain ECMP).
    """

    max_local_flows: int = 4096
    max_ahead: int = 1024
    max_clock_offset_s: float = 0.1


@dataclass
class PeerState:
    incarnation: int | None = None
    last_seq: int = 0  # highest sequence number seen
    have: int = 0  # every message up to this one is applied (directly or by a sync)
    ahead: set[int] = field(default_factory=set)  # applied, above a hole
    last_heard: float = -math.inf
    blind: bool = False  # heard nothing from it for longer than the retention: messages may be lost for good
    synced: bool = False
    sync_sent: float | None = None
    retry_s: float = 0.0  # wait before asking again: doubles while requests go unanswered
    served_at: float = -math.inf  # last sync reply we sent it
    reply_seq: int | None = None  # the reply being received in parts: its seq ...
    reply_next: int = 0  # ... and the part expected next

    def incarnation_or(self, default: int) -> int:
        return default if self.incarnation is None else self.incarnation


@dataclass
class _Local:
    dst: int
    dport: int
    nbytes: int
    expires: float
    why: str = ""  # why it got no reservation when reserved ("" if it got one)


@dataclass
class NodeCounters:
    published: int = 0
    received: int = 0
    invalid: int = 0  # malformed envelopes or messages, sender mismatch, out of window
    wrong_version: int = 0  # of those: an envelope or message of another wire version
    out_of_window: int = 0  # of those: a timestamp or lease outside what this node accepts
    forged: int = 0  # relayed messages without their owner's valid signature
    replayed: int = 0  # relayed messages of an owner's earlier incarnation, refused
    dropped: int = 0  # duplicates and old sequence numbers
    gaps: int = 0
    sync_requests: int = 0
    sync_served: int = 0
    sync_throttled: int = 0  # sync requests not answered: that peer asked again too soon
    sync_applied: int = 0
    digest_mismatches: int = 0
    predecessor_releases: int = 0  # our host's flows from before a restart, released
    local_expired: int = 0
    fenced_requests: int = 0  # reservations refused (plain ECMP) while the clock is skewed
    skewed_owner: int = 0  # peer reservations refused: we measured the owner's clock off
    out_of_scope: int = 0  # requests or peer reservations outside this host's scope (plain ECMP / dropped)
    untracked: int = 0  # requests beyond max_local_flows: plain ECMP leases kept nowhere
    frozen_conflicts: int = 0  # peers' frozen-assignment claims refused: contradicted or not ours to take


def _check_node_args(host: int, peers: Sequence[int], incarnation: int, **periods: float) -> None:
    if host in peers:
        raise CoreError(f"peers: must not include this host ({host})")
    if not 0 <= incarnation < 2**30:
        raise CoreError(f"incarnation: must be 0..2**30-1; got {incarnation}")
    for name, v in periods.items():
        if not (math.isfinite(v) and v > 0):
            raise CoreError(f"{name}: must be > 0; got {v}")


class Node:
    """A host's reservation core with replication, leases and resync (sans-IO)."""

    # Set by a driver while it answers a local request: what is published meanwhile waits,
    # unsigned, for publish_deferred() (the client gets its answer before the signing and sends).
    defer_publish = False

    def __init__(
        self,
        host: int,
        routes: Routes,
        pathmaps: PathMaps,
        peers: Sequence[int],
        *,
        incarnation: int,
        policy: str = "ark",
        seed: int = 0,
        lease: LeasePolicy | None = None,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 2.0,
        sync_timeout_s: float = 1.0,
        retention_s: float = 5.0,
        expiry_grace_s: float = 0.05,
        latency_samples: int = 50_000,
        limits: NodeLimits = NodeLimits(),
        core_limits: CoreLimits | None = None,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        scope_links: frozenset[int] | None = None,
    ) -> None:
        _check_node_args(host, peers, incarnation, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                         sync_timeout_s=sync_timeout_s)
        self.host = host
        self.incarnation = incarnation
        self.lease = lease or LeasePolicy()
        self.core = ArkCore(
            host, routes, pathmaps, policy=policy, seed=seed, retention_s=retention_s, lease=self.lease,
            expiry_grace_s=expiry_grace_s, seq_base=incarnation << 32, limits=core_limits or CoreLimits(),
            bookkeeping_grid=True,  # a real host wakes once for many ends, not once per flow
        )
        self.peers: dict[int, PeerState] = {p: PeerState(retry_s=sync_timeout_s) for p in peers}
        self.heartbeat_s, self.peer_timeout_s, self.sync_timeout_s = heartbeat_s, peer_timeout_s, sync_timeout_s
        self.limits = limits
        # Timestamps further than this from our clock are not believed (a message older
        # than the retention is stale anyway; one from further ahead has a broken clock).
        self.window_s = retention_s
        self.counters = NodeCounters()
        self.digest_lag_s = 0.3  # anti-entropy compares ends at least this old
        self.propagation_s: deque[float] = deque(maxlen=latency_samples)
        self.clock = ClockWatch(limits.max_clock_offset_s, peer_timeout_s)
        self.skewed = ""  # why this host stopped reserving ("" while its clock is trusted)
        self.ready = False
        self._sign, self._verify = signer, verifier
        # Scoped dissemination (ark.core.scope): the links this host's component uses; a
        # reservation outside them is neither made here nor taken from a peer. None: all.
        self._scope = scope_links
        self._in_scope: dict[tuple[int, int], bool] = {}
        self._sigs: dict[FlowId, dict[int, tuple[bytes, bytes, float]]] = {}  # what we can relay, signed
        self._frozen_votes: dict[FlowId, dict[int, tuple[int | None, bool]]] = {}  # peer -> its frozen assignment
        self._adopted: set[FlowId] = set()  # assignments taken from peers' claims
        # Reservations that started at or after _complete_from can be recomputed here: every
        # peer's snapshot since held all that overlapped them. _joined_from is where that
        # began (the first completed sync); _complete_from moves later only after this
        # replica heard nothing from a peer for longer than the retention (it may have
        # missed what the others have since forgotten). Both inf until the first sync.
        self._joined_from = self._complete_from = math.inf
        self.alerts: deque[dict[str, Any]] = deque(maxlen=64)  # refused claims, one per reply part, for the log
        self._merging = 0  # reply parts merged (tells one part's alerts from the next's)
        self._skew_refused: dict[FlowId, None] = {}  # reservations refused for their owner's clock (bounded)
        self._clock_judged: dict[int, float] = {}  # listed peer -> when its clock figure last changed here
        self._sigs_pruned = -math.inf
        self._started_at: float | None = None
        self._out_seq = 0
        self._deferred: list[Message] = []  # published while defer_publish was set
        self._next_hello = -math.inf
        self._local: dict[FlowId, _Local] = {}
        self._alias: dict[FlowId, FlowId] = {}  # re-pathed flow -> its new reservation
        self._syncing: set[int] = set()  # peers a sync request is out to (their retry timers)
        self.events: deque[Repath] = deque(maxlen=10_000)  # local flows moved by races
        self._handlers = {
            K_DATA: self._on_data, K_HELLO: self._on_hello,
            K_SYNC_REQ: self._on_sync_request, K_SYNC_REP: self._on_sync_reply,
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> list[Output]:
        """Begin (re)joining: ask every peer for its flows."""
        self._started_at = now
        self.ready = not self.peers
        out: list[Output] = []
        for p in self.peers:
            out.extend(self._request_sync(p, now, urgent=True))
        out.extend(self._hello(now))
        return out

    def tick(self, now: float) -> list[Output]:
        """Timers: heartbeats, sync retries, readiness, clock verdict, lease expiry, core expiry."""
        out: list[Output] = []
        if self._next_hello - now > self.heartbeat_s:
            self._next_hello = now  # the clock stepped back: do not fall silent until it catches up
        if now >= self._next_hello:
            out.extend(self._hello(now))
        for p in list(self._syncing):
            st = self.peers[p]
            if not st.synced and st.sync_sent is not None and now >= st.sync_sent + st.retry_s:
                out.extend(self._request_sync(p, now, retry=True))
        self._update_ready(now)
        out.extend(self._judge_clock(now))
        for f in [f for f, lo in self._local.items() if lo.expires <= now]:
            self.counters.local_expired += 1
            out.extend(self._release(f, now))
        self.events.extend(self.core.tick(now))
        if now >= self._sigs_pruned + self.core.retention_s / 2:
            self._prune_signatures(now)
        return out

    def flush(self) -> None:
        """After a batch of :meth:`on_message` calls: apply what they deferred."""
        self.events.extend(self.core.flush())

    def next_deadline(self, now: float) -> float:
        """When :meth:`tick` next has work: a heartbeat, a sync retry, readiness, a local
        lease running out, or the core's expiry and forgetting. A driver sleeps until then
        (or until a message arrives) instead of polling."""
        t = min(self._next_hello, self.core.next_deadline())
        for p in self._syncing:
            st = self.peers[p]
            if not st.synced and st.sync_sent is not None:
                t = min(t, st.sync_sent + st.retry_s)
        if not self.ready and self._started_at is not None:
            t = min(t, self._started_at + self.sync_timeout_s)
        if self._local:
            t = min(t, min(lo.expires for lo in self._local.values()))
        return max(t, now) if t != math.inf else t

    # ------------------------------------------------------------------ local API
    def reserve(
        self, dst: int, nbytes: int, now: float, dport: int = 4791, prefer_port: int | None = None,
        *, avoid: int = 0, unreserved: str = "",
    ) -> tuple[Lease, list[Output]]:
        """A lease for a new local flow; plain ECMP (``Lease.fallback`` says why) whenever
        it cannot be reserved, a cap of this host included: only an invalid request or a
        node still resynchronising raises. ``avoid``: paths to stay off while others
        remain (a bit mask, as :meth:`ArkCore.request`). ``unreserved``: plain ECMP for
        this reason (whoever decides cannot be asked)."""
        if not self.ready:
            raise NotReady("node: resynchronising with peers; retry shortly")
        lease, msgs = self._reserve_one(dst, nbytes, now, dport, prefer_port, avoid, unreserved, self._fence(dst, unreserved))
        return lease, self._publish(msgs)

    def _fence(self, dst: int, unreserved: str) -> tuple[str, bool]:
        """(why a request to ``dst`` reserves nothing, "" if it may; is ``dst`` in scope)."""
        in_scope = self._covers(self.host, dst)
        return unreserved or ("" if in_scope and not self.skewed else CLOCK_SKEWED if in_scope else OUT_OF_SCOPE), in_scope

    def _reserve_one(
        self, dst: int, nbytes: int, now: float, dport: int, prefer_port: int | None, avoid: int, unreserved: str,
        fenced: tuple[str, bool],
    ) -> tuple[Lease, tuple[Message, ...]]:
        """One local flow's lease and what it publishes (:meth:`reserve`, checked and fenced)."""
        if len(self._local) >= self.limits.max_local_flows:
            self.counters.untracked += 1
            return self._untracked_lease(dst, dport, *self.core.ecmp_port(dst, dport), now), ()
        fence, in_scope = fenced
        dec = self.core.request(dst, nbytes, now, dport, prefer_port, reserve=not fence, avoid=avoid, why=fence)
        if not in_scope:
            self.counters.out_of_scope += 1
        elif self.skewed and not unreserved and self.core.routes.stages(self.host, dst):  # a flow within a leaf reserves nothing anyway
            self.counters.fenced_requests += 1
        if dec.events:
            self.events.extend(dec.events)
        expires = self._expiry(dec.flow, now, nbytes)
        self._local[dec.flow] = _Local(dst, dport, nbytes, expires, dec.why)
        return self._lease(dec.flow), dec.messages

    def reserve_split(
        self, dst: int, nbytes: int, now: float, parts: int, dport: int = 4791
    ) -> tuple[list[Lease], list[Output]]:
        """A multi-path lease: one transfer of ``nbytes`` as ``parts`` local flows, each
        chosen as :meth:`reserve` would but away from the paths the earlier parts took
        while other usable paths remain (as :meth:`ArkCore.request_split`). Each part is
        an ordinary reservation, renewed, released and re-pathed on its own; the caller
        holds them as one. One pass: the request is checked and fenced once, and the
        parts' messages are published together."""
        if not 1 <= parts <= MAX_SPLIT_PARTS:
            raise CoreError(f"parts: must be 1..{MAX_SPLIT_PARTS}; got {parts}")
        self.core.check_request(dst, nbytes, dport)
        if not self.ready:
            raise NotReady("node: resynchronising with peers; retry shortly")
        fenced = self._fence(dst, "")
        q, r = divmod(int(nbytes), parts)
        leases: list[Lease] = []
        msgs: list[Message] = []
        avoid = 0
        for i in range(parts):
            lease, m = self._reserve_one(dst, q + (i < r), now, dport, None, avoid, "", fenced)
            leases.append(lease)
            msgs.extend(m)
            if lease.path >= 0:  # an ECMP part of a probed map may lead over a path nobody knows (-1)
                avoid |= 1 << lease.path
        return leases, self._publish(msgs)

    def place(
        self, flow: FlowId, dst: int, nbytes: int, now: float, dport: int, path: int | None, *,
        shared: bool = False, lease_s: float = math.inf, why: str = "",
    ) -> Lease:
        """A lease for a new local flow whose path an arbiter decided (``path`` None: plain
        ECMP, ``why`` says why): the flow takes a port of that path, and the lease ends
        when the arbiter's does (``lease_s`` from ``now``), unless renewed through it."""
        if len(self._local) >= self.limits.max_local_flows:
            self.counters.untracked += 1
            return self._untracked_lease(dst, dport, *self.core.ecmp_port(dst, dport), now)
        dec = self.core.place(flow, dst, nbytes, now, dport, path, shared=shared, lease_s=lease_s, why=why)
        expires = self._expiry(dec.flow, now, nbytes)
        self._local[dec.flow] = _Local(dst, dport, nbytes, expires, dec.why)
        return self._lease(dec.flow)

    def extend_to(self, flow: FlowId, lease_s: float, now: float) -> Lease:
        """The arbiter renewed a placed flow: its lease now ends ``lease_s`` from ``now``."""
        flow = self.resolve(flow)
        lo = self._local.get(flow)
        if lo is None:
            return self._untracked_of(flow, now)
        self.core.extend_to(flow, now + lease_s, now)
        lo.expires = max(lo.expires, now + lease_s)
        return self._lease(flow)

    def unreserve(self, flow: FlowId, why: str, now: float) -> Lease:
        """The flow keeps its port but holds no reservation any more (``why``): the
        arbiter no longer holds it. Its lease stands until it ends or is renewed."""
        flow = self.resolve(flow)
        lo = self._local.get(flow)
        if lo is None:
            return self._untracked_of(flow, now)
        if self.core.local_flows()[flow][3]:
            self.events.extend(self.core.unreserve(flow, now).events)
        lo.why = why
        return self._lease(flow)

    def reserved_leases(self, now: float) -> list[tuple[FlowId, int, int, int, int, bool, float]]:
        """Live local reservations: (flow, dst, dport, path, nbytes, shared, seconds left)."""
        out = []
        for f, (dst, path, _port, reserved) in self.core.local_flows().items():
            lo = self._local.get(f)
            if reserved and lo is not None and lo.expires > now:
                shared = bool((self.core.assignment(f) or (0.0, False, None, False))[3])
                out.append((f, dst, lo.dport, path, lo.nbytes, shared, lo.expires - now))
        return out

    def renew(self, flow: FlowId, now: float) -> tuple[Lease, list[Output]]:
        flow = self.resolve(flow)
        lo = self._local.get(flow)
        if lo is None:
            return self._untracked_of(flow, now), []
        msgs = self.core.renew(flow, now)
        self.events.extend(self.core.flush())
        lo.expires = self._expiry(flow, now, lo.nbytes)
        return self._lease(flow), self._publish(msgs)

    def release(self, flow: FlowId, now: float) -> list[Output]:
        old = flow
        flow = self.resolve(flow)
        while old in self._alias:  # the owner is done with the whole chain
            old = self._alias.pop(old)
        if flow not in self._local:
            self._untracked_of(flow, now)  # kept nowhere: nothing to release
            return []
        return self._release(flow, now)

    def lease_of(self, flow: FlowId, now: float = 0.0) -> Lease:
        """The flow's lease as it stands (``now`` dates an untracked lease's expiry)."""
        flow = self.resolve(flow)
        if flow not in self._local:
            return self._untracked_of(flow, now)
        return self._lease(flow)

    def more_ports(self, flow: FlowId, n: int) -> list[int]:
        """Up to ``n`` more ports of the flow's current path, held until it is released
        or moves (bounded per flow, see :meth:`ArkCore.more_ports`)."""
        flow = self.resolve(flow)
        if flow not in self._local:
            self._untracked_of(flow, 0.0)
            return []  # an untracked lease holds no port: none to add
        return self.core.more_ports(flow, n)

    def _untracked_lease(self, dst: int, dport: int, path: int, port: int, now: float) -> Lease:
        """Plain ECMP beyond ``max_local_flows``, kept nowhere: the id holds what a renew,
        a lease or a release needs, and the lease never lapses here (the longest one)."""
        seq = _UNTRACKED | dst << 32 | dport << 16 | port
        return Lease((self.host, seq), dst, path, port, flow_label_for_sport(port), now + self.lease.max_s, False,
                     f"cap: {self.limits.max_local_flows} live local flows")

    def _untracked_of(self, flow: FlowId, now: float) -> Lease:
        """The lease of an untracked flow id (see :meth:`_untracked_lease`); any other id
        that names no local flow is an error."""
        owner, seq = flow
        dst, dport, port = seq >> 32 & 0x3FFF_FFFF, seq >> 16 & 0xFFFF, seq & 0xFFFF
        if owner != self.host or not seq & _UNTRACKED or not 0 <= dst < self.core.routes.n_hosts or dst == self.host:
            raise CoreError(f"flow: {flow} is not an active local flow (released or expired)")
        return self._untracked_lease(dst, dport, self.core.port_path(dst, dport, port), port, now)

    def holds(self, flow: FlowId) -> bool:
        """Is ``flow`` a live local flow this node keeps (not an untracked ECMP lease)?"""
        return flow in self._local

    def local_flows(self) -> list[FlowId]:
        return list(self._local)

    def resolve(self, flow: FlowId) -> FlowId:
        """The reservation a flow id stands for now (itself unless it was re-pathed)."""
        while flow in self._alias:
            flow = self._alias[flow]
        return flow

    def reload_pathmaps(self, now: float, *, rereserve: bool = True) -> tuple[dict[FlowId, Lease], list[Output]]:
        """Take fresh path maps and re-path live reservations whose port moved.

        After a re-hash a reserved flow's port may lead over another spine than its
        reservation: the table would be wrong. Such a flow is released and reserved
        anew: on the path its port now leads to when that path is free (the port stays),
        else on a free path with a new port. Its old id stays valid for renew, release
        and lease_of, which answer with the new lease, so the owner learns any new port.
        ``rereserve`` False (an arbiter decides, not this node): such a flow keeps its
        port and gives up its reservation instead.
        """
        moved = self.core.reload_pathmaps()
        out: list[Output] = []
        repathed: dict[FlowId, Lease] = {}
        if not self.ready:  # resynchronising: it reserves nothing now, so it re-paths nothing
            return repathed, out
        local = self.core.local_flows()
        for f in moved:
            lo = self._local.get(f)
            if lo is None or not local[f][3]:
                continue  # unreserved: the table says nothing about it
            if not rereserve:  # an arbiter decides: the flow keeps its port, unreserved (the caller tells it)
                repathed[f] = self.unreserve(f, PATH_MAP_CHANGED, now)
                continue
            port = local[f][2]
            out += self._release(f, now)
            # Keep the port when the path it now leads to is free: nothing has to move.
            lease, outs = self.reserve(lo.dst, lo.nbytes, now, lo.dport, prefer_port=port)
            out += outs
            self._alias[f] = lease.flow_id
            repathed[f] = lease
        return repathed, out

    # ------------------------------------------------------------------ network input
    def on_message(self, peer: int, data: bytes, now: float) -> list[Output]:
        """Any envelope from ``peer`` on a channel that authenticates the peer.

        Re-evaluations a message forces are deferred: call :meth:`flush` after a batch.
        """
        return self._dispatch(peer, data, now, (K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP))

    def on_publish(self, peer: int, data: bytes, now: float) -> list[Output]:
        """Bytes from ``peer``'s broadcast (the channel names the peer)."""
        return self._dispatch(peer, data, now, (K_DATA, K_HELLO))

    def on_request(self, peer: int, data: bytes, now: float) -> list[Output]:
        """A point-to-point message from ``peer``: a sync request or a sync reply."""
        return self._dispatch(peer, data, now, (K_SYNC_REQ, K_SYNC_REP))

    def _dispatch(self, peer: int, data: bytes, now: float, kinds: tuple[int, ...]) -> list[Output]:
        self.counters.received += 1
        try:
            env = decode_envelope(data)
        except ProtocolError as e:
            self._count_invalid(e)
            return []
        st = self.peers.get(peer)
        if env.kind not in kinds or st is None or env.sender != peer:
            self.counters.invalid += 1
            return []
        return self._handlers[env.kind](peer, st, env, now)

    def _count_invalid(self, e: ProtocolError) -> None:
        self.counters.invalid += 1
        if isinstance(e, VersionError):
            self.counters.wrong_version += 1  # a peer on another release: worth its own alarm

    def _contact(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output] | None:
        """Bookkeeping for a broadcast envelope; None when it is from a dead incarnation."""
        if st.incarnation is not None and env.incarnation < st.incarnation:
            self.counters.dropped += 1  # a delayed message from before the peer restarted
            return None
        self._heard(st, now)
        if not st.synced and st.retry_s > self.sync_timeout_s:
            st.retry_s = self.sync_timeout_s  # it is back: the next retry comes soon
        if st.incarnation == env.incarnation:
            return []
        # First contact or a restart: its sequence numbers start over.
        st.incarnation, st.last_seq, st.have, st.synced = env.incarnation, 0, 0, False
        st.ahead.clear()
        st.reply_seq = None
        return self._request_sync(peer, now, urgent=True)

    def _heard(self, st: PeerState, now: float) -> None:
        if now - st.last_heard > self.core.retention_s - self.limits.max_clock_offset_s and st.last_heard > -math.inf:
            st.blind = True
        st.last_heard = now

    def _on_hello(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        digest, since, until, sent_at, echoes = env.payload
        w = self.window_s
        if not (abs(sent_at - now) <= w and now - 3 * w <= since <= until <= now + w):
            self.counters.invalid += 1
            self.counters.out_of_window += 1
            if st.incarnation is None or env.incarnation >= st.incarnation:
                # A clock this far off is what the clock watch is there to judge: take the
                # sample (and the round trip it may close), nothing else.
                self.clock.hello(peer, now, sent_at, echoes, self.host)
                self._judge_clock_of(peer, now)
            return []
        out = self._contact(peer, st, env, now)
        if out is None:
            return []
        self.clock.hello(peer, now, sent_at, echoes, self.host)
        self._judge_clock_of(peer, now)
        st.last_seq = max(st.last_seq, env.seq)
        if env.seq > st.have and st.synced:
            self.counters.gaps += 1
            st.synced = False
            out.extend(self._request_sync(peer, now))
        elif (
            st.synced
            and digest != self.core.state_digest(since, until, owner=peer)
            and (st.sync_sent is None or now >= st.sync_sent + st.retry_s)
        ):
            # Same sequence numbers but different message sets (a message lost from
            # a host that has since restarted): anti-entropy, merge with this peer.
            self.counters.digest_mismatches += 1
            out.extend(self._request_sync(peer, now))
        return out

    def _judge_clock_of(self, peer: int, now: float) -> None:
        """Judge the peer's lease times by our own measurement of its clock: compared with
        another owner's, its reservations hold until they have surely ended on its clock,
        however far it runs behind and whatever our other peers say of it
        (:meth:`ClockWatch.behind`, within the window a timestamp may be in). A change
        recomputes the table, so a peer's figure changes at most once per heartbeat
        interval (a peer whose clock readings jump about cannot make every HELLO cost one)."""
        behind = self.clock.behind(peer, self.window_s)
        if behind == self.core.behind(peer) or 0 <= now - self._clock_judged.get(peer, -math.inf) < self.heartbeat_s:
            return
        self._clock_judged[peer] = now
        self.core.set_clock(peer, behind, self.limits.max_clock_offset_s)

    def _on_data(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        out = self._contact(peer, st, env, now)
        if out is None:
            return []
        if env.seq <= st.have or env.seq in st.ahead:
            self.counters.dropped += 1
            return out
        st.last_seq = max(st.last_seq, env.seq)
        if env.seq == st.have + 1:
            st.have = env.seq
            self._advance(st)
        elif len(st.ahead) < self.limits.max_ahead:
            st.ahead.add(env.seq)
        else:
            st.ahead.clear()  # a hole too wide to track message by message: the sync covers it
        if st.have < st.last_seq and st.synced:
            # A hole: something this peer sent never arrived. Only a sync that starts
            # after now can cover it.
            self.counters.gaps += 1
            st.synced = False
            out.extend(self._request_sync(peer, now))
        raw, sig = env.payload
        if self._apply_published(peer, raw, sig, now):
            # The owner releases a flow of its earlier incarnation that we never held: some
            # peer holds it, and so does the owner now; its snapshot brings both messages.
            out.extend(self._request_sync(peer, now))
        return out

    def _apply_published(self, peer: int, raw: bytes, sig: bytes, now: float) -> bool:
        """Apply a message its owner published; True when it releases a flow this replica
        does not hold but should (of the owner's earlier incarnation, or refused here for the
        owner's clock): the caller then asks the owner for its snapshot."""
        try:
            msg = decode(raw)
        except ProtocolError as e:
            self._count_invalid(e)
            return False
        if not self._timely(msg, now, direct=True) or not self._in_our_scope(msg):
            return False
        if (isinstance(msg, Release) and msg.flow[0] == peer and not self.core.knows(msg.flow)
                and ((msg.flow[1] >> 32) < self.peers[peer].incarnation_or(0) or msg.flow in self._skew_refused)):
            self._skew_refused.pop(msg.flow, None)
            self.core.receive(msg, now, sender=peer, defer=True)
            return True
        before = self.core.counters.invalid
        self.events.extend(self.core.receive(msg, now, sender=peer, defer=True))
        if self.core.counters.invalid > before:
            return False  # the core counted it (the node's count is of what never reached the core)
        if not self.core.knows(msg.flow):
            return False  # dropped (over the owner's share, stale): nothing to relay, no signature to keep
        self._keep_signature(msg, raw, sig)
        if isinstance(msg, Reserve):
            self.propagation_s.append(now - msg.ts)
        return False

    def _in_our_scope(self, msg: Message) -> bool:
        """A reservation outside our scope (of links we cannot hold) is refused and counted."""
        if isinstance(msg, Reserve) and not self._covers(msg.src, msg.dst):
            self.counters.invalid += 1
            self.counters.out_of_scope += 1
            return False
        return True

    def _covers(self, src: int, dst: int) -> bool:
        """Do all links a ``src`` -> ``dst`` reservation could hold lie in our scope?"""
        if self._scope is None:
            return True
        key = (src, dst)
        ok = self._in_scope.get(key)
        if ok is None:
            n = self.core.routes.n_hosts
            ok = 0 <= src < n and 0 <= dst < n and src != dst and pair_links(self.core.routes, src, dst) <= self._scope
            if len(self._in_scope) < 1 << 16:  # pairs a peer names: keep a bounded cache
                self._in_scope[key] = ok
        return ok

    def _timely(self, msg: Message, now: float, *, direct: bool, released: Collection[FlowId] = ()) -> bool:
        """Timestamps near our clock (old ones too, for a snapshot) and leases within the cap;
        no new reservation of an owner whose clock we measured off (see :meth:`_clock_fenced`)."""
        ok = msg.ts <= now + self.window_s and (not direct or msg.ts >= now - self.window_s)
        if ok and isinstance(msg, Reserve | Renew):
            ok = self.lease.accepts(msg.ts, msg.expires)
        if not ok:
            self.counters.invalid += 1
            self.counters.out_of_window += 1
            return False
        return not (isinstance(msg, Reserve) and msg.flow not in released and self._clock_fenced(msg, now))

    def _clock_fenced(self, msg: Reserve, now: float) -> bool:
        """Refuse a reservation whose owner's clock we measured further than the bound
        from ours, unless we are the skewed one: its timestamp and lease would mean other
        instants here than on its owner, whatever the owner believes of its clock.

        A replica that measured the owner sooner than another refuses what the other
        took; the owner, fenced by the same majority, releases it, and its RELEASE makes
        this replica fetch the pair from the owner (:meth:`_apply_published`), so that the
        replicas agree again (one already released is taken, see :meth:`_merge`)."""
        owner = msg.flow[0]
        # Beyond twice the bound: two hosts each within the bound of the majority may be
        # that far apart, and neither is fenced; one beyond it is off for the majority too,
        # which fences it, and its RELEASE then reconciles the replicas.
        if owner == self.host or not self.clock.off(owner, 2.0) or self.core.knows(msg.flow):
            return False  # one already held stays until its owner gives it up
        if self.skewed or not self.clock.trusted(now):
            return False  # our own clock is not backed by a majority: not ours to judge
        self.counters.skewed_owner += 1
        self._skew_refused[msg.flow] = None
        if len(self._skew_refused) > self.limits.max_ahead:
            del self._skew_refused[next(iter(self._skew_refused))]
        return True

    def _on_sync_request(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        st.last_heard = now
        if now < st.served_at + self.sync_timeout_s / 2:
            self.counters.sync_throttled += 1  # asked again too soon: its retry comes anyway
            return []
        st.served_at = now
        self.counters.sync_served += 1
        snapshot = self.core.snapshot()
        items = [self._signed(m) for m in snapshot]
        frozen = [[f[0], f[1], -1 if p is None else p, sh] for f, (p, sh) in self.core.frozen().items()]
        return [
            Send(peer, encode_envelope(K_SYNC_REP, self.host, self.incarnation, self._out_seq,
                                       [chunk, float(now), frozen_chunk, part, parts]))
            for part, parts, chunk, frozen_chunk in sync_parts(items, frozen, [m.flow for m in snapshot])
        ]

    def _on_sync_reply(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        self._heard(st, now)
        if st.sync_sent is None or (st.incarnation is not None and env.incarnation < st.incarnation):
            self.counters.dropped += 1  # unsolicited or stale reply
            return []
        items, _sent_at, frozen, part, parts = env.payload
        if part == 0:
            st.reply_seq, st.reply_next = env.seq, 0
        if part != st.reply_next or env.seq != st.reply_seq:
            self.counters.dropped += 1  # a part of another reply: wait for the retry
            return []
        st.reply_next += 1
        self._merge(peer, items, frozen, now)
        if part < parts - 1:
            return []
        st.reply_seq = None
        return self._finish_sync(peer, st, env, now)

    # ------------------------------------------------------------------ views
    def status(self, now: float) -> dict[str, Any]:
        peers = {
            str(p): {
                "up": now - st.last_heard <= self.peer_timeout_s,
                "synced": st.synced,
                "incarnation": st.incarnation,
                "last_seq": st.last_seq,
                "last_heard_s_ago": None if st.last_heard == -math.inf else round(now - st.last_heard, 3),
                "clock_offset_s": self.clock.offset(p),
            }
            for p, st in self.peers.items()
        }
        table = self.core.table()
        return {
            "host": self.host,
            "incarnation": self.incarnation,
            "ready": self.ready,
            "peers": peers,
            "reservations": len(table),
            "reserved_links": sorted(self.core.link_holders()),
            "local_flows": len(self._local),
            "digest": self.core.digest(),
            "clock": {"offset_s": self.clock.estimate(), "skewed": bool(self.skewed), "why": self.skewed,
                      "bound_s": self.limits.max_clock_offset_s, "ahead_of_us": self.clock.ahead_of_us(),
                      "behind_us": self.clock.behind_us()},
            "node": vars(self.counters).copy(),
            "core": vars(self.core.counters).copy(),
        }

    # ------------------------------------------------------------------ internals
    def _expiry(self, flow: FlowId, now: float, nbytes: int) -> float:
        end = self.core.end_of(flow)
        dst, path, _port, reserved = self.core.local_flow(flow)
        if end is not None and end != math.inf and reserved:
            return end
        # Not reserved (intra-leaf, ECMP fallback, skewed clock): the same lease, kept locally.
        return now + self.lease(nbytes, self.core.routes.path_rate_bps(self.host, dst, path))

    def _lease(self, flow: FlowId) -> Lease:
        dst, path, port, reserved = self.core.local_flow(flow)
        lo = self._local[flow]
        # Reserved at first and no longer: a skewed clock gave it up, or a race took it.
        why = "" if reserved else lo.why or (CLOCK_SKEWED if self.skewed else RACE_LOST)
        return Lease(flow, dst, path, port, flow_label_for_sport(port), lo.expires, reserved, why)

    def _release(self, flow: FlowId, now: float) -> list[Output]:
        self._local.pop(flow, None)
        rel = self.core.release(flow, now)
        self.events.extend(rel.events)
        return self._publish(rel.messages)

    def _publish(self, msgs: Sequence[Message]) -> list[Output]:
        if self.defer_publish:
            self._deferred.extend(msgs)
            return []
        out: list[Output] = []
        for m in msgs:
            self._out_seq += 1
            self.counters.published += 1
            raw = encode(m)
            sig = self._sign(raw) if self._sign is not None else b""
            self._keep_signature(m, raw, sig)
            out.append(Publish(encode_envelope(K_DATA, self.host, self.incarnation, self._out_seq, [raw, sig])))
        return out

    def publish_deferred(self) -> list[Output]:
        """What was published while :attr:`defer_publish` was set: signed and enveloped now,
        in the order it was published (its sequence numbers are taken now)."""
        msgs, self._deferred = self._deferred, []
        return self._publish(msgs) if msgs else []

    def _keep_signature(self, msg: Message, raw: bytes, sig: bytes) -> None:
        """Remember a message's signed bytes, to relay it in a snapshot: a flow's
        reservation, its latest renewal and its earliest release (what a snapshot holds)."""
        kind = _KIND[type(msg)]
        order = msg.expires if isinstance(msg, Renew) else -msg.ts  # larger is kept
        held = self._sigs.setdefault(msg.flow, {})
        old = held.get(kind)
        if old is None or order > old[2]:
            held[kind] = (raw, sig, order)

    def _signed(self, msg: Message) -> SignedMessage:
        raw = encode(msg)
        held = self._sigs.get(msg.flow, {}).get(_KIND[type(msg)])
        return (raw, held[1]) if held is not None and held[0] == raw else (raw, b"")

    def _prune_signatures(self, now: float) -> None:
        self._sigs_pruned = now
        for f in [f for f in self._sigs if not self.core.knows(f)]:
            del self._sigs[f]
        for f in [f for f in self._frozen_votes if not self.core.knows(f)]:
            del self._frozen_votes[f]
            self._adopted.discard(f)

    def _hello(self, now: float) -> list[Output]:
        self._next_hello = now + self.heartbeat_s
        # Ends between half the retention ago and digest_lag_s ago: settled on every
        # replica that has the same messages (nothing of it is in flight any more).
        since = float(now - self.core.retention_s / 2)
        until = float(now - self.digest_lag_s)
        payload = [self.core.state_digest(since, until, owner=self.host), since, until, float(now),
                   self.clock.echoes(now)]
        self.clock.sent(float(now))
        return [Publish(encode_envelope(K_HELLO, self.host, self.incarnation, self._out_seq, payload))]

    def _request_sync(self, peer: int, now: float, *, urgent: bool = False, retry: bool = False) -> list[Output]:
        """Ask ``peer`` for a snapshot, unless a request to it is out and not yet due a retry.

        A retry of an unanswered request waits twice as long as the last (up to 8 x
        ``sync_timeout_s``): a peer that cannot answer is not asked ever faster. Hearing
        from it again resets the wait (:meth:`_contact`).
        """
        st = self.peers[peer]
        if not urgent and not retry and st.sync_sent is not None and now < st.sync_sent + st.retry_s:
            return []
        st.retry_s = min(2 * st.retry_s, 8 * self.sync_timeout_s) if retry else self.sync_timeout_s
        st.sync_sent = now
        self._syncing.add(peer)
        self.counters.sync_requests += 1
        return [Send(peer, encode_envelope(K_SYNC_REQ, self.host, self.incarnation, 0, None))]

    def _update_ready(self, now: float) -> None:
        if not self.ready and self._started_at is not None:
            waiting = [p for p, st in self.peers.items() if not st.synced]
            if not waiting or now >= self._started_at + self.sync_timeout_s:
                self.ready = True

    def _judge_clock(self, now: float) -> list[Output]:
        """Stop reserving while a majority of peers proves our clock wrong; give up what we hold."""
        verdict = self.clock.verdict(now)
        if verdict is None:
            return []  # no peer heard lately: keep the verdict we had
        skewed, why = verdict
        was, self.skewed = self.skewed, why if skewed else ""
        if not skewed or was:
            return []
        out: list[Output] = []
        for f in self._local:  # every reservation of ours, also one a lost race left unheld
            rel = self.core.unreserve(f, now)
            self.events.extend(rel.events)
            out.extend(self._publish(rel.messages))
        return out

    def _merge(self, peer: int, items: list[list[bytes]], frozen: list[list[Any]], now: float) -> None:
        """Apply one part of a peer's snapshot: messages we may take from it, then the
        assignments it can no longer recompute for its own flows."""
        decoded: list[tuple[Message, bytes, bytes]] = []
        for raw, sig in items:
            try:
                decoded.append((decode(raw), raw, sig))
            except ProtocolError as e:
                self._count_invalid(e)
        released = {m.flow for m, _r, _s in decoded if isinstance(m, Release)}
        msgs = [(m, raw, sig) for m, raw, sig in decoded
                if self._takes(peer, m, raw, sig, released) and self._timely(m, now, direct=False, released=released)
                and self._in_our_scope(m)]
        for m, raw, sig in _merge_order(msgs):
            self.core.receive(m, now, sender=m.flow[0], defer=True)
            self._keep_signature(m, raw, sig)
        self.events.extend(self.core.flush())
        self._merging += 1
        decided = self._vote_frozen(peer, frozen)
        if decided:
            self.events.extend(self.core.adopt(decided))

    def _vote_frozen(self, peer: int, frozen: list[list[Any]]) -> dict[FlowId, tuple[int | None, bool] | None]:
        """Record a peer's claims about assignments it can no longer recompute, and decide,
        per flow, what this replica takes (see :meth:`_trusted`).

        A claim is one peer's word and counts as one vote. It is never taken for a
        reservation this replica can recompute itself (it saw every message around it), nor
        for one it froze itself; a claim that contradicts what this replica knows or what the
        others say is counted (``frozen_conflicts``) and reported (:attr:`alerts`)."""
        decided: dict[FlowId, tuple[int | None, bool] | None] = {}
        for o, q, p, sh in frozen:
            f = (o, q)
            held = self.core.assignment(f)
            if held is None:
                continue
            claim = (None if p < 0 else p, sh)
            ts, is_frozen, path, shared = held
            if ts >= self._complete_from or (is_frozen and f not in self._adopted):
                if claim != (path, shared):
                    self._conflict(peer, f, claim, (path, shared))
                continue
            votes = self._frozen_votes.setdefault(f, {})
            votes[peer] = claim
            value = self._trusted(f, votes, owners_word=ts < self._joined_from)
            if claim != value and len(set(votes.values())) > 1:
                self._conflict(peer, f, claim, value)  # it disagrees with another peer's word
            if value is None and f not in self._adopted:
                continue  # nothing taken before, nothing to thaw
            if value is None:
                self._adopted.discard(f)
            else:
                self._adopted.add(f)
            decided[f] = value
        return decided

    def _trusted(self, f: FlowId, votes: dict[int, tuple[int | None, bool]], *,
                 owners_word: bool) -> tuple[int | None, bool] | None:
        """The claimed assignment this replica may take, or None (recompute it here).

        Taken: what more than half of the listed peers claim; else, for a reservation that
        started before this replica joined (``owners_word``), what its owner claims (the
        owner sends on the path it believes it holds, and a joiner has nothing better).
        A reservation that became unrecomputable only because this replica went blind for
        a while (see ``_complete_from``) needs the majority: a peer that stays silent and
        comes back cannot make its own word count. A lying peer is one vote: it can neither
        move another host's reservation alone nor outvote the honest peers that froze it."""
        counts: dict[tuple[int | None, bool], int] = {}
        for claim in votes.values():
            counts[claim] = counts.get(claim, 0) + 1
        best = max(counts.items(), key=lambda kv: kv[1])
        if 2 * best[1] > len(self.peers):
            return best[0]
        return votes.get(f[0]) if owners_word else None

    def _conflict(self, peer: int, f: FlowId, claim: tuple[int | None, bool],
                  known: tuple[int | None, bool] | None) -> None:
        """Count a refused claim; report the first of each reply part (a liar can send
        thousands a part: one log line each would be a flood of its own)."""
        self.counters.frozen_conflicts += 1
        last = self.alerts[-1] if self.alerts else None
        if last is not None and last.get("part_of") == self._merging:
            last["count"] += 1
            return
        self.alerts.append({"event": "frozen_claim_refused", "peer": peer, "flow": list(f), "claim": list(claim),
                            "known": None if known is None else list(known), "count": 1, "part_of": self._merging})

    def _takes(self, peer: int, m: Message, raw: bytes, sig: bytes, released: set[FlowId]) -> bool:
        """May this snapshot item be taken? The peer's own messages, ours, and a third host's
        only with its owner's signature, while that owner is not synced with us (it speaks for
        its current flows itself), and, for a flow of an owner's earlier incarnation that we do
        not hold, only together with its RELEASE: the restarted owner releases every flow of
        its predecessor it learns of, so one without a RELEASE is either about to be released
        (the owner's RELEASE then brings it here, see :meth:`_on_data`) or a replay of one the
        cluster has forgotten."""
        owner = m.flow[0]
        if owner == peer:
            return True
        if owner != self.host:
            other = self.peers.get(owner)
            if other is None:
                return False
            if other.synced and (m.flow[1] >> 32) == other.incarnation:
                return False  # a live, synced owner speaks for its own flows
            if ((m.flow[1] >> 32) < other.incarnation_or(0) and not isinstance(m, Release)
                    and m.flow not in released and not self.core.knows(m.flow)):
                self.counters.replayed += 1
                return False
        if self._verify is not None and not (sig and self._verify(owner, raw, sig)):
            self.counters.forged += 1
            return False
        return True

    def _finish_sync(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        if st.incarnation != env.incarnation:
            st.incarnation, st.last_seq, st.have = env.incarnation, 0, 0
            st.ahead.clear()
        # The snapshot covers everything the peer sent up to env.seq, and every reservation
        # the peer still held: it forgot only those that ended a retention ago on its clock.
        horizon = now - self.core.retention_s + self.limits.max_clock_offset_s
        if self._joined_from == math.inf:
            self._joined_from = self._complete_from = horizon
        elif st.blind:
            self._complete_from = max(self._complete_from, horizon)
        st.blind = False
        st.have = max(st.have, env.seq)
        self._advance(st)
        st.last_seq = max(st.last_seq, st.have)
        self.counters.sync_applied += 1
        out: list[Output] = []
        if st.have >= st.last_seq:
            st.synced = True
            st.sync_sent = None
            self._syncing.discard(peer)
        else:
            # A hole above what this snapshot covers (a reply that was already on its
            # way when the loss happened): ask again.
            out.extend(self._request_sync(peer, now, urgent=True))
        self._update_ready(now)
        return out + self._release_predecessors(now)

    @staticmethod
    def _advance(st: PeerState) -> None:
        while st.have + 1 in st.ahead:
            st.have += 1
            st.ahead.discard(st.have)
        if st.ahead:
            st.ahead = {s for s in st.ahead if s > st.have}

    def _release_predecessors(self, now: float) -> list[Output]:
        """Release our host's reservations that this incarnation does not own."""
        mine = set(self._local)
        out: list[Output] = []
        for f, (res, released, _p, _s) in self.core.entries().items():
            if f[0] == self.host and f not in mine and released is None:
                ts = max(float(now), res.ts)
                self.counters.predecessor_releases += 1
                self.events.extend(self.core.receive(Release(f, ts), now))
                out.extend(self._publish([Release(f, ts)]))
        return out


_RANK = {Renew: 0, Reserve: 1, Release: 2}


def _merge_order(msgs: list[tuple[Message, bytes, bytes]]) -> list[tuple[Message, bytes, bytes]]:
    """The order in which a snapshot part is applied: reservations in key order, each
    right after its flow's renewal and right before its flow's release; then what is
    left (renewals and releases of flows whose RESERVE the part does not carry) by time.

    Whether a RESERVE is stale depends on how long its flow really lived, which only its
    RENEW and RELEASE tell: a RENEW held as an early message keeps a flow renewed past its
    first lease from being refused, and a RELEASE applied to the entry ends it. A RELEASE
    of a flow not known yet, applied first, could be refused as stale while the RESERVE
    behind it is not; one flow at a time, no early message waits longer than its RESERVE.
    """
    keys = {m.flow: m.key for m, _r, _s in msgs if isinstance(m, Reserve)}

    def order(x: tuple[Message, bytes, bytes]) -> tuple[int, Key, int]:
        m = x[0]
        key = keys.get(m.flow)
        return (0, key, _RANK[type(m)]) if key is not None else (1, (m.ts, 0, 0), 0)

    return sorted(msgs, key=order)
