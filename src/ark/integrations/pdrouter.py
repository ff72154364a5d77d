"""A prefill/decode router: one OpenAI-compatible completions endpoint in front of vLLM
prefill and decode instances that move KV caches with a KV connector (Mooncake's, or ARK's
steered one in :mod:`ark.integrations.vllm`).

    ark serve-pd --config pd.toml          # [[prefill]] and [[decode]] instances, see RouterConfig

For each request the router draws a transfer id and picks a prefill and a decode instance
(round-robin, each list on its own). The prefill instance gets the request with
``max_tokens = 1`` and ``kv_transfer_params = {"do_remote_decode": true, "transfer_id": id}``:
it computes the prompt's KV cache and keeps its blocks for the decode side. The decode
instance gets the request as the client sent it, with ``kv_transfer_params =
{"do_remote_prefill": true, "transfer_id": id, "remote_engine_id": ..., "remote_bootstrap_addr":
...}``: its connector asks the prefill side (through its bootstrap server) for the blocks,
the prefill side pushes them, and decoding starts from them. The decode instance's answer
(streamed or not) is the client's answer. ``mode = "concurrent"`` sends the decode request
without waiting for the prefill answer (the decode side's connector waits for the blocks),
which saves one round trip; ``"sequential"`` (default) waits, so a prefill failure is
reported before any decode work.

Hostile input (every error answer is one line of JSON ``{"error": {"message": ..., "code": ...}}``,
the HTTP parser's own included):

* a body must be a JSON object of at most ``max_body_bytes`` (beyond: 413, refused before
  it is read when its length is declared), nested less deeply than the decoder allows,
  with finite numbers only (NaN, Infinity and overflowing literals: 400 naming the field);
  a client's own ``kv_transfer_params`` are refused (transfer ids are the router's: a
  client naming one could make a decode instance pull another request's KV blocks);
* time: a connection must send a request's headers within ``header_timeout_s`` of opening
  (or of its previous answer) or it is closed, and the body within ``body_timeout_s`` of
  the headers (beyond: 408), and must take each part of its answer within
  ``body_timeout_s`` (a client that stops reading is cut off, so it cannot keep its
  slot). An in-flight slot (``max_in_flight``, beyond: 503) is taken
  only once the body is in, so clients that trickle hold a connection, never a slot;
* memory: the bodies being read, on all connections together, take from one budget of
  ``max_in_flight x max_body_bytes`` bytes, chunk by chunk as they arrive, and give it back
  once their request is parsed or refused; a chunk that finds the budget spent is answered
  503 (``body_budget_refused``), so many connections that each send most of a body never
  buffer more than that between them;
* descriptors: at most ``max_connections`` client connections are open, and fewer when
  the process's descriptor limit (``RLIMIT_NOFILE``, raised to its hard limit at start)
  minus what the upstream connections may take leaves less room; one beyond is answered a
  canned 503 and closed at once, so the accept loop never runs out of descriptors. What is
  refused or fails is counted (:class:`RouterCounters`) and logged at most once per
  ``log_every_s`` per kind, as one line with the count, never a traceback per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import math
import os
import resource
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from ark.core.schema import ConfigError, convert

ROUTES = ("/v1/completions", "/v1/chat/completions")
log = logging.getLogger("ark.pdrouter")
FD_HEADROOM = 64  # descriptors kept for the listener, logs, the event loop and the interpreter
WALK_BUDGET = 200_000  # values visited to name a non-finite number's field; beyond, it goes unnamed
PATH_CHARS = 200  # a field's path in an error message is cut to this many characters
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class RouterError(ConfigError):
    """An invalid router configuration."""


_Url = Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s/]+(:\d+)?/?$", max_length=256)]


class Instance(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One vLLM instance: its OpenAI endpoint; for a prefill instance also what a decode
    instance needs to pull from it (its connector's engine id and bootstrap address)."""

    url: _Url
    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    bootstrap: _Url | None = None


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The router's TOML file::

        mode = "sequential"            # or "concurrent"
        [[prefill]]
        url = "http://10.0.0.1:8100"
        engine_id = "prefill0"         # the instance's kv_transfer_config engine_id
        bootstrap = "http://10.0.0.1:8998"   # its connector's bootstrap server
        [[decode]]
        url = "http://10.0.1.1:8200"
    """

    prefill: Annotated[list[Instance], msgspec.Meta(min_length=1, max_length=1024)]
    decode: Annotated[list[Instance], msgspec.Meta(min_length=1, max_length=1024)]
    mode: Literal["sequential", "concurrent"] = "sequential"
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 << 20)] = 4 << 20
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 600.0
    max_connections: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)] = 4096
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    log_every_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 10.0

    def __post_init__(self) -> None:
        for i, p in enumerate(self.prefill):
            if p.engine_id is None or p.bootstrap is None:
                raise ValueError(f"prefill[{i}]: needs engine_id and bootstrap (what a decode instance pulls from)")


def load_config(raw: Any) -> RouterConfig:
    """A router config from parsed TOML or JSON; a bad one is one :class:`RouterError` line."""
    return convert(raw, RouterConfig, error=RouterError)


@dataclass
class RouterCounters:
    requests: int = 0
    refused: int = 0  # bad bodies, client kv_transfer_params, beyond max_in_flight
    prefill_failed: int = 0
    decode_failed: int = 0
    ttft_s: list[float] = field(default_factory=list)  # time to the decode side's first byte, bounded
    connections: int = 0  # open client connections now
    connections_refused: int = 0  # beyond the connection cap: canned 503, closed
    body_timeouts: int = 0  # 408: the body did not arrive within body_timeout_s
    body_budget_refused: int = 0  # 503: the bodies being read had the whole body budget
    write_timeouts: int = 0  # a client read nothing of its answer for body_timeout_s: aborted
    bad_http: int = 0  # requests the HTTP parser refused (400 and the like)
    errors: int = 0  # 500: the router's own failure while serving a request
    accept_errors: int = 0  # accept() out of descriptors or memory (should stay 0 under the cap)


class RateLog:
    """Counts events per kind and logs each kind at most once per ``every_s``: one line
    with how many happened since the last one (the first is logged at once)."""

    def __init__(self, every_s: float, clock: Any = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._last: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def note(self, kind: str, detail: str = "") -> None:
        self._unlogged[kind] = n = self._unlogged.get(kind, 0) + 1
        now = self._clock()
        if now - self._last.get(kind, -math.inf) >= self.every_s:
            self._last[kind] = now
            del self._unlogged[kind]
            log.warning("router: %s x%d%s", kind, n, f" (last: {detail[:200]})" if detail else "")


class Refusal(ValueError):
    """A request refused with ``status`` and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def pair_params(transfer_id: str, prefill: Instance) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kv_transfer_params`` of the prefill request and of the decode request."""
    return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
            {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
             "remote_engine_id": prefill.engine_id, "remote_bootstrap_addr": prefill.bootstrap})


def non_finite_field(body: Any, budget: int = WALK_BUDGET) -> str | None:
    """The path (``messages[0].temperature``) of the first non-finite number in document
    order, cut to ``PATH_CHARS``; "" when there is one beyond ``budget`` values visited,
    None when there is none. The walk holds one (path, iterator) pair per level of
    nesting and builds one child's path per step, so its memory is the depth times
    ``PATH_CHARS``, whatever the width of a list or the length of a key."""
    if isinstance(body, float) and not math.isfinite(body):
        return "body"
    if not isinstance(body, (dict, list)):
        return None
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", _items(body))]
    while stack:
        path, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        if budget <= 0:
            return ""
        budget -= 1
        here = _child_path(path, item[0])
        v = item[1]
        if isinstance(v, float) and not math.isfinite(v):
            return here
        if isinstance(v, (dict, list)):
            stack.append((here, _items(v)))
    return None


def _items(v: dict[Any, Any] | list[Any]) -> Iterator[tuple[Any, Any]]:
    return iter(v.items()) if isinstance(v, dict) else enumerate(v)


def _child_path(parent: str, key: Any) -> str:
    """``parent.key`` or ``parent[i]``, at most ``PATH_CHARS`` long (a long key is cut
    before it is joined, so no step builds more than about twice that)."""
    if len(parent) >= PATH_CHARS:
        return parent
    step = f"[{key}]" if isinstance(key, int) else (f".{str(key)[:PATH_CHARS]}" if parent else str(key)[:PATH_CHARS])
    return (parent + step)[:PATH_CHARS]


def check_body(raw: bytes, limit: int) -> dict[str, Any]:
    """The client's request body, or :class:`Refusal` (a ValueError) with the answer."""
    if len(raw) > limit:
        raise Refusal(413, f"body: larger than {limit} bytes")
    seen = [False]

    def number(text: str) -> float:
        v = float(text)
        seen[0] = seen[0] or not math.isfinite(v)
        return v

    try:
        body = json.loads(raw, parse_float=number, parse_constant=number)
    except RecursionError:
        raise Refusal(400, "body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise Refusal(400, "body: not valid JSON") from None
    if not isinstance(body, dict):
        raise Refusal(400, "body: expected a JSON object")
    if seen[0]:
        where = non_finite_field(body)
        raise Refusal(400, f"{where or 'body'}: not a finite number (NaN and Infinity are refused)")
    if "kv_transfer_params" in body:
        raise Refusal(400, "kv_transfer_params: set by the router; a request must not carry its own")
    return body


def error_response(status: int, message: str) -> Any:
    """One line of JSON: ``{"error": {"message": ..., "code": status}}``."""
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status,
                             dumps=lambda o: json.dumps(o, ensure_ascii=True))


def _canned(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def connection_budget(config: RouterConfig) -> int:
    """How many client connections fit: ``max_connections``, or fewer when the descriptor
    limit (soft ``RLIMIT_NOFILE``, raised to the hard one first) less the upstream pool,
    the descriptors open now and a headroom leaves less. RouterError when under 16."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = FD_HEADROOM
    room = (soft if soft != resource.RLIM_INFINITY else 1 << 20) - upstream_limit(config) - open_now - FD_HEADROOM
    if room < 16:
        raise RouterError(f"max_connections: the descriptor limit (RLIMIT_NOFILE {soft}) leaves room for {room} "
                          f"client connections beside {upstream_limit(config)} upstream ones; raise it "
                          f"(ulimit -n) or lower max_in_flight")
    return min(config.max_connections, room)


def upstream_limit(config: RouterConfig) -> int:
    """Upstream connections the router may hold: two per request in flight."""
    return 2 * config.max_in_flight
class Router:
    """The router's state and handlers (aiohttp): :meth:`start` listens with the connection
    cap and the timeouts, :meth:`app` is the web application behind them."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.counters = RouterCounters()
        self.events = RateLog(config.log_every_s)
        self._prefill: Iterator[Instance] = itertools.cycle(config.prefill)
        self._decode: Iterator[Instance] = itertools.cycle(config.decode)
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self.body_budget = config.max_in_flight * config.max_body_bytes  # bytes of bodies being read, all together
        self._reading = 0  # of which taken now
        self._session: Any = None
        self._runner: Any = None
        self._listener: _Listener | None = None
        self.address: tuple[str, int] | None = None

    def app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def json_errors(request: Any, handler: Any) -> Any:
            return await self._json_errors(request, handler)

        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[json_errors])
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port); returns the address bound."""
        from aiohttp import web

        cap = connection_budget(self.config)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        self._listener = _Listener(self, self._runner.server, cap)
        self.address = self._listener.listen(host, port)
        log.info("router: listening on %s:%d, at most %d connections, %d in flight", *self.address, cap,
                 self.config.max_in_flight)
        return self.address

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Out of descriptors in accept() is counted and logged once per interval (asyncio
        would log a traceback each time it retries); anything else as asyncio does."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            self.counters.accept_errors += 1
            self.events.note("accept failed", f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}")
            return
        loop.default_exception_handler(context)

    async def _open(self, _app: Any) -> None:
        import aiohttp

        conn = aiohttp.TCPConnector(limit=upstream_limit(self.config))
        self._session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))

    async def _close(self, _app: Any) -> None:
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _error(status: int, message: str) -> Any:
        return error_response(status, message)

    async def _json_errors(self, request: Any, handler: Any) -> Any:
        """aiohttp's own answers (404, 405, ...) and any failure, as one line of JSON."""
        from aiohttp import web


        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self._error(e.status, f"{request.method} {request.path[:200]}: {e.reason}")
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # the router's own bug: the client gets a 500 line, the log a count
            self.counters.errors += 1
            self.events.note("internal error", f"{type(e).__name__}: {e}")
            return self._error(500, f"router: internal error ({type(e).__name__})")

    async def health(self, _request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, "requests": self.counters.requests,
                                  "connections": self.counters.connections})

    async def models(self, _request: Any) -> Any:
        from aiohttp import web

        try:
            async with self._session.get(self.config.decode[0].url.rstrip("/") + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except Exception as e:
            return self._error(502, f"decode {self.config.decode[0].url}: {type(e).__name__}: {e}")

    async def _read_body(self, request: Any) -> dict[str, Any]:
        """The body, read within ``body_timeout_s`` and at most ``max_body_bytes``."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, f"body: larger than {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                while chunk := await request.content.read(limit + 1 - size):
                    self._take_body_bytes(len(chunk))
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise Refusal(413, f"body: larger than {limit} bytes")
            return check_body(b"".join(chunks), limit)
        except TimeoutError:
            self.counters.body_timeouts += 1
            self.events.note("body timeout")
            raise Refusal(408, f"body: not received within {self.config.body_timeout_s} s") from None
        finally:
            self._reading -= sum(map(len, chunks))

    def _take_body_bytes(self, n: int) -> None:
        """``n`` more bytes of a body being read, from the shared budget; Refusal (503) when
        it has not that much left."""
        if self._reading + n > self.body_budget:
            self.counters.body_budget_refused += 1
            self.events.note("body budget spent", f"{self.body_budget} bytes of bodies being read")
            raise Refusal(503, f"router: {self.body_budget} bytes of request bodies being read; retry later")
        self._reading += n

    async def handle(self, request: Any) -> Any:
        try:
            body = await self._read_body(request)
        except Refusal as e:
            self.counters.refused += 1
            return self._error(e.status, str(e))
        if self._slots.locked():
            self.counters.refused += 1
            return self._error(503, f"router: {self.config.max_in_flight} requests in flight; retry later")
        async with self._slots:
            self.counters.requests += 1
            return await self._route(request, body)

    async def _route(self, request: Any, body: dict[str, Any]) -> Any:
        prefill, decode = next(self._prefill), next(self._decode)
        pre_params, dec_params = pair_params(f"ark-{uuid.uuid4().hex}", prefill)
        pre_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": pre_params}
        pre_body.pop("stream_options", None)
        pre_body.pop("max_completion_tokens", None)
        path = request.path
        t0 = time.perf_counter()
        pre = asyncio.ensure_future(self._prefill_call(prefill.url.rstrip("/") + path, pre_body))
        if self.config.mode == "sequential":
            failed = await pre
            if failed is not None:
                return failed
        try:
            return await self._relay(request, decode.url.rstrip("/") + path, {**body, "kv_transfer_params": dec_params},
                                     t0)
        finally:
            if self.config.mode == "concurrent":
                await pre

    async def _prefill_call(self, url: str, body: dict[str, Any]) -> Any:
        """None when the prefill instance answered 200, else the error response to send."""
        try:
            async with self._session.post(url, json=body) as r:
                text = await r.read()
                if r.status == 200:
                    return None
                self.counters.prefill_failed += 1
                return self._error(502, f"prefill {url}: HTTP {r.status}: {text[:200]!r}")
        except Exception as e:  # a dead or hung instance is the client's 502, not the router's crash
            self.counters.prefill_failed += 1
            return self._error(502, f"prefill {url}: {type(e).__name__}: {e}")

    async def _write(self, request: Any, out: Any, chunk: bytes) -> None:
        """One chunk of an answer to the client, within ``body_timeout_s`` (the write waits
        while the client reads nothing); beyond, the connection is aborted and counted."""
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                await out.write(chunk)
        except TimeoutError:
            self.counters.write_timeouts += 1
            self.events.note("write timeout", f"the client read nothing for {self.config.body_timeout_s} s")
            if request.transport is not None:
                request.transport.abort()
            raise _SlowReader from None

    async def _relay(self, request: Any, url: str, body: dict[str, Any], t0: float) -> Any:
        """The decode instance's answer, streamed through as it comes."""
        from aiohttp import web

        out = None
        try:
            async with self._session.post(url, json=body) as r:
                if r.status != 200:
                    self.counters.decode_failed += 1
                out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type",
                                                                                                  "application/json")})
                await out.prepare(request)
                first = True
                async for chunk in r.content.iter_any():
                    if first and len(self.counters.ttft_s) < 100_000:
                        self.counters.ttft_s.append(time.perf_counter() - t0)
                    first = False
                    await self._write(request, out, chunk)
                await out.write_eof()
                return out
        except _SlowReader:
            return out  # the connection is aborted: the answer ends short, the slot is free
        except Exception as e:
            self.counters.decode_failed += 1
            if out is not None and out.prepared:  # the answer had begun: it ends short
                return out
            return self._error(502, f"decode {url}: {type(e).__name__}: {e}")


class _SlowReader(Exception):
    """The client took no part of an answer for ``body_timeout_s``."""


_REFUSED = _canned(503, "Service Unavailable", "router: too many connections; retry later")


def _handler_class() -> type:
    from aiohttp import web

    class Handler(web.RequestHandler):
        """aiohttp's connection handler; its own error answers (a request the parser refuses)
        are one line of JSON, counted, and logged once per interval, never with a traceback."""

        router: Router

        def connection_lost(self, exc: BaseException | None) -> None:
            if getattr(self, "_ark_open", False):
                self._ark_open = False
                self.router.counters.connections -= 1
            super().connection_lost(exc)

        def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                         message: str | None = None) -> Any:
            c, what = self.router.counters, (message or (str(exc) if exc else "") or f"HTTP {status}")
            if status >= 500:
                c.errors += 1
            else:
                c.bad_http += 1
            self.router.events.note("bad request" if status < 500 else "internal error", what.splitlines()[0][:200]
                                    if what else "")
            if request.writer.output_size > 0:
                raise ConnectionError("the answer had begun: it ends short")
            resp = error_response(status, f"http: {what.splitlines()[0][:200] if what else status}")
            resp.force_close()
            return resp

    return Handler


class _Listener:
    """The router's own accept loop. A connection is counted from the moment it is
    accepted, so at most ``cap`` are ever open; one beyond is answered a canned 503 and
    closed before the next is accepted, so refusing costs one descriptor for an instant.
    accept() out of descriptors anyway (another process's share) is counted, logged once
    per interval, and retried after a pause. Below the cap, aiohttp's handler serves the
    connection, with the header timeout as its idle timeout and no lingering after an
    unread body."""

    BATCH = 64  # accepts per wake-up, so that answering keeps pace with accepting
    PAUSE_S = 0.25  # after accept() ran out of descriptors

    def __init__(self, router: Router, server: Any, cap: int) -> None:
        self.router, self.server, self.cap = router, server, cap
        self.handler_class = _handler_class()
        self.sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def listen(self, host: str, port: int) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._ready)
        name = sock.getsockname()
        return str(name[0]), int(name[1])

    def close(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _ready(self) -> None:
        assert self.sock is not None
        c = self.router.counters
        for _ in range(self.BATCH):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _RESOURCE_ERRNOS:
                    self._pause(e)
                    return
                continue  # ECONNABORTED and the like: that client is gone
            if c.connections >= self.cap:
                c.connections_refused += 1
                self.router.events.note("connection refused", f"{self.cap} connections open")
                conn.setblocking(False)
                with contextlib.suppress(OSError):
                    conn.send(_REFUSED)
                conn.close()
                continue
            c.connections += 1
            task = asyncio.get_running_loop().create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _pause(self, e: OSError) -> None:
        assert self.sock is not None
        self.router.counters.accept_errors += 1
        self.router.events.note("accept failed", f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}")
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.sock.fileno())
        loop.call_later(self.PAUSE_S, self._resume)

    def _resume(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._ready)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._handler, conn)
        except OSError:
            conn.close()
            self.router.counters.connections -= 1

    def _handler(self) -> asyncio.Protocol:
        cfg = self.router.config
        h = self.handler_class(self.server, loop=asyncio.get_running_loop(), keepalive_timeout=cfg.header_timeout_s,
                               access_log=None, lingering_time=0.0)
        h.router, h._ark_open = self.router, True
        return h


def serve(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the router until SIGINT or SIGTERM."""
    from ark.agent.logs import setup_logging

    setup_logging()

    async def main() -> None:
        router = Router(config)
        await router.start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await router.stop()

    asyncio.run(main())
