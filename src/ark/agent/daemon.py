"""The ARK agent: one per host, moving the bytes of an :class:`ark.core.node.Node`.

Sockets (ZeroMQ, brokerless, every peer link CURVE-encrypted and authenticated):

* inbound: one ROUTER (CURVE server) bound on ``control``. A ZAP handler admits only the
  public keys listed in the cluster file and stamps every message with the sender's key
  (ZMQ ``User-Id``), so a message counts only if it comes from the host it claims;
* outbound: one DEALER per peer (CURVE client pinned to that peer's public key),
  connected to the peer's ``control``. A broadcast (RESERVE / RENEW / RELEASE / HELLO)
  goes out on all of them; sync requests and replies on one;
* ROUTER on ``api`` (ipc://, local only): the serving engines' reserve / renew /
  release / status / table / ports / metrics requests.

Why not PUB/SUB sockets: a SUB per peer costs the receiver a wakeup and a poll slot per
peer, and a single SUB cannot tell senders apart. The inbound ROUTER gives one socket to
poll and an authenticated sender per message. A stranger can neither receive (our
DEALERs only talk to listed keys at listed addresses) nor send (ZAP refuses its key),
and it cannot pose as a listed peer without that peer's secret key. Time is the wall clock (hosts are assumed PTP-synchronised, as
the protocol's race rule requires).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ark.agent.cluster import Cluster, ClusterError, HostEntry, read_secret_key
from ark.agent.probe import load_routers
from ark.core.messages import ProtocolError
from ark.core.node import LeasePolicy, Node, NotReady, Output, Publish
from ark.core.protocol import CoreError

API_MAX_BYTES = 4096
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
            policy=cluster.policy, seed=int.from_bytes(os.urandom(4), "big"),
            lease=LeasePolicy(cluster.lease_min_s, cluster.lease_slack),
            heartbeat_s=cluster.heartbeat_s, peer_timeout_s=cluster.peer_timeout_s,
            sync_timeout_s=cluster.sync_timeout_s, retention_s=cluster.retention_s,
        )
        self._stop = False
        # Path refresh by probing runs in a worker thread (it waits on ICMP answers);
        # its result comes back here and is applied by the main loop.
        self._refresh: threading.Thread | None = None
        self._refreshed: queue.SimpleQueue[tuple[bytes | None, dict[str, Any]]] = queue.SimpleQueue()
        self._next_check = time.time() + cluster.probe_check_s
        # Read once: the periodic check would otherwise re-read it every probe_check_s.
        self._routers = load_routers(cluster.routers_file) if cluster.routers_file else None
        self.refreshes = 0  # path maps re-probed and reloaded
        self.detected = 0  # of those, started by the periodic check
        self.check_probes = 0
        self.refresh_probes = 0
        self.repathed = 0
        self.last_refresh: float | None = None
        self._up: dict[int, bool] = {}
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
        if self.me.api.startswith("ipc://"):
            path = Path(self.me.api[len("ipc://"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.unlink()  # a stale socket from a killed predecessor
        self.api = ctx.socket(zmq.ROUTER)
        self.api.setsockopt(zmq.LINGER, 0)
        old = os.umask(0o077)  # the local API is for this host's own users only
        try:
            self.api.bind(self.me.api)
        finally:
            os.umask(old)
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
        self.poller.register(self.api, zmq.POLLIN)
        if self.me.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.me.metrics_port, addr="127.0.0.1", registry=self.metrics_registry())

    def _close(self) -> None:
        for s in [self.inbox, self.api, *self.out.values()]:
            s.close(0)
        self.auth.stop()
        self.ctx.term()
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
        self._emit(self.node.start(time.time()))
        tick_every = min(0.05, self.cluster.heartbeat_s / 4)
        next_tick = time.time()
        was_ready = False
        try:
            while not self._stop:
                timeout = max(0.0, next_tick - time.time())
                events = dict(self.poller.poll(int(timeout * 1000) + 1))
                for sock in events:
                    self._drain(sock)
                now = time.time()
                if now >= next_tick:
                    self._emit(self.node.tick(now))
                    self._watch_peers(now)
                    next_tick = now + tick_every
                while not self._refreshed.empty():
                    self._finish_refresh(*self._refreshed.get())
                if self.cluster.probe_check_s and now >= self._next_check:
                    self._next_check = now + self.cluster.probe_check_s
                    if self._refresh is None or not self._refresh.is_alive():
                        self._start_refresh(None, None, check=True)
                if self.node.ready and not was_ready:
                    was_ready = True
                    log.info(**_ev("ready", host=self.me.name, synced=[p for p, st in self.node.peers.items() if st.synced]))
                while self.node.events:
                    ev = self.node.events.popleft()
                    log.info(**_ev("local_flow_changed", flow=list(ev.flow), old_path=ev.old_path, path=ev.path,
                                   port=ev.port, reserved=ev.reserved))
        finally:
            log.info(**_ev("agent_stopped", host=self.me.name))
            self._close()

    def _drain(self, sock: zmq.Socket, limit: int = 1024) -> None:
        for _ in range(limit):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            if sock is self.api:
                self._api(sock.recv_multipart())
                continue
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self.node.counters.invalid += 1
                continue
            user = frames[1].get("User-Id")
            peer = self._key_host.get(user.encode() if isinstance(user, str) else b"")
            if peer is None or peer == self.me.index:
                self.node.counters.invalid += 1
                continue
            self._emit(self.node.on_message(peer, frames[1].bytes, time.time()))

    def _emit(self, outs: list[Output]) -> None:
        for o in outs:
            targets = self.out.values() if isinstance(o, Publish) else (self.out[o.peer],)
            for sock in targets:
                try:
                    sock.send(o.data, zmq.NOBLOCK)
                except zmq.Again:
                    # The peer has been unreachable for a while (queue full): drop. Its
                    # sequence numbers show it the gap, and it resyncs when it is back.
                    self.dropped_out += 1

    def _watch_peers(self, now: float) -> None:
        for p, st in self.node.peers.items():
            up = now - st.last_heard <= self.node.peer_timeout_s
            if self._up.get(p) != up:
                if p in self._up or up:
                    log.info(**_ev("peer_up" if up else "peer_down", host=self.me.name, peer=self.peers[p].name))
                self._up[p] = up

    # ------------------------------------------------------------------ local API
    def _api(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        rid, body = frames[0], frames[-1]
        try:
            reply = self._handle(body, rid)
        except (CoreError, ProtocolError, ValueError, KeyError, TypeError) as e:
            reply = {"ok": False, "error": str(e), "not_ready": isinstance(e, NotReady)}
        if reply is not None:  # None: answered later (refresh)
            self._reply(rid, reply)

    def _reply(self, rid: bytes, reply: dict[str, Any]) -> None:
        self.api.send_multipart([rid, b"", msgpack.packb(reply, use_bin_type=True)])

    def _start_refresh(self, rid: bytes | None, peers: list[str] | None, check: bool = False) -> None:
        """Probe in a worker thread; the main loop applies the result (``_finish_refresh``).

        ``check``: first re-probe a few ports per peer and refresh only the peers whose
        map no longer holds (nobody waits for an answer).
        """
        from ark.agent.probe import check as probe_check
        from ark.agent.probe import refresh

        if self._refresh is not None and self._refresh.is_alive():
            raise ValueError("refresh: one is already running")
        if self.cluster.routers_file is None:
            raise ValueError("refresh: the cluster file has no routers_file to probe with")

        def work() -> None:
            res: dict[str, Any]
            try:
                todo = peers
                if check:
                    todo, sent = probe_check(self.cluster, self.me.name, seed=int(time.time() * 1000),
                                             routers=self._routers)
                    self.check_probes += sent
                    if not todo:
                        return
                res = {"ok": True, "probed": refresh(self.cluster, self.me.name, todo, self._routers),
                       "detected": check}
            except Exception as e:  # reported to the caller, never fatal to the agent
                res = {"ok": False, "error": f"refresh: {e}"}
            self._refreshed.put((rid, res))

        self._refresh = threading.Thread(target=work, name="ark-refresh", daemon=True)
        self._refresh.start()

    def _finish_refresh(self, rid: bytes | None, res: dict[str, Any]) -> None:
        if res.get("ok"):
            try:
                res["repathed"] = self._reload(time.time())
                self.refreshes += 1
                self.refresh_probes += sum(int(v["probes_sent"]) for v in res["probed"].values())
                self.detected += bool(res.get("detected"))
                self.last_refresh = time.time()
                log.info(**_ev("paths_refreshed", host=self.me.name, peers=sorted(res["probed"]),
                               detected=bool(res.get("detected"))))
            except (CoreError, ValueError) as e:
                res = {"ok": False, "error": f"reload: {e}"}
        elif rid is None:
            log.warning(**_ev("refresh_failed", host=self.me.name, error=res.get("error")))
        if rid is not None:
            self._reply(rid, res)

    def _reload(self, now: float) -> list[dict[str, Any]]:
        """Use the path-map files as they are now; re-path reservations whose port moved."""
        self.maps.clear()
        repathed, outs = self.node.reload_pathmaps(now)
        self._emit(outs)
        self.repathed += len(repathed)
        log.info(**_ev("maps_reloaded", host=self.me.name, repathed=[list(f) for f in repathed]))
        return [{"old": list(f), "lease": _lease_dict(ls)} for f, ls in repathed.items()]

    def _host_arg(self, v: Any, field: str) -> int:
        names = ", ".join(h.name for h in self.cluster.hosts)
        try:
            if isinstance(v, str):
                return self.cluster.host(v).index
            if isinstance(v, int) and not isinstance(v, bool):
                return self.cluster.by_index(v).index
        except ClusterError:
            pass
        raise ValueError(f"{field}: expected a cluster host ({names}); got {v!r}")

    @staticmethod
    def _flow_arg(req: dict[str, Any]) -> tuple[int, int]:
        f = req.get("flow")
        if not (isinstance(f, list) and len(f) == 2 and all(isinstance(x, int) for x in f)):
            raise ValueError("flow: expected [host, seq]")
        return (f[0], f[1])

    def _handle(self, body: bytes, rid: bytes = b"") -> dict[str, Any] | None:
        if len(body) > API_MAX_BYTES:
            raise ValueError(f"request: larger than {API_MAX_BYTES} bytes")
        try:
            req = msgpack.unpackb(body, raw=False)
        except Exception:
            raise ValueError("request: not valid msgpack") from None
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise ValueError("request: expected a map with an 'op'")
        op = req["op"]
        now = time.time()
        if op == "reserve":
            nbytes = req.get("nbytes")
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise ValueError("nbytes: expected an integer >= 0")
            dport = req.get("dport", self.cluster.dport)
            if not isinstance(dport, int) or not 0 <= dport <= 0xFFFF:
                raise ValueError("dport: expected 0..65535")
            lease, outs = self.node.reserve(self._host_arg(req.get("dst"), "dst"), nbytes, now, dport)
            self._emit(outs)
            return {"ok": True, "lease": _lease_dict(lease)}
        if op in ("renew", "release"):
            flow = self._flow_arg(req)
            if op == "renew":
                lease, outs = self.node.renew(flow, now)
                self._emit(outs)
                return {"ok": True, "lease": _lease_dict(lease)}
            self._emit(self.node.release(flow, now))
            return {"ok": True}
        if op == "status":
            st = self.node.status(now)
            st["name"] = self.me.name
            st["node"]["unsent"] = self.dropped_out
            st["peers"] = {self.peers[int(p)].name: v for p, v in st["peers"].items()}
            samples = list(self.node.propagation_s)
            st["propagation_samples"] = samples[-int(req.get("samples", 0)):] if req.get("samples") else []
            st["propagation_count"] = len(samples)
            st["paths"] = {"refreshes": self.refreshes, "detected": self.detected, "repathed": self.repathed,
                           "check_probes": self.check_probes, "refresh_probes": self.refresh_probes,
                           "last_refresh": self.last_refresh}
            return {"ok": True, "status": st}
        if op == "ports":
            peer = self._host_arg(req.get("peer"), "peer")
            dport = req.get("dport", self.cluster.dport)
            return {"ok": True, "ports": self.maps(self.me.index, peer, dport).static_ports()}
        if op == "reload":  # new path-map files (re-probed after a fabric change)
            return {"ok": True, "repathed": self._reload(now)}
        if op == "refresh":
            # Re-probe (the fabric changed), then reload: the reply comes when done.
            peers = req.get("peers")
            if peers is not None and not (isinstance(peers, list) and all(isinstance(p, str) for p in peers)):
                raise ValueError("peers: expected a list of host names")
            for p in peers or ():
                self.cluster.host(p)
            self._start_refresh(rid, peers)
            return None
        if op == "lease":
            return {"ok": True, "lease": _lease_dict(self.node.lease_of(self._flow_arg(req)))}
        if op == "table":
            table = self.node.core.table()
            return {"ok": True, "flows": [[f[0], f[1], p, sh] for f, (p, sh) in sorted(table.items())],
                    "digest": self.node.core.digest()}
        if op == "metrics":
            from prometheus_client import generate_latest

            return {"ok": True, "text": generate_latest(self.metrics_registry()).decode()}
        raise ValueError(f"op: must be one of reserve, renew, release, lease, reload, refresh, status, table, ports, metrics; got {op!r}")

    # ------------------------------------------------------------------ metrics
    def metrics_registry(self) -> Any:
        if self.registry is None:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()
            self.registry.register(_Collector(self))
        return self.registry


def _lease_dict(lease: Any) -> dict[str, Any]:
    d = lease._asdict()
    d["flow_id"] = list(lease.flow_id)
    return dict(d)


class _Collector:
    """Prometheus view of the node's counters and RESERVE propagation latency."""

    BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        node = self.agent.node
        c, n = node.core.counters, node.counters
        host = self.agent.me.name
        for name, value, doc in (
            ("ark_reservations", c.reserved, "reservations made by this host"),
            ("ark_requests", c.requests, "path requests from local engines"),
            ("ark_races_lost", c.races_lost, "local flows re-pathed after a race"),
            ("ark_fallbacks", c.fallbacks, "requests that found no free path"),
            ("ark_renewals", c.renewals, "lease renewals applied"),
            ("ark_expired", c.expired, "reservations whose lease ran out"),
            ("ark_invalid_messages", n.invalid + c.invalid, "malformed or unauthorised peer messages dropped"),
            ("ark_dropped_messages", n.dropped + c.duplicates + c.stale, "duplicate or stale peer messages dropped"),
            ("ark_unsent_messages", self.agent.dropped_out, "messages not sent: a peer's queue was full"),
            ("ark_sequence_gaps", n.gaps, "gaps in a peer's sequence numbers"),
            ("ark_syncs_applied", n.sync_applied, "table resynchronisations applied"),
        ):
            m = CounterMetricFamily(name, doc, labels=["host"])
            m.add_metric([host], value)
            yield m
        g = GaugeMetricFamily("ark_reserved_links", "links this host's table holds", labels=["host"])
        g.add_metric([host], len(node.core.link_holders()))
        yield g
        samples = list(node.propagation_s)
        buckets, acc = [], 0
        for b in self.BUCKETS:
            acc = sum(1 for s in samples if s <= b)
            buckets.append((str(b), acc))
        buckets.append(("+Inf", len(samples)))
        h = HistogramMetricFamily("ark_reserve_propagation_seconds", "RESERVE ts to arrival here", labels=["host"])
        h.add_metric([host], buckets, sum_value=math.fsum(samples))
        yield h


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
