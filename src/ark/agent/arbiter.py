"""``ark arbiter``: one arbiter process, moving the bytes of an :class:`ark.core.arbiter.Arbiter`.

Sockets (ZeroMQ, CURVE on every link, as the agents'):

* inbound: one ROUTER (CURVE server) on the arbiter's ``control``. A ZAP handler admits
  only the keys of the cluster file's hosts and arbiters, and stamps every message with
  its sender's key (``User-Id``): a host's request counts only as that host's, an
  arbiter's message only as that arbiter's. The connection budget and the handshake
  timeout are the agents'; within the budget every listed host and arbiter has a share
  of its own, counted once a connection has spoken (:class:`ark.agent.arbiter_guard.SharedGuard`);
* outbound: one DEALER per other arbiter (CURVE client pinned to its key): beats, the
  table's changes, sync. Replies to hosts go back through the ROUTER.

Requests are taken in batches: the messages waiting are handled (at most ``BATCH``, for at
most ``BATCH_S``, per wakeup), each answered as soon as it is decided, then the batch's
table changes go to the followers in one message. Within a batch, the changes so far and
any beat that falls due go out every quarter beat, so that no batch, however long, keeps
the followers from hearing the leader. An error in a handler or a timer is counted and
logged once per kind, never fatal.

Time is a monotonic clock set to the wall clock when the process starts (``_clock``): the
leader lease is measured on it (a clock stepped back or forward would stretch or cut a
lease), and on Linux it is ``CLOCK_BOOTTIME``, which also counts while the machine is
suspended. Reservation times cross between arbiters as absolute times, so they stay close
to the wall clock: two arbiters' clocks differ by what their wall clocks did at start.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ark.agent.arbiter_guard import SharedGuard
from ark.agent.cluster import ArbiterEntry, Cluster
from ark.agent.incarnation import IncarnationError, keep_epoch
from ark.agent.logs import event as _ev
from ark.agent.logs import setup_logging
from ark.agent.sockets import (
    HANDSHAKE_IVL_MS,
    AgentError,
    ZapKeys,
    bind,
    check_resolvable,
    endpoint_ips,
    own_curve_keys,
    raise_fd_limit,
    readable,
    recv_frames,
)
from ark.core.arbiter import Arbiter, ArbiterLimits, ArbiterOut
from ark.core.arbiter_wire import MAX_ARBITER_MESSAGE_BYTES

log = logging.getLogger("ark.arbiter")
_MONO = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _clock() -> float:
    return time.clock_gettime(_MONO)
BATCH = 4096  # messages handled per wakeup at most (then timers and followers get their turn)
BATCH_S = 0.05  # and seconds per wakeup at most


class ArbiterProcess:
    def __init__(self, cluster: Cluster, name: str, secret_key_file: str | None = None) -> None:
        self.cluster = cluster
        self.me: ArbiterEntry = cluster.arbiter(name)
        self.public, self.secret = own_curve_keys(secret_key_file or self.me.secret_key_file, self.me.public_key,
                                                  f"arbiter {name}", "[[arbiters]]")
        for a in cluster.arbiters:
            check_resolvable(a.control, f"arbiters[{a.rank}].control")
        c = cluster
        limits = ArbiterLimits(max_flows_per_host=c.max_flows_per_host, rate_per_host=c.arbiter_rate_per_host,
                               burst_per_host=c.arbiter_burst_per_host, max_epoch_jump=c.arbiter_max_epoch_jump)
        try:  # the highest epoch this arbiter led or heard of: it leads above it (hosts refuse older epochs)
            self._seen_epoch = keep_epoch(c.state_dir, f"arbiter-{name}", 0)
        except IncarnationError as e:
            raise AgentError(str(e)) from None
        self.core = Arbiter(c.fabric, rank=self.me.rank, arbiters=len(c.arbiters), policy=c.policy, lease=c.lease(),
                            limits=limits, heartbeat_s=c.takeover_s / 5, takeover_s=c.takeover_s,
                            retention_s=c.retention_s, seen_epoch=self._seen_epoch, clock_drift=c.arbiter_clock_drift)
        self._sender: dict[bytes, tuple[int, int]] = {h.public_key.encode(): (h.index, -1) for h in c.hosts}
        self._sender.update({a.public_key.encode(): (-1, a.rank) for a in c.arbiters})
        self._stop = False
        self.errors = 0
        self._error_kinds: dict[str, int] = {}  # where and what: how often (each logged the first time)
        self.unsent = 0
        self._role = ""
        self._t0 = time.time() - _clock()

    def now(self) -> float:
        """Monotonic, set to the wall clock at start (see the module's doc)."""
        return self._t0 + _clock()

    # ------------------------------------------------------------------ sockets
    def _open(self) -> None:
        fds = raise_fd_limit()
        ctx = self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        keys = [h.public_key for h in self.cluster.hosts] + [a.public_key for a in self.cluster.arbiters]
        self.auth.configure_curve_callback(domain="*", credentials_provider=ZapKeys(keys))
        inbox = self.inbox = ctx.socket(zmq.ROUTER)
        inbox.curve_secretkey, inbox.curve_publickey, inbox.curve_server = self.secret, self.public, True
        for opt, val in ((zmq.RCVHWM, 16384), (zmq.SNDHWM, 16384), (zmq.LINGER, 0),
                         (zmq.MAXMSGSIZE, MAX_ARBITER_MESSAGE_BYTES + 1024), (zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS),
                         (zmq.ROUTER_MANDATORY, 0)):
            inbox.setsockopt(opt, val)
        budget = min(self.cluster.connections(len(self.cluster.hosts) + len(self.cluster.arbiters)), max(16, fds - 256))
        ips = endpoint_ips([*(h.control for h in self.cluster.hosts), *(a.control for a in self.cluster.arbiters)])
        self.guard = SharedGuard(inbox, budget, ips)
        bind(inbox, self.me.control, "control")
        self.out: dict[int, zmq.Socket] = {}
        for a in self.cluster.arbiters:
            if a.rank == self.me.rank:
                continue
            d = ctx.socket(zmq.DEALER)
            d.curve_secretkey, d.curve_publickey, d.curve_serverkey = self.secret, self.public, a.public_key.encode()
            for opt, val in ((zmq.SNDHWM, 100_000), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_ARBITER_MESSAGE_BYTES + 1024)):
                d.setsockopt(opt, val)
            d.connect(a.control)
            self.out[a.rank] = d
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(self.guard.monitor, zmq.POLLIN)

    def _close(self) -> None:
        if hasattr(self, "guard"):
            self.guard.close()
        for s in [getattr(self, "inbox", None), *getattr(self, "out", {}).values()]:
            if s is not None:
                s.close(0)
        if hasattr(self, "auth"):
            self.auth.stop()
        if hasattr(self, "ctx"):
            self.ctx.destroy(0)

    # ------------------------------------------------------------------ loop
    def stop(self, *_: Any) -> None:
        self._stop = True

    def run(self) -> None:
        try:
            self._open()
        except BaseException:
            with contextlib.suppress(Exception):
                self._close()
            raise
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info(**_ev("arbiter_started", name=self.me.name, rank=self.me.rank, arbiters=len(self.cluster.arbiters),
                       control=self.me.control, policy=self.cluster.policy))
        self.send(self.core.start(self.now()))
        try:
            while not self._stop:
                now = self.now()
                timeout = min(1.0, max(0.0, self.core.next_deadline() - now))
                events = dict(self.poller.poll(max(0, math.ceil(timeout * 1000))))
                if self.inbox in events:  # first: a connection that has spoken is its sender's
                    self._drain()
                self._connections(self.guard.monitor in events)
                self._timers(self.now())
                self._log_role()
        finally:
            log.info(**_ev("arbiter_stopped", name=self.me.name, **self.core.status(self.now()),
                           connections=self.guard.counts(), errors=dict(self._error_kinds)))
            self._close()

    def _connections(self, monitored: bool) -> None:
        """The guard's connection events and expiries; an error there is counted, never the
        end of the process."""
        try:
            if monitored:
                self.guard.drain()
            self.guard.expire(time.monotonic())
        except Exception as e:
            self._error("connections", e)

    def _timers(self, now: float) -> None:
        """The core's timers when due; an error there is counted, never the end of the process."""
        try:
            if now >= self.core.next_deadline():
                self.send(self.core.tick(now))
        except Exception as e:
            self._error("tick", e)

    def _drain(self) -> None:
        """A batch: waiting messages answered as decided, the changes sent every quarter
        beat and at the end; at most ``BATCH`` messages and ``BATCH_S`` seconds."""
        sock, core = self.inbox, self.core
        n = 0
        start = flushed = self.now()
        every = min(BATCH_S, core.heartbeat_s / 4)
        while n < BATCH and readable(sock):
            frames = recv_frames(sock)
            n += 1
            now = self.now()
            if now - flushed >= every:  # the followers hear the leader whatever the batch holds
                flushed = now
                self._flush(now)
            if now - start >= BATCH_S:
                n = BATCH  # this one, then the timers' turn
            if len(frames) != 2:
                core.counters.invalid += 1
                continue
            user = frames[1].get("User-Id")
            key = user.encode() if isinstance(user, str) else b""
            host, rank = self._sender.get(key, (-1, -1))
            try:
                if host >= 0 or rank >= 0:
                    self.guard.spoke(int(frames[1].get(zmq.SRCFD)), key)
                if host >= 0:
                    self._reply(frames[0], core.on_host(host, frames[1].bytes, now))
                elif rank >= 0:
                    self.send(core.on_arbiter(rank, frames[1].bytes, now))
                else:
                    core.counters.invalid += 1
            except Exception as e:  # a message that breaks a handler is dropped, never fatal
                self._error("message", e)
        self._flush(self.now())

    def _flush(self, now: float) -> None:
        try:
            self.send(self.core.flush())
        except Exception as e:
            self._error("flush", e)
        self._timers(now)

    def _reply(self, ident: zmq.Frame, outs: list[ArbiterOut]) -> None:
        for o in outs:
            if o.host >= 0:
                try:
                    self.inbox.send_multipart([ident, o.data], zmq.NOBLOCK)
                except zmq.Again:
                    self.unsent += 1
            else:
                self.send([o])

    def send(self, outs: list[ArbiterOut]) -> None:
        """Messages for the other arbiters (replies to hosts go through :meth:`_reply`)."""
        for o in outs:
            sock = self.out.get(o.arbiter)
            if sock is None:
                continue
            try:
                sock.send(o.data, zmq.NOBLOCK)
            except zmq.Again:  # the other arbiter is away: it fetches the whole table when back
                self.unsent += 1

    def _error(self, where: str, e: Exception) -> None:
        """Counted per kind (where, and the exception's type); each kind logged once."""
        self.errors += 1
        kind = f"{where}: {type(e).__name__}"
        seen = self._error_kinds.get(kind, 0)
        self._error_kinds[kind] = seen + 1
        if not seen:
            log.exception(**_ev("handler_error", name=self.me.name, kind=kind, count=self.errors))

    def _log_role(self) -> None:
        seen = self.core.seen_epoch
        if seen > self._seen_epoch:  # led or heard of: a restart starts from it
            try:
                self._seen_epoch = keep_epoch(self.cluster.state_dir, f"arbiter-{self.me.name}", seen)
            except IncarnationError as e:  # a restart may then lead below it: hosts wait, then forget it
                self._seen_epoch = seen
                log.error(**_ev("epoch_not_kept", name=self.me.name, error=str(e)))
        role = f"{self.core.role}/{self.core.epoch}"
        if role != self._role:
            self._role = role
            log.info(**_ev("arbiter_role", name=self.me.name, role=self.core.role, epoch=self.core.epoch,
                           seen_epoch=self.core.seen_epoch, synced=self.core.synced))


def run_arbiter(cluster: Cluster, name: str, secret_key_file: str | None = None, log_level: str = "info") -> None:
    setup_logging(log_level)
    if not cluster.arbiters:
        raise AgentError("arbiters: the cluster file lists no [[arbiters]]; add one per arbiter process")
    ArbiterProcess(cluster, name, secret_key_file).run()
