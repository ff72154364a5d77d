"""The ARK agent: one per host, moving the bytes of an :class:`ark.core.node.Node`.

Sockets (ZeroMQ, brokerless, every peer link CURVE-encrypted and authenticated):

* inbound: one ROUTER (CURVE server) bound on ``control``. A ZAP handler admits only the
  public keys listed in the cluster file and stamps every message with the sender's key
  (ZMQ ``User-Id``), so a message counts only if it comes from the host it claims;
* outbound: one DEALER per peer (CURVE client pinned to that peer's public key),
  connected to the peer's ``control``. A broadcast (RESERVE / RENEW / RELEASE / HELLO)
  goes out on all of them; sync requests and replies on one;
* ROUTER on ``api`` (ipc://, local only): the serving engines' requests
  (:mod:`ark.agent.api`); the flows of a client process that dies are released
  (:mod:`ark.agent.holders`);
* optionally a plain TCP listener on 127.0.0.1:``metrics_port``, polled by the same loop
  (:class:`ark.agent.metrics.MetricsServer`): no thread ever reads the node.

Why not PUB/SUB sockets: a SUB per peer costs the receiver a wakeup and a poll slot per
peer, and a single SUB cannot tell senders apart. The inbound ROUTER gives one socket to
poll and an authenticated sender per message. A stranger can neither receive (our
DEALERs only talk to listed keys at listed addresses) nor send (ZAP refuses its key),
and it cannot pose as a listed peer without that peer's secret key.

The loop sleeps until a message arrives or the next deadline (the node's timers, the
peer watch, the periodic path check); it never polls on a fixed period. Time is the
wall clock (hosts are assumed PTP-synchronised, as the protocol's race rule requires).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ark.agent.api import API_MAX_BYTES, LocalApi, lease_dict
from ark.agent.arbiter_link import ArbiterForwarder
from ark.agent.cluster import Cluster, HostEntry
from ark.agent.holders import Holders
from ark.agent.incarnation import IncarnationError, next_incarnation
from ark.agent.keys import Signatures
from ark.agent.logs import event as _ev
from ark.agent.logs import setup_logging
from ark.agent.metrics import SCRAPES_AT_ONCE, MetricsServer, registry
from ark.agent.refresh import PathRefresher
from ark.agent.sockets import (
    HANDSHAKE_IVL_MS,
    AgentError,
    ConnectionGuard,
    ZapKeys,
    bind,
    check_resolvable,
    endpoint_ips,
    ipc_identity,
    open_api,
    own_curve_keys,
    raise_fd_limit,
    readable,
    recv_frames,
    remove_ipc,
)
from ark.core.envelope import MAX_ENVELOPE_BYTES
from ark.core.node import Node, NodeLimits, Output, Publish
from ark.core.protocol import CoreError, CoreLimits

log = logging.getLogger("ark.agent")


class Agent:
    def __init__(self, cluster: Cluster, host: str, secret_key_file: str | None = None) -> None:
        self.cluster = cluster
        self.me: HostEntry = cluster.host(host)
        self.public, self.secret = own_curve_keys(secret_key_file or self.me.secret_key_file, self.me.public_key,
                                                  host, "[[hosts]]")
        scope = cluster.traffic_scope()
        # Scoped: only the senders whose flows can share a link with ours (ark.core.scope).
        self.scope_links = None if scope is None else scope.links(self.me.index)
        talk = None if scope is None else scope.peers(self.me.index)
        if cluster.control == "arbiter":  # no replica: nobody to tell, the arbiters decide
            talk = frozenset()
        self.peers = {h.index: h for h in cluster.hosts if h.index != self.me.index and (talk is None or h.index in talk)}
        for i, h in enumerate(cluster.hosts):
            check_resolvable(h.control, f"hosts[{i}].control")
        self.maps = cluster.pathmaps()
        self.signatures = Signatures(self.secret, {h.index: h.sign_key for h in cluster.hosts})
        try:
            incarnation = next_incarnation(cluster.state_dir, host)
        except IncarnationError as e:
            raise AgentError(str(e)) from None
        self.node = self._node(incarnation)
        self.api = LocalApi(self)
        self.arbiter = ArbiterForwarder(self) if cluster.control == "arbiter" else None
        self.refresher = PathRefresher(cluster, self.me.name)
        self._stop = False
        self._up: dict[int, bool] = {}
        self._timers_at = 0.0
        self._peers_due = 0.0  # peer messages wait until then (a batch window, ``batch_s``)
        self._arrivals = _ArrivalRate(0.1)  # peer messages per second, over the last 0.1 s
        self._was_ready = False
        self._skewed = ""
        self.dropped_out = 0
        self.errors = 0  # messages or requests whose handling raised: counted, never fatal
        self.rate_limited = 0  # peer messages dropped: over the peer's rate
        self._buckets: dict[int, list[float]] = {}  # peer -> [tokens, last refill]
        self._key_host = {h.public_key.encode(): h.index for h in cluster.hosts}
        self.registry: Any = None
        self.http: MetricsServer | None = None
        self._api_file: tuple[int, int] | None = None  # our socket file, removed at exit only if still ours
        self._api_ipc = self.me.api.startswith("ipc://")

    def _node(self, incarnation: int) -> Node:
        c = self.cluster
        return Node(
            self.me.index, c.fabric, self.maps, list(self.peers), incarnation=incarnation,
            policy=c.policy, seed=int.from_bytes(os.urandom(4), "big"), lease=c.lease(),
            heartbeat_s=c.heartbeat_s, peer_timeout_s=c.peer_timeout_s, sync_timeout_s=c.sync_timeout_s,
            retention_s=c.retention_s,
            limits=NodeLimits(max_local_flows=c.max_local_flows, max_clock_offset_s=c.max_clock_offset_s),
            core_limits=CoreLimits(max_flows_per_host=c.max_flows_per_host, max_dports=c.max_dports),
            signer=self.signatures.sign, verifier=self.signatures.verify, scope_links=self.scope_links,
        )

    # ------------------------------------------------------------------ sockets
    def _curve(self, sock: zmq.Socket, server_key: str | None) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        if server_key is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = server_key.encode()

    def _open(self) -> None:
        fds = raise_fd_limit()
        ctx = self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=ZapKeys(h.public_key for h in self.cluster.hosts))
        self.inbox = ctx.socket(zmq.ROUTER)
        self._curve(self.inbox, None)
        for opt, val in ((zmq.RCVHWM, 4096), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_ENVELOPE_BYTES + 1024),
                         (zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)):
            self.inbox.setsockopt(opt, val)
        # 256 descriptors for everything else; the metrics endpoint's connections come out
        # of the same budget as the control port's.
        spare = 256 + (SCRAPES_AT_ONCE + 1 if self.me.metrics_port is not None else 0)
        budget = min(self.cluster.connections(len(self.cluster.hosts)), max(16, fds - spare))
        self.guard = ConnectionGuard(self.inbox, budget, endpoint_ips(h.control for h in self.cluster.hosts))
        bind(self.inbox, self.me.control, "control")
        self.api_sock = open_api(ctx, self.me.api, API_MAX_BYTES + 256)
        self._api_file = ipc_identity(self.me.api)
        self.holders = Holders(self.api_sock)
        self.out: dict[int, zmq.Socket] = {}
        for idx, h in self.peers.items():
            d = ctx.socket(zmq.DEALER)
            self._curve(d, h.public_key)
            for opt, val in ((zmq.SNDHWM, 10_000), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_ENVELOPE_BYTES + 1024)):
                d.setsockopt(opt, val)
            d.connect(h.control)
            self.out[idx] = d
        # Two pollers: everything, and everything but the peers (while a batch window runs).
        self.poller, self.poller_no_peers = zmq.Poller(), zmq.Poller()
        for sock in (self.inbox, self.api_sock, self.guard.monitor, self.holders.monitor, self.refresher.wake_r):
            self.poller.register(sock, zmq.POLLIN)
            if sock is not self.inbox:
                self.poller_no_peers.register(sock, zmq.POLLIN)
        if self.arbiter is not None:
            self.arbiter.open(ctx, [self.poller, self.poller_no_peers])
        if self.me.metrics_port is not None:
            self.http = MetricsServer(self.me.metrics_port, self._render_metrics, [self.poller, self.poller_no_peers])

    def _close(self) -> None:
        # Also after a start that failed half-way: close what was opened, nothing else.
        for part in (getattr(self, "guard", None), getattr(self, "holders", None), self.http, self.arbiter):
            if part is not None:
                part.close()
        for s in [getattr(self, "inbox", None), getattr(self, "api_sock", None), *getattr(self, "out", {}).values()]:
            if s is not None:
                s.close(0)
        if hasattr(self, "auth"):
            self.auth.stop()
        if hasattr(self, "ctx"):
            self.ctx.destroy(0)  # and any socket a failed start left unclosed
        self.refresher.close()
        remove_ipc(self.me.api, self._api_file)

    # ------------------------------------------------------------------ loop
    def stop(self, *_: Any) -> None:
        self._stop = True

    def run(self) -> None:
        try:
            self._open()
        except BaseException:  # a refused start (AgentError) leaves nothing behind
            with contextlib.suppress(Exception):  # and its one-line reason is what is reported
                self._close()
            raise
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info(**_ev("agent_started", host=self.me.name, id=self.me.index, incarnation=self.node.incarnation,
                       peers=len(self.peers), control=self.me.control, api=self.me.api))
        now = time.time()
        self.emit(self.node.start(now))
        self._timers_at = now
        try:
            while not self._stop:
                self._wait_and_drain()
                now = time.time()
                if now >= self._timers_at:
                    self._timers(now)
                if time.monotonic() >= self.holders.due:
                    self._release_vanished(now)
                self._log_events()
        finally:
            log.info(**_ev("agent_stopped", host=self.me.name))
            self._close()

    def _timers(self, now: float) -> None:
        """Whatever is due: the node's tick, peer liveness, the periodic path check, readiness."""
        if now >= self.node.next_deadline(now):
            self.emit(self.node.tick(now))
        if self.arbiter is not None:
            self.arbiter.tick(now)
        self._watch_peers(now)
        if self.cluster.probe_check_s:
            self.refresher.maybe_check(now)
        if self.node.skewed != self._skewed:
            self._skewed = self.node.skewed
            log.warning(**_ev("clock_skewed" if self._skewed else "clock_trusted", host=self.me.name,
                              why=self._skewed, offset_s=self.node.clock.estimate()))
        if self.node.ready and not self._was_ready:
            self._was_ready = True
            log.info(**_ev("ready", host=self.me.name, synced=[p for p, st in self.node.peers.items() if st.synced]))
        self._timers_at = min(self.node.next_deadline(now), self.refresher.next_check, self._peer_deadline(),
                              self.arbiter.next_deadline() if self.arbiter is not None else math.inf)

    def _wait_and_drain(self) -> None:
        # A signal interrupts the poll; 1 s at most keeps a stop request prompt regardless.
        now = time.time()
        timeout = min(1.0, max(0.0, self._timers_at - now), max(0.0, self.holders.due - time.monotonic()))
        if self.http is not None:
            timeout = min(timeout, self.http.wait_s())
        if now < self._peers_due:  # a batch window: the local API and timers only, until it ends
            events = dict(self.poller_no_peers.poll(max(1, math.ceil(min(timeout, self._peers_due - now) * 1000))))
        else:
            events = dict(self.poller.poll(int(timeout * 1000) + 1))
        if self.guard.monitor in events:
            self.guard.drain()
        if self.holders.monitor in events:
            self.holders.closed()
        if self.http is not None:
            self.http.handle(events)
        if self.api_sock in events:
            self._drain_api()
        if self.inbox in events:
            n = self._drain_peers()
            now = time.time()
            # Busy (messages faster than one per batch_s): wait batch_s for the next batch,
            # so that one wakeup serves several. Quiet: the next message is handled at once.
            if self._arrivals.add(n, now) * self.cluster.batch_s > 1.0:
                self._peers_due = now + self.cluster.batch_s
        if self.arbiter is not None:
            self.arbiter.drain(events)
        if self.refresher.wake_r in events:
            for rid, res in self.refresher.results():
                self.finish_refresh(rid, res)
        if events:  # what arrived may have brought a deadline forward (a sync sent, a lease, a request out)
            self._timers_at = min(self._timers_at, self.node.next_deadline(time.time()),
                                  self.arbiter.next_deadline() if self.arbiter is not None else math.inf)

    def _drain_peers(self, limit: int = 1024, slice_: int = 16) -> int:
        """Handle waiting peer messages (how many); every ``slice_`` of them, serve the local
        API first (an engine waiting for a lease must not wait behind a flood)."""
        sock, api = self.inbox, self.api_sock
        i = 0
        try:
            while i < limit and readable(sock):
                self._peer_message(recv_frames(sock))
                i += 1
                if i % slice_ == 0 and readable(api):
                    self._settle()
                    self._drain_api(64)
        finally:
            self._settle()
        return i

    def _settle(self) -> None:
        try:
            self.node.flush()
        except Exception:  # never fatal: counted and logged
            self._error("flush")

    def _peer_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.node.counters.invalid += 1
            return
        user = frames[1].get("User-Id")
        peer = self._key_host.get(user.encode() if isinstance(user, str) else b"")
        if peer is None or peer == self.me.index:
            self.node.counters.invalid += 1
            return
        if not self._within_rate(peer):
            self.rate_limited += 1
            return
        try:
            self.emit(self.node.on_message(peer, frames[1].bytes, time.time()))
        except Exception:  # a message that breaks a handler is dropped, never fatal
            self._error("peer_message", peer=self.peers[peer].name)
        if not self._up.get(peer):
            self._timers_at = 0.0  # a peer may have come up: log it now

    def _within_rate(self, peer: int) -> bool:
        """Token bucket per peer: ``peer_rate`` messages/s, bursts of twice that."""
        rate = self.cluster.peer_rate
        now = time.monotonic()
        b = self._buckets.get(peer)
        if b is None:
            b = self._buckets[peer] = [2 * rate, now]
        b[0] = min(2 * rate, b[0] + (now - b[1]) * rate)
        b[1] = now
        if b[0] < 1:
            return False
        b[0] -= 1
        return True

    def _error(self, where: str, **fields: Any) -> None:
        self.errors += 1
        if self.errors <= 20 or self.errors % 1000 == 0:  # a flood of them must not flood the log
            log.error(**_ev("handler_error", host=self.me.name, where=where, count=self.errors,
                            error=traceback.format_exc(limit=3).strip().splitlines()[-1], **fields))

    def _drain_api(self, limit: int = 1024) -> None:
        sock, node = self.api_sock, self.node
        for _ in range(limit):
            if not readable(sock):
                return
            frames = sock.recv_multipart(copy=False)  # frames: they carry the sender's pid
            if len(frames) < 2:
                continue
            rid = frames[0].bytes
            # Over TCP the peer address is an IP; over ipc the sender, looked up once per connection.
            pid = self.holders.pid_of(rid, frames[-1]) if self._api_ipc else 0
            # The client's answer first; the signing and the sends to peers after it.
            node.defer_publish = True
            try:
                reply = self.api.handle(frames[-1].bytes, rid, pid)
            finally:
                node.defer_publish = False
            if reply is not None:  # None: answered later (refresh)
                self.reply(rid, reply)
            self.emit(node.publish_deferred())

    def reply(self, rid: bytes, reply: dict[str, Any]) -> None:
        self.api_sock.send_multipart([rid, b"", msgpack.packb(reply, use_bin_type=True)])

    def emit(self, outs: list[Output]) -> None:
        for o in outs:
            targets = self.out.values() if isinstance(o, Publish) else (self.out[o.peer],)
            for sock in targets:
                try:
                    sock.send(o.data, zmq.NOBLOCK)
                except zmq.Again:
                    # The peer has been unreachable for a while (queue full): drop. Its
                    # sequence numbers show it the gap, and it resyncs when it is back.
                    self.dropped_out += 1

    def _peer_deadline(self) -> float:
        """When the next peer now counted up would be counted down."""
        timeout = self.node.peer_timeout_s
        ups = [st.last_heard for p, st in self.node.peers.items() if self._up.get(p)]
        return min(ups) + timeout if ups else float("inf")

    def _watch_peers(self, now: float) -> None:
        for p, st in self.node.peers.items():
            up = now - st.last_heard <= self.node.peer_timeout_s
            if self._up.get(p) != up:
                if p in self._up or up:
                    log.info(**_ev("peer_up" if up else "peer_down", host=self.me.name, peer=self.peers[p].name))
                self._up[p] = up

    def _log_events(self) -> None:
        while self.node.events:
            ev = self.node.events.popleft()
            log.info(**_ev("local_flow_changed", flow=list(ev.flow), old_path=ev.old_path, path=ev.path,
                           port=ev.port, reserved=ev.reserved))
        while self.node.alerts:  # a peer's claim refused: a lie, or replicas that diverged
            alert = self.node.alerts.popleft()
            alert.pop("part_of", None)
            log.warning(**_ev(alert.pop("event"), **alert))

    # ------------------------------------------------------------------ path refresh
    def finish_refresh(self, rid: bytes | None, res: dict[str, Any]) -> None:
        """Apply a finished probe job: reload the maps, re-path, answer whoever asked."""
        if res.get("ok"):
            try:
                res["repathed"] = self.reload(time.time())
                self.refresher.applied(res)
                log.info(**_ev("paths_refreshed", host=self.me.name, peers=sorted(res["probed"]),
                               detected=bool(res.get("detected"))))
            except (CoreError, ValueError) as e:
                res = {"ok": False, "error": f"reload: {e}"}
        elif rid is None:
            log.warning(**_ev("refresh_failed", host=self.me.name, error=res.get("error")))
        if rid is not None:
            self.reply(rid, res)

    def reload(self, now: float) -> list[dict[str, Any]]:
        """Use the path-map files as they are now; re-path reservations whose port moved."""
        self.maps.clear()
        repathed, outs = self.node.reload_pathmaps(now, rereserve=self.arbiter is None)
        self.emit(outs)
        if self.arbiter is not None:  # kept their ports, unreserved: the arbiter lets them go
            self.arbiter.drop(list(repathed))
        self.refresher.repathed += len(repathed)
        log.info(**_ev("maps_reloaded", host=self.me.name, repathed=[list(f) for f in repathed]))
        return [{"old": list(f), "lease": lease_dict(ls)} for f, ls in repathed.items()]

    def metrics_registry(self) -> Any:
        if self.registry is None:
            self.registry = registry(self)
        return self.registry

    def _render_metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.metrics_registry()))

    def _release_vanished(self, now: float) -> None:
        """Release the flows of local clients whose process is gone (:mod:`ark.agent.holders`)."""
        local = set(self.node.local_flows())
        for flow in self.holders.sweep(lambda f: self.node.resolve(f) in local):
            if self.arbiter is not None:
                self.arbiter.drop(self.arbiter.reserved_of([flow]))
            try:
                self.emit(self.node.release(flow, now))
            except CoreError:  # released or expired meanwhile
                continue
            self.holders.released += 1
            log.info(**_ev("vanished_client_released", host=self.me.name, flow=list(flow)))


class _ArrivalRate:
    """Events per second over the last ``span_s`` (two half-open windows, no per-event state)."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.start = 0.0
        self.count = 0
        self.rate = 0.0

    def add(self, n: int, now: float) -> float:
        if now - self.start >= self.span_s:
            elapsed = now - self.start
            self.rate = self.count / elapsed if elapsed < 2 * self.span_s else 0.0
            self.start, self.count = now, 0
        self.count += n
        return max(self.rate, self.count / self.span_s)


def run_agent(cluster: Cluster, host: str, secret_key_file: str | None = None, log_level: str = "info") -> None:
    setup_logging(log_level)
    agent = Agent(cluster, host, secret_key_file)
    prof_dir = os.environ.get("ARK_AGENT_PROFILE")
    if not prof_dir:
        agent.run()
        return
    import cProfile  # a developer aid: where does an agent spend its time?

    prof = cProfile.Profile()
    try:
        prof.runcall(agent.run)
    finally:
        prof.dump_stats(str(Path(prof_dir) / f"{host}.prof"))
