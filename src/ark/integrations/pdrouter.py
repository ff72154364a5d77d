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

Hostile input: a body must be a JSON object of at most ``max_body_bytes`` (beyond: 413,
refused before it is read); a client's own
``kv_transfer_params`` are refused (transfer ids are the router's: a client naming one could
make a decode instance pull another request's KV blocks); at most ``max_in_flight`` requests
are served at once (beyond: 503). Errors are one-line JSON ``{"error": {"message": ...}}``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from ark.core.schema import ConfigError, convert

ROUTES = ("/v1/completions", "/v1/chat/completions")


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


def pair_params(transfer_id: str, prefill: Instance) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kv_transfer_params`` of the prefill request and of the decode request."""
    return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
            {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
             "remote_engine_id": prefill.engine_id, "remote_bootstrap_addr": prefill.bootstrap})


def check_body(raw: bytes, limit: int) -> dict[str, Any]:
    """The client's request body, or ValueError with the one line to answer."""
    if len(raw) > limit:
        raise ValueError(f"body: larger than {limit} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("body: not valid JSON") from None
    if not isinstance(body, dict):
        raise ValueError("body: expected a JSON object")
    if "kv_transfer_params" in body:
        raise ValueError("kv_transfer_params: set by the router; a request must not carry its own")
    return body


class Router:
    """The router's state and handlers (aiohttp); :meth:`app` builds the web application."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.counters = RouterCounters()
        self._prefill: Iterator[Instance] = itertools.cycle(config.prefill)
        self._decode: Iterator[Instance] = itertools.cycle(config.decode)
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._session: Any = None

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=self.config.max_body_bytes + 1)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: Any) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))

    async def _close(self, _app: Any) -> None:
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _error(status: int, message: str) -> Any:
        from aiohttp import web

        return web.json_response({"error": {"message": message, "code": status}}, status=status)

    async def health(self, _request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, "requests": self.counters.requests})

    async def models(self, _request: Any) -> Any:
        from aiohttp import web

        async with self._session.get(self.config.decode[0].url.rstrip("/") + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def handle(self, request: Any) -> Any:
        if self._slots.locked():
            self.counters.refused += 1
            return self._error(503, f"router: {self.config.max_in_flight} requests in flight; retry later")
        async with self._slots:
            try:
                body = check_body(await request.read(), self.config.max_body_bytes)
            except ValueError as e:
                self.counters.refused += 1
                return self._error(400, str(e))
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
                    await out.write(chunk)
                await out.write_eof()
                return out
        except Exception as e:
            self.counters.decode_failed += 1
            if out is not None and out.prepared:  # the answer had begun: it ends short
                return out
            return self._error(502, f"decode {url}: {type(e).__name__}: {e}")


def serve(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the router until interrupted."""
    from aiohttp import web

    web.run_app(Router(config).app(), host=host, port=port, print=None)
