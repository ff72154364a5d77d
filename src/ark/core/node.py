"""One host's control-plane node: the reservation core plus replication, sans-IO.

:class:`Node` wraps :class:`ark.core.protocol.ArkCore` with everything a real deployment
needs between hosts, still without sockets or clocks (``now`` is passed in):

* an envelope per published message ``[1, kind, sender, incarnation, seq, payload]``
  with a per-sender sequence number, so that a receiver sees gaps;
* HELLO heartbeats carrying the sender's last sequence number (tail gaps, peer liveness)
  and a digest of its recent message set (anti-entropy: a mismatch triggers a sync);
* SYNC request / reply: a (re)starting node, or one that saw a gap, asks the peer for
  every message it holds. The table is a function of the message set, so merging sets
  converges. The replying peer's own flows are always taken; a third host's only while
  that host is not synced with us or when they belong to an earlier incarnation of it
  (a live, synced host is authoritative for its current flows), and only in answer to a
  request we sent;
* after a restart the node releases, with real RELEASE messages, every reservation of
  its host that it does not own (its predecessor's), as soon as it learns of them;
* leases: a reservation lasts ``lease(nbytes, rate)`` and is renewed by the local client
  (:meth:`Node.renew`); a local flow whose client stops renewing is released, and a dead
  host's reservations end everywhere when their lease runs out;
* readiness: after :meth:`Node.start` the node refuses reservations until every peer has
  answered its sync request or ``sync_timeout_s`` has passed.

The agent (``ark.agent.daemon``) moves the bytes this class returns; the fault harness in the
tests drives it over a simulated network with loss, duplication, reordering, partitions,
crashes and clock skew.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from ark.core.messages import FlowId, Message, ProtocolError, Release, Renew, Reserve, decode, encode
from ark.core.protocol import ArkCore, CoreError, PathMaps, Repath, Routes
from ark.core.roce import flow_label_for_sport

ENVELOPE_VERSION = 1
K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP = 1, 2, 3, 4
MAX_ENVELOPE_BYTES = 4 << 20
_U32 = 0xFFFFFFFF
_U63 = 2**63 - 1


class NotReady(CoreError):
    """The node is still resynchronising with its peers."""


@dataclass(frozen=True)
class LeasePolicy:
    """lease(nbytes, rate) = min_s + slack x (nbytes x 8 / rate)."""

    min_s: float = 1.0
    slack: float = 2.0

    def __post_init__(self) -> None:
        if not self.min_s > 0:
            raise CoreError(f"lease.min_s: must be > 0; got {self.min_s}")
        if not self.slack >= 1:
            raise CoreError(f"lease.slack: must be >= 1; got {self.slack}")

    def __call__(self, nbytes: int, rate_bps: float) -> float:
        return self.min_s + self.slack * nbytes * 8.0 / rate_bps


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


@dataclass
class PeerState:
    incarnation: int | None = None
    last_seq: int = 0  # highest sequence number seen
    have: int = 0  # every message up to this one is applied (directly or by a sync)
    ahead: set[int] = field(default_factory=set)  # applied, above a hole
    last_heard: float = -math.inf
    synced: bool = False
    sync_sent: float | None = None


@dataclass
class _Local:
    dst: int
    dport: int
    nbytes: int
    expires: float


@dataclass
class NodeCounters:
    published: int = 0
    received: int = 0
    invalid: int = 0  # malformed envelopes or messages, or sender mismatch
    dropped: int = 0  # duplicates and old sequence numbers
    gaps: int = 0
    sync_requests: int = 0
    sync_served: int = 0
    sync_applied: int = 0
    digest_mismatches: int = 0
    predecessor_releases: int = 0  # our host's flows from before a restart, released
    local_expired: int = 0


@dataclass
class Envelope:
    kind: int
    sender: int
    incarnation: int
    seq: int
    payload: Any


def encode_envelope(kind: int, sender: int, incarnation: int, seq: int, payload: Any) -> bytes:
    out: bytes = msgpack.packb([ENVELOPE_VERSION, kind, sender, incarnation, seq, payload], use_bin_type=True)
    return out


def decode_envelope(data: bytes) -> Envelope:
    """Parse and validate an envelope (not its payload's messages)."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ProtocolError(f"envelope: {len(data)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, max_map_len=0, max_ext_len=0, strict_map_key=True)
    except Exception as e:  # garbage of any kind is malformed
        raise ProtocolError(f"envelope: not valid msgpack ({type(e).__name__})") from None
    if not isinstance(body, list) or len(body) != 6:
        raise ProtocolError("envelope: expected an array of 6 fields")
    v, kind, sender, inc, seq, payload = body
    if v != ENVELOPE_VERSION or type(v) is not int:
        raise ProtocolError(f"envelope version: expected {ENVELOPE_VERSION}, got {v!r:.40}")
    for name, val, hi in (("kind", kind, 4), ("sender", sender, _U32), ("incarnation", inc, _U63), ("seq", seq, _U63)):
        if type(val) is not int or not 0 <= val <= hi:
            raise ProtocolError(f"envelope {name}: expected an integer in 0..{hi}, got {val!r:.40}")
    if kind == 0:
        raise ProtocolError("envelope kind: expected 1..4, got 0")
    if kind == K_DATA and not isinstance(payload, bytes):
        raise ProtocolError("envelope payload: data needs bytes")
    if kind == K_HELLO and (
        not isinstance(payload, list) or len(payload) != 3 or not isinstance(payload[0], bytes)
        or not all(type(v) is float and math.isfinite(v) for v in payload[1:])
    ):
        raise ProtocolError("envelope payload: hello needs [digest bytes, since, until]")
    if kind == K_SYNC_REP and (
        not isinstance(payload, list)
        or len(payload) != 3
        or not isinstance(payload[0], list)
        or not all(isinstance(x, bytes) for x in payload[0])
        or type(payload[1]) is not float
        or not math.isfinite(payload[1])
        or not isinstance(payload[2], list)
        or not all(
            isinstance(x, list) and len(x) == 4 and all(type(v) is int for v in x[:3])
            and type(x[3]) is bool and 0 <= x[0] <= _U32 and 0 <= x[1] <= _U63 and -1 <= x[2] <= 0xFFFF
            for x in payload[2]
        )
    ):
        raise ProtocolError("envelope payload: sync reply needs [[bytes...], float, [[owner, seq, path, shared]...]]")
    return Envelope(kind, sender, inc, seq, payload)


class Node:
    """A host's reservation core with replication, leases and resync (sans-IO)."""

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
    ) -> None:
        if host in peers:
            raise CoreError(f"peers: must not include this host ({host})")
        if not 0 <= incarnation < 2**30:
            raise CoreError(f"incarnation: must be 0..2**30-1; got {incarnation}")
        for name, v in (("heartbeat_s", heartbeat_s), ("peer_timeout_s", peer_timeout_s), ("sync_timeout_s", sync_timeout_s)):
            if not v > 0:
                raise CoreError(f"{name}: must be > 0; got {v}")
        self.host = host
        self.incarnation = incarnation
        self.lease = lease or LeasePolicy()
        self.core = ArkCore(
            host, routes, pathmaps, policy=policy, seed=seed, retention_s=retention_s,
            lease=self.lease, expiry_grace_s=expiry_grace_s, seq_base=incarnation << 32,
        )
        self.peers: dict[int, PeerState] = {p: PeerState() for p in peers}
        self.heartbeat_s, self.peer_timeout_s, self.sync_timeout_s = heartbeat_s, peer_timeout_s, sync_timeout_s
        self.counters = NodeCounters()
        self.max_lease_s = 600.0  # a lease longer than this from a peer is malformed
        self.digest_lag_s = 0.3  # anti-entropy compares ends at least this old
        self.propagation_s: deque[float] = deque(maxlen=latency_samples)
        self.ready = False
        self._started_at: float | None = None
        self._out_seq = 0
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
            out.extend(self._request_sync(p, now))
        out.extend(self._hello(now))
        return out

    def tick(self, now: float) -> list[Output]:
        """Timers: heartbeats, sync retries, readiness, local lease expiry, core expiry."""
        out: list[Output] = []
        if now >= self._next_hello:
            out.extend(self._hello(now))
        for p, st in self.peers.items():
            if not st.synced and st.sync_sent is not None and now >= st.sync_sent + self.sync_timeout_s:
                out.extend(self._request_sync(p, now))
        self._update_ready(now)
        for f in [f for f, lo in self._local.items() if lo.expires <= now]:
            self.counters.local_expired += 1
            out.extend(self._release(f, now))
        self.events.extend(self.core.tick(now))
        return out

    def next_deadline(self, now: float) -> float:
        """When :meth:`tick` next has work: a heartbeat, a sync retry, readiness, a local
        lease running out, or the core's expiry and forgetting. A driver sleeps until then
        (or until a message arrives) instead of polling."""
        t = min(self._next_hello, self.core.next_deadline())
        for p in self._syncing:
            st = self.peers[p]
            if not st.synced and st.sync_sent is not None:
                t = min(t, st.sync_sent + self.sync_timeout_s)
        if not self.ready and self._started_at is not None:
            t = min(t, self._started_at + self.sync_timeout_s)
        if self._local:
            t = min(t, min(lo.expires for lo in self._local.values()))
        return max(t, now) if t != math.inf else t

    # ------------------------------------------------------------------ local API
    def reserve(
        self, dst: int, nbytes: int, now: float, dport: int = 4791, prefer_port: int | None = None
    ) -> tuple[Lease, list[Output]]:
        if not self.ready:
            raise NotReady("node: resynchronising with peers; retry shortly")
        dec = self.core.request(dst, nbytes, now, dport, prefer_port)
        self.events.extend(dec.events)
        expires = self._expiry(dec.flow, now, nbytes)
        self._local[dec.flow] = _Local(dst, dport, nbytes, expires)
        return self._lease(dec.flow), self._publish(dec.messages)

    def renew(self, flow: FlowId, now: float) -> tuple[Lease, list[Output]]:
        flow = self.resolve(flow)
        lo = self._local.get(flow)
        if lo is None:
            raise CoreError(f"flow: {flow} is not an active local flow (released or expired)")
        msgs = self.core.renew(flow, now)
        lo.expires = self._expiry(flow, now, lo.nbytes)
        return self._lease(flow), self._publish(msgs)

    def release(self, flow: FlowId, now: float) -> list[Output]:
        old = flow
        flow = self.resolve(flow)
        while old in self._alias:  # the owner is done with the whole chain
            old = self._alias.pop(old)
        if flow not in self._local:
            raise CoreError(f"flow: {flow} is not an active local flow (released or expired)")
        return self._release(flow, now)

    def lease_of(self, flow: FlowId) -> Lease:
        flow = self.resolve(flow)
        if flow not in self._local:
            raise CoreError(f"flow: {flow} is not an active local flow (released or expired)")
        return self._lease(flow)

    def more_ports(self, flow: FlowId, n: int) -> list[int]:
        """Up to ``n`` more ports of the flow's current path, held until it is released."""
        flow = self.resolve(flow)
        if flow not in self._local:
            raise CoreError(f"flow: {flow} is not an active local flow (released or expired)")
        return self.core.more_ports(flow, n)

    def local_flows(self) -> list[FlowId]:
        return list(self._local)

    def resolve(self, flow: FlowId) -> FlowId:
        """The reservation a flow id stands for now (itself unless it was re-pathed)."""
        while flow in self._alias:
            flow = self._alias[flow]
        return flow

    def reload_pathmaps(self, now: float) -> tuple[dict[FlowId, Lease], list[Output]]:
        """Take fresh path maps and re-path live reservations whose port moved.

        After a re-hash a reserved flow's port may lead over another spine than its
        reservation: the table would be wrong. Such a flow is released and reserved
        anew: on the path its port now leads to when that path is free (the port stays),
        else on a free path with a new port. Its old id stays valid for renew, release
        and lease_of, which answer with the new lease, so the owner learns any new port.
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
        """Any envelope from ``peer`` on a channel that authenticates the peer."""
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
        except ProtocolError:
            self.counters.invalid += 1
            return []
        st = self.peers.get(peer)
        if env.kind not in kinds or st is None or env.sender != peer:
            self.counters.invalid += 1
            return []
        return self._handlers[env.kind](peer, st, env, now)

    def _contact(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output] | None:
        """Bookkeeping for a broadcast envelope; None when it is from a dead incarnation."""
        if st.incarnation is not None and env.incarnation < st.incarnation:
            self.counters.dropped += 1  # a delayed message from before the peer restarted
            return None
        st.last_heard = now
        if st.incarnation == env.incarnation:
            return []
        # First contact or a restart: its sequence numbers start over.
        st.incarnation, st.last_seq, st.have, st.synced = env.incarnation, 0, 0, False
        st.ahead.clear()
        return self._request_sync(peer, now)

    def _on_hello(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        out = self._contact(peer, st, env, now)
        if out is None:
            return []
        st.last_seq = max(st.last_seq, env.seq)
        if env.seq > st.have and st.synced:
            self.counters.gaps += 1
            st.synced = False
            out.extend(self._request_sync(peer, now))
        elif (
            st.synced
            and env.payload[0] != self.core.state_digest(env.payload[1], env.payload[2])
            and (st.sync_sent is None or now - st.sync_sent >= self.sync_timeout_s)
        ):
            # Same sequence numbers but different message sets (a message lost from
            # a host that has since restarted): anti-entropy, merge with this peer.
            self.counters.digest_mismatches += 1
            out.extend(self._request_sync(peer, now))
        return out

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
        else:
            st.ahead.add(env.seq)
        if st.have < st.last_seq and st.synced:
            # A hole: something this peer sent never arrived. Only a sync that starts
            # after now can cover it.
            self.counters.gaps += 1
            st.synced = False
            out.extend(self._request_sync(peer, now))
        self._apply_published(peer, env.payload, now)
        return out

    def _apply_published(self, peer: int, payload: bytes, now: float) -> None:
        try:
            msg = decode(payload)
        except ProtocolError:
            self.counters.invalid += 1
            return
        if not self._sane(msg):
            self.counters.invalid += 1
            return
        before = self.core.counters.invalid
        self.events.extend(self.core.receive(msg, now, sender=peer))
        if self.core.counters.invalid > before:
            self.counters.invalid += 1
        elif isinstance(msg, Reserve):
            self.propagation_s.append(now - msg.ts)

    def _on_sync_request(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        st.last_heard = now
        self.counters.sync_served += 1
        snap = [encode(m) for m in self.core.snapshot()]
        frozen = [[f[0], f[1], -1 if p is None else p, sh] for f, (p, sh) in self.core.frozen().items()]
        rep = encode_envelope(K_SYNC_REP, self.host, self.incarnation, self._out_seq, [snap, float(now), frozen])
        return [Send(peer, rep)]

    def _on_sync_reply(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        st.last_heard = now
        if st.sync_sent is None or (st.incarnation is not None and env.incarnation < st.incarnation):
            self.counters.dropped += 1  # unsolicited or stale reply
            return []
        return self._apply_sync(peer, st, env, now)

    # ------------------------------------------------------------------ views
    def status(self, now: float) -> dict[str, Any]:
        peers = {
            str(p): {
                "up": now - st.last_heard <= self.peer_timeout_s,
                "synced": st.synced,
                "incarnation": st.incarnation,
                "last_seq": st.last_seq,
                "last_heard_s_ago": None if st.last_heard == -math.inf else round(now - st.last_heard, 3),
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
            "node": vars(self.counters).copy(),
            "core": vars(self.core.counters).copy(),
        }

    # ------------------------------------------------------------------ internals
    def _expiry(self, flow: FlowId, now: float, nbytes: int) -> float:
        end = self.core.end_of(flow)
        if end is not None and end != math.inf:
            return end
        # Not reserved (intra-leaf or ECMP fallback): the same lease, kept locally.
        dst, path, _port, _res = self.core.local_flows()[flow]
        return now + self.lease(nbytes, self.core.routes.path_rate_bps(self.host, dst, path))

    def _lease(self, flow: FlowId) -> Lease:
        dst, path, port, reserved = self.core.local_flows()[flow]
        return Lease(flow, dst, path, port, flow_label_for_sport(port), self._local[flow].expires, reserved)

    def _release(self, flow: FlowId, now: float) -> list[Output]:
        self._local.pop(flow, None)
        rel = self.core.release(flow, now)
        self.events.extend(rel.events)
        return self._publish(rel.messages)

    def _publish(self, msgs: Sequence[Message]) -> list[Output]:
        out: list[Output] = []
        for m in msgs:
            self._out_seq += 1
            self.counters.published += 1
            out.append(Publish(encode_envelope(K_DATA, self.host, self.incarnation, self._out_seq, encode(m))))
        return out

    def _hello(self, now: float) -> list[Output]:
        self._next_hello = now + self.heartbeat_s
        # Ends between half the retention ago and digest_lag_s ago: settled on every
        # replica that has the same messages (nothing of it is in flight any more).
        since = float(now - self.core.retention_s / 2)
        until = float(now - self.digest_lag_s)
        payload = [self.core.state_digest(since, until), since, until]
        return [Publish(encode_envelope(K_HELLO, self.host, self.incarnation, self._out_seq, payload))]

    def _request_sync(self, peer: int, now: float) -> list[Output]:
        st = self.peers[peer]
        st.sync_sent = now
        self._syncing.add(peer)
        self.counters.sync_requests += 1
        return [Send(peer, encode_envelope(K_SYNC_REQ, self.host, self.incarnation, 0, None))]

    def _update_ready(self, now: float) -> None:
        if not self.ready and self._started_at is not None:
            waiting = [p for p, st in self.peers.items() if not st.synced]
            if not waiting or now >= self._started_at + self.sync_timeout_s:
                self.ready = True

    def _sane(self, msg: Message) -> bool:
        """Bounds the core cannot judge: a lease longer than ``max_lease_s``."""
        if isinstance(msg, Reserve | Renew):
            return msg.expires == math.inf or msg.expires - msg.ts <= self.max_lease_s
        return True

    def _apply_sync(self, peer: int, st: PeerState, env: Envelope, now: float) -> list[Output]:
        if st.incarnation != env.incarnation:
            st.incarnation, st.last_seq, st.have = env.incarnation, 0, 0
            st.ahead.clear()
        msgs: list[Message] = []
        for raw in env.payload[0]:
            try:
                m = decode(raw)
            except ProtocolError:
                self.counters.invalid += 1
                continue
            owner = m.flow[0]
            if owner != peer and owner != self.host:
                other = self.peers.get(owner)
                if other is None:
                    continue
                if other.synced and (m.flow[1] >> 32) == other.incarnation:
                    continue  # a live, synced owner speaks for its own flows
            if not self._sane(m):
                self.counters.invalid += 1
                continue
            msgs.append(m)
        # Reservations first (in key order), then renewals and releases.
        msgs.sort(key=lambda m: (0, m.key) if isinstance(m, Reserve) else (1, (m.ts, 0, 0)))
        for m in msgs:
            self.events.extend(self.core.receive(m, now, sender=m.flow[0]))
        # Assignments the peer can no longer recompute (an overlapping reservation was
        # forgotten there): take them as they are.
        frozen = {(o, q): (None if p < 0 else p, sh) for o, q, p, sh in env.payload[2]}
        if frozen:
            self.events.extend(self.core.adopt(frozen))
        # The snapshot covers everything the peer sent up to env.seq.
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
            out.extend(self._request_sync(peer, now))
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
