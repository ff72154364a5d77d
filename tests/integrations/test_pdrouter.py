"""The P/D router over real sockets, against stand-in instances.

The stand-ins are small aiohttp servers that answer as a vLLM OpenAI server does and record
what they were sent; a real vLLM P/D pair behind the router is exercised in test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (the pd extra)")
from aiohttp import web  # noqa: E402

from ark.integrations.pdrouter import Router, RouterError, load_config  # noqa: E402


class StandIn:
    """An OpenAI completions server stand-in: records bodies, answers 1 token (prefill) or
    streams ``tokens`` chunks (decode)."""

    def __init__(self, name: str, status: int = 200, delay_s: float = 0.0) -> None:
        self.name, self.status, self.delay_s = name, status, delay_s
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"{self.name}-0"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for k in range(body["max_tokens"]):
            await out.write(f"data: {json.dumps({'choices': [{'text': f'{self.name}-{k}'}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    @staticmethod
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _with_router(instances: dict[str, list[StandIn]], test: Callable[[str, Router], Awaitable[None]],
                       **cfg: Any) -> None:
    for group in instances.values():
        for s in group:
            await s.start()
    raw = {"prefill": [{"url": s.url, "engine_id": s.name, "bootstrap": f"http://127.0.0.1:{8998 + i}"}
                       for i, s in enumerate(instances["prefill"])],
           "decode": [{"url": s.url} for s in instances["decode"]], **cfg}
    router = Router(load_config(raw))
    runner = web.AppRunner(router.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        await test(f"http://127.0.0.1:{runner.addresses[0][1]}", router)
    finally:
        await runner.cleanup()
        for group in instances.values():
            for s in group:
                await s.stop()


def test_a_request_goes_to_prefill_then_decode_with_one_transfer_id_round_robin() -> None:
    pre, dec = [StandIn("p0"), StandIn("p1")], [StandIn("d0"), StandIn("d1")]

    async def test(url: str, router: Router) -> None:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2",
                                                                   "max_tokens": 3, "stream": True}) as r:
                    assert r.status == 200
                    text = (await r.read()).decode()
                    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
            async with s.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "tiny"
        assert router.counters.requests == 4 and len(router.counters.ttft_s) == 4

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test))
    assert [len(p.bodies) for p in pre] == [2, 2] and [len(d.bodies) for d in dec] == [2, 2]
    for k in range(2):
        for i in range(2):
            pb, db = pre[i].bodies[k], dec[i].bodies[k]
            assert pb["max_tokens"] == 1 and pb["stream"] is False and pb["prompt"] == "w1 w2"
            tid = pb["kv_transfer_params"]["transfer_id"]
            assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
            # The decode side gets the client's request (streamed, 3 tokens) and where to pull from.
            assert db["max_tokens"] == 3 and db["stream"] is True
            assert db["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                                                "remote_engine_id": f"p{i}",
                                                "remote_bootstrap_addr": f"http://127.0.0.1:{8998 + i}"}
    tids = {p.bodies[k]["kv_transfer_params"]["transfer_id"] for p in pre for k in range(2)}
    assert len(tids) == 4


def test_hostile_bodies_are_refused_in_one_line_and_never_reach_an_instance() -> None:
    pre, dec = [StandIn("p0")], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        async with aiohttp.ClientSession() as s:
            cases = [(b"{not json", "body: not valid JSON"), (b"[1, 2]", "body: expected a JSON object"),
                     (json.dumps({"prompt": "x", "kv_transfer_params": {"transfer_id": "someone-elses"}}).encode(),
                      "kv_transfer_params: set by the router")]
            for raw, why in cases:
                async with s.post(url + "/v1/completions", data=raw) as r:
                    assert r.status == 400 and (await r.json())["error"]["message"].startswith(why)
            # Beyond max_body_bytes the server refuses the body before reading it all.
            async with s.post(url + "/v1/completions", data=b'{"prompt": "' + b"x" * 5000 + b'"}') as r:
                assert r.status == 413
        assert router.counters.refused == 3 and router.counters.requests == 0

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, max_body_bytes=4096))
    assert pre[0].bodies == [] and dec[0].bodies == []


def test_a_failed_prefill_is_a_502_and_the_decode_side_is_not_asked() -> None:
    pre, dec = [StandIn("p0", status=500)], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                          json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 502 and "prefill" in (await r.json())["error"]["message"]
        assert router.counters.prefill_failed == 1

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test))
    assert dec[0].bodies == []


def test_concurrent_mode_overlaps_the_two_requests_and_beyond_the_limit_is_503() -> None:
    pre, dec = [StandIn("p0", delay_s=0.3)], [StandIn("d0", delay_s=0.3)]

    async def test(url: str, router: Router) -> None:
        async with aiohttp.ClientSession() as s:
            async def one() -> tuple[int, float]:
                t = asyncio.get_running_loop().time()
                async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                    await r.read()
                    return r.status, asyncio.get_running_loop().time() - t
            (s1, t1), (s2, _t2) = await asyncio.gather(one(), one())
            assert sorted((s1, s2)) == [200, 503]  # max_in_flight = 1
            assert t1 < 0.55 or s1 == 503  # both calls at once: ~0.3 s, not 0.6 s

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, mode="concurrent", max_in_flight=1))
    assert len(pre[0].bodies) == len(dec[0].bodies) == 1


@pytest.mark.parametrize(("raw", "why"), [
    ({"prefill": [{"url": "http://a:1"}], "decode": [{"url": "http://b:2"}]}, r"^prefill\[0\]: needs engine_id"),
    ({"prefill": [], "decode": [{"url": "http://b:2"}]}, r"^prefill"),
    ({"prefill": [{"url": "ftp://a", "engine_id": "p", "bootstrap": "http://a:1"}], "decode": [{"url": "http://b:2"}]},
     r"^prefill\[0\]\.url"),
    ({"prefill": [{"url": "http://a:1", "engine_id": "p", "bootstrap": "http://a:9"}], "decode": [{"url": "http://b:2"}],
      "mode": "eager"}, r"^mode"),
])
def test_config_errors_name_the_field(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(RouterError, match=why):
        load_config(raw)
