"""The ARK agent: one per host, moving the bytes of an :class:`ark.core.node.Node`.

Sockets (ZeroMQ, brokerless, every peer link CURVE-encrypted and authenticated):

* inbound: one ROUTER (CURVE server) bound on ``control``. A ZAP handler admits only the
  public keys listed in the cluster file and stamps every message with the sender's key
  (ZMQ ``User-Id``), so a message counts only if it comes from the host it claims;
* outbound: one DEALER per peer (CURVE client pinned to that peer's public key),
  connected to the peer's ``control``. A broadcast (RESERVE / RENEW / RELEASE / HELLO)
  goes out on all of them; sync requests and replies on one;
* ROUTER on ``api`` (ipc://, local only): the serving engines' requests
  (:mod:`ark.agent.api`).

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

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ark.agent.api import LocalApi, lease_dict
from ark.agent.cluster import Cluster, HostEntry, read_secret_key
from ark.agent.metrics import registry
from ark.agent.refresh import PathRefresher
from ark.core.node import Node, Output, Publish
from ark.core.protocol import CoreError

log = logging.getLogger("ark.agent")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, event and the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "event": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger("ark")
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    root.propagate = False


def _ev(event: str, **fields: Any) -> dict[str, Any]:
    return {"msg": event, "extra": {"fields": fields}}


class _Keys:
    """ZAP credentials provider: only the cluster's public keys get in."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = {k.encode() for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class Agent:
    def __init__(self, cluster: Cluster, host: str, secret_key_file: str | None = None) -> None:
        self.cluster = cluster
        self.me: HostEntry = cluster.host(host)
        keyfile = secret_key_file or self.me.secret_key_file
        if keyfile is None:
            raise CoreError("secret key: give --secret-key or secret_key_file in the cluster file")
        pub, self.secret = read_secret_key(keyfile)
        if pub.decode() != self.me.public_key:
            raise CoreError(f"secret key: {keyfile} does not match {host}'s public_key in the cluster file")
        self.public = pub
        self.peers = {h.index: h for h in cluster.hosts if h.index != self.me.index}
        self.maps = cluster.pathmaps()
        self.node = Node(
            self.me.index, cluster.fabric, self.maps, list(self.peers),
            incarnation=int(time.time() * 1000) % (1 << 30) or 1,
            policy=cluster.policy, seed=int.from_bytes(os.urandom(4), "big"), lease=cluster.lease(),
            heartbeat_s=cluster.heartbeat_s, peer_timeout_s=cluster.peer_timeout_s,
            sync_timeout_s=cluster.sync_timeout_s, retention_s=cluster.retention_s,
        )
        self.api = LocalApi(self)
        self.refresher = PathRefresher(cluster, self.me.name)
        self._stop = False
        self._up: dict[int, bool] = {}
        self._timers_at = 0.0
        self._was_ready = False
        self.dropped_out = 0
        self._key_host = {h.public_key.encode(): h.index for h in cluster.hosts}
        self.registry: Any = None

    # ------------------------------------------------------------------ sockets
    def _curve(self, sock: zmq.Socket, server_key: str | None) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        if server_key is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = server_key.encode()

    def _open(self) -> None:
        ctx = self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=_Keys(h.public_key for h in self.cluster.hosts))
        self.inbox = ctx.socket(zmq.ROUTER)
        self._curve(self.inbox, None)
        self.inbox.setsockopt(zmq.RCVHWM, 100_000)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(self.me.control)
        self.api_sock = self._open_api(ctx)
        self.out: dict[int, zmq.Socket] = {}
        for idx, h in self.peers.items():
            d = ctx.socket(zmq.DEALER)
            self._curve(d, h.public_key)
            d.setsockopt(zmq.SNDHWM, 10_000)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(h.control)
            self.out[idx] = d
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.api_sock, zmq.POLLIN)
        self.poller.register(self.refresher.wake_r, zmq.POLLIN)
        if self.me.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.me.metrics_port, addr="127.0.0.1", registry=self.metrics_registry())

    def _open_api(self, ctx: zmq.Context) -> zmq.Socket:
        if self.me.api.startswith("ipc://"):
            path = Path(self.me.api[len("ipc://"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.unlink()  # a stale socket from a killed predecessor
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        old = os.umask(0o077)  # the local API is for this host's own users only
        try:
            sock.bind(self.me.api)
        finally:
            os.umask(old)
        return sock

    def _close(self) -> None:
        for s in [self.inbox, self.api_sock, *self.out.values()]:
            s.close(0)
        self.auth.stop()
        self.ctx.term()
        self.refresher.close()
        if self.me.api.startswith("ipc://"):
            Path(self.me.api[len("ipc://"):]).unlink(missing_ok=True)

    # ------------------------------------------------------------------ loop
    def stop(self, *_: Any) -> None:
        self._stop = True

    def run(self) -> None:
        self._open()
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
                self._log_events()
        finally:
            log.info(**_ev("agent_stopped", host=self.me.name))
            self._close()

    def _timers(self, now: float) -> None:
        """Whatever is due: the node's tick, peer liveness, the periodic path check, readiness."""
        if now >= self.node.next_deadline(now):
            self.emit(self.node.tick(now))
        self._watch_peers(now)
        if self.cluster.probe_check_s:
            self.refresher.maybe_check(now)
        if self.node.ready and not self._was_ready:
            self._was_ready = True
            log.info(**_ev("ready", host=self.me.name, synced=[p for p, st in self.node.peers.items() if st.synced]))
        self._timers_at = min(self.node.next_deadline(now), self.refresher.next_check, self._peer_deadline())

    def _wait_and_drain(self) -> None:
        # A signal interrupts the poll; 1 s at most keeps a stop request prompt regardless.
        timeout = min(1.0, max(0.0, self._timers_at - time.time()))
        events = dict(self.poller.poll(int(timeout * 1000) + 1))
        if self.inbox in events:
            self._drain_peers()
        if self.api_sock in events:
            self._drain_api()
        if self.refresher.wake_r in events:
            for rid, res in self.refresher.results():
                self.finish_refresh(rid, res)
        if events:  # what arrived may have brought a deadline forward (a sync sent, a lease)
            self._timers_at = min(self._timers_at, self.node.next_deadline(time.time()))

    def _drain_peers(self, limit: int = 1024) -> None:
        sock = self.inbox
        for _ in range(limit):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self.node.counters.invalid += 1
                continue
            user = frames[1].get("User-Id")
            peer = self._key_host.get(user.encode() if isinstance(user, str) else b"")
            if peer is None or peer == self.me.index:
                self.node.counters.invalid += 1
                continue
            self.emit(self.node.on_message(peer, frames[1].bytes, time.time()))
            if not self._up.get(peer):
                self._timers_at = 0.0  # a peer may have come up: log it now

    def _drain_api(self, limit: int = 1024) -> None:
        sock = self.api_sock
        for _ in range(limit):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = sock.recv_multipart()
            if len(frames) < 2:
                continue
            rid = frames[0]
            reply = self.api.handle(frames[-1], rid)
            if reply is not None:  # None: answered later (refresh)
                self.reply(rid, reply)

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
        repathed, outs = self.node.reload_pathmaps(now)
        self.emit(outs)
        self.refresher.repathed += len(repathed)
        log.info(**_ev("maps_reloaded", host=self.me.name, repathed=[list(f) for f in repathed]))
        return [{"old": list(f), "lease": lease_dict(ls)} for f, ls in repathed.items()]

    def metrics_registry(self) -> Any:
        if self.registry is None:
            self.registry = registry(self)
        return self.registry


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
