"""Prometheus view of an agent: the node's counters and RESERVE propagation latency.

The collector runs on the agent's loop thread only (the node is not thread-safe: reading
it can start the core's deferred recomputation): the local API's ``metrics`` op and the
HTTP endpoint (:class:`MetricsServer`, polled by the same loop) both render there.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq

from ark.agent.sockets import AgentError

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


# The counters an agent exports: (name, help, its value for an agent), read from the node's
# counters at scrape time. The reference (docs) lists this table.
COUNTERS: tuple[tuple[str, str, Callable[[Any], float]], ...] = (
    ("ark_reservations", "reservations made by this host", lambda a: a.node.core.counters.reserved),
    ("ark_requests", "path requests from local engines", lambda a: a.node.core.counters.requests),
    ("ark_races_lost", "local flows re-pathed after a race", lambda a: a.node.core.counters.races_lost),
    ("ark_fallbacks", "requests that found no free path", lambda a: a.node.core.counters.fallbacks),
    ("ark_renewals", "lease renewals applied", lambda a: a.node.core.counters.renewals),
    ("ark_expired", "reservations whose lease ran out", lambda a: a.node.core.counters.expired),
    ("ark_invalid_messages", "malformed or unauthorised peer messages dropped",
     lambda a: a.node.counters.invalid + a.node.core.counters.invalid),
    ("ark_wrong_version_messages", "peer messages of another wire version dropped",
     lambda a: a.node.counters.wrong_version),
    ("ark_dropped_messages", "duplicate or stale peer messages dropped",
     lambda a: a.node.counters.dropped + a.node.core.counters.duplicates + a.node.core.counters.stale),
    ("ark_unsent_messages", "messages not sent: a peer's queue was full", lambda a: a.dropped_out),
    ("ark_sequence_gaps", "gaps in a peer's sequence numbers", lambda a: a.node.counters.gaps),
    ("ark_syncs_applied", "table resynchronisations applied", lambda a: a.node.counters.sync_applied),
)
RESERVED_LINKS = ("ark_reserved_links", "links this host's table holds")
PROPAGATION = ("ark_reserve_propagation_seconds", "RESERVE ts to arrival here")
# (series name as exported, Prometheus type, help): every metric, each labelled with the
# agent's host name. The text format adds ``_total`` to a counter's name.
METRICS: tuple[tuple[str, str, str], ...] = (
    *((f"{name}_total", "counter", doc) for name, doc, _ in COUNTERS),
    (RESERVED_LINKS[0], "gauge", RESERVED_LINKS[1]),
    (PROPAGATION[0], "histogram", PROPAGATION[1] + f" (buckets {', '.join(map(str, BUCKETS))} s)"),
)


class Collector:
    """A custom collector: read at scrape time (on the loop thread), nothing kept per message."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        node = self.agent.node
        host = self.agent.me.name
        for name, doc, value in COUNTERS:
            m = CounterMetricFamily(name, doc, labels=["host"])
            m.add_metric([host], value(self.agent))
            yield m
        g = GaugeMetricFamily(*RESERVED_LINKS, labels=["host"])
        g.add_metric([host], len(node.core.link_holders()))
        yield g
        samples = list(node.propagation_s)
        buckets = [(str(b), sum(1 for s in samples if s <= b)) for b in BUCKETS]
        buckets.append(("+Inf", len(samples)))
        h = HistogramMetricFamily(*PROPAGATION, labels=["host"])
        h.add_metric([host], buckets, sum_value=math.fsum(samples))
        yield h


def registry(agent: Any) -> Any:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(Collector(agent))
    return reg


SCRAPES_AT_ONCE = 16  # open metrics connections; beyond, a connection is closed as it is accepted
SCRAPE_TIMEOUT_S = 2.0  # a connection's whole exchange, request in and response out
MAX_REQUEST_BYTES = 8192
RENDER_REUSE_S = 0.5  # one rendering answers every scrape within this long
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PATHS = (b"/", b"/metrics")


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float  # time.monotonic()
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes | None = None  # the response once the request is in: what is left to send


class MetricsServer:
    """Prometheus text over HTTP on 127.0.0.1, served from the agent's own loop.

    No thread: the listening socket and its connections are non-blocking and polled with
    the agent's ZeroMQ sockets, so the collector reads the node only on the loop thread.
    Any local user can connect, so everything is bounded: at most ``cap`` connections
    (the agent counts them in its descriptor budget; one more is closed as soon as it is
    accepted, ``shed``), ``timeout_s`` for a connection's whole exchange (a client that
    sends half a request or reads nothing is closed, ``timed_out``), a request of at most
    :data:`MAX_REQUEST_BYTES`, and one rendering per :data:`RENDER_REUSE_S`.
    """

    def __init__(self, port: int, render: Callable[[], bytes], pollers: list[zmq.Poller],
                 cap: int = SCRAPES_AT_ONCE, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", port))
            ls.listen(512)  # the kernel queues them, not our descriptors; shed as fast as we accept
        except OSError as e:
            ls.close()
            raise AgentError(f"metrics_port: cannot listen on 127.0.0.1:{port} ({e.strerror}); expected a port "
                             f"(1..65535) that nothing else holds") from None
        ls.setblocking(False)
        self.listener, self.render, self.pollers = ls, render, pollers
        self.cap, self.timeout_s = cap, timeout_s
        self._conns: dict[int, _Conn] = {}  # by descriptor: what the poller reports for a plain socket
        self._resume_at = math.inf  # listening paused (out of descriptors) until then
        self._text, self._rendered_at = b"", -math.inf
        self.served = self.shed = self.timed_out = 0
        self._watch(ls, zmq.POLLIN)

    def counters(self) -> dict[str, int]:
        return {"metrics_open": len(self._conns), "metrics_served": self.served, "metrics_shed": self.shed,
                "metrics_timed_out": self.timed_out}

    def wait_s(self) -> float:
        """Seconds until a connection's deadline (or the end of a pause) is due."""
        due = min((c.deadline for c in self._conns.values()), default=self._resume_at)
        return max(0.0, min(due, self._resume_at) - time.monotonic())

    def handle(self, events: dict[Any, int]) -> None:
        """Whatever ``events`` (one poll's) says is ready, then what is overdue."""
        now = time.monotonic()
        if self.listener.fileno() in events:
            self._accept(now)
        for fd in [fd for fd in events if fd in self._conns]:
            self._serve(self._conns[fd], now)
        if self._conns or self._resume_at <= now:
            self._expire(now)

    def _watch(self, sock: socket.socket, flags: int) -> None:
        for p in self.pollers:
            p.register(sock.fileno(), flags)

    def _unwatch(self, sock: socket.socket) -> None:
        for p in self.pollers:
            p.unregister(sock.fileno())

    def _accept(self, now: float, limit: int = 256) -> None:
        for _ in range(limit):
            try:
                sock, _addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of descriptors: stop listening a moment rather than spin
                self._unwatch(self.listener)
                self._resume_at = now + 0.1
                return
            if len(self._conns) >= self.cap:
                self.shed += 1
                _reset(sock)
                continue
            sock.setblocking(False)
            self._conns[sock.fileno()] = _Conn(sock, now + self.timeout_s)
            self._watch(sock, zmq.POLLIN)

    def _serve(self, c: _Conn, now: float) -> None:
        if c.out is None:
            try:
                data = c.sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the client went away
                self._drop(c, reset=True)
                return
            c.inbuf += data
            end = c.inbuf.find(b"\r\n\r\n")
            if end < 0:
                end = c.inbuf.find(b"\n\n")
            if end < 0 and len(c.inbuf) <= MAX_REQUEST_BYTES:
                return
            c.out = self._response(bytes(c.inbuf[:end]) if end >= 0 else None, now)
            self._watch(c.sock, zmq.POLLOUT)
        self._send(c)

    def _send(self, c: _Conn) -> None:
        assert c.out is not None
        try:
            n = c.sock.send(c.out)
        except BlockingIOError:
            return
        except OSError:
            self._drop(c, reset=True)
            return
        c.out = c.out[n:]
        if not c.out:
            self.served += 1
            self._drop(c, reset=False)  # all of it is in the kernel's buffer: a plain close sends it

    def _response(self, head: bytes | None, now: float) -> bytes:
        if head is None:
            return _http(431, b"request header too large\n")
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _http(400, b"bad request\n")
        if parts[0] not in (b"GET", b"HEAD"):
            return _http(405, b"only GET and HEAD\n", b"Allow: GET, HEAD\r\n")
        if parts[1].split(b"?", 1)[0] not in _PATHS:
            return _http(404, b"metrics are at /metrics\n")
        if now - self._rendered_at >= RENDER_REUSE_S:
            self._text, self._rendered_at = self.render(), now
        return _http(200, self._text, head_only=parts[0] == b"HEAD", content_type=CONTENT_TYPE)

    def _expire(self, now: float) -> None:
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            self.timed_out += 1
            self._drop(c, reset=True)
        if self._resume_at <= now:
            self._resume_at = math.inf
            self._watch(self.listener, zmq.POLLIN)

    def _drop(self, c: _Conn, reset: bool) -> None:
        self._unwatch(c.sock)
        del self._conns[c.sock.fileno()]
        if reset:
            _reset(c.sock)
        else:
            c.sock.close()

    def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c, reset=True)
        self.listener.close()


def _reset(sock: socket.socket) -> None:
    """Close with a reset: nothing lingers (no TIME_WAIT) for a connection we refuse."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


def _http(status: int, body: bytes, extra: bytes = b"", head_only: bool = False,
          content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()
    return head + extra + b"\r\n" + (b"" if head_only else body)
