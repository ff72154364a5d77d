"""The P/D router over real sockets, against stand-in instances.

The stand-ins are small aiohttp servers that answer as a vLLM OpenAI server does and record
what they were sent; a real vLLM P/D pair behind the router is exercised in test_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (the pd extra)")
from aiohttp import web  # noqa: E402

from ark.integrations.pdrouter import (  # noqa: E402
    PATH_CHARS,
    Refusal,
    Router,
    RouterError,
    check_body,
    error_response,
    load_config,
    non_finite_field,
)


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
    host, port = await router.start("127.0.0.1", 0)
    try:
        await test(f"http://{host}:{port}", router)
    finally:
        await router.stop()
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
                assert r.status == 413 and (await r.json())["error"]["message"].startswith("body: larger than 4096")
        assert router.counters.refused == 4 and router.counters.requests == 0

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


async def _raw(url: str, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the router answers until it closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def _one_json_line(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    assert body.count(b"\n") == 0 and body, body
    out: dict[str, Any] = json.loads(body)
    return out


def test_non_finite_numbers_deep_nesting_and_bad_http_are_one_line_json_errors() -> None:
    pre, dec = [StandIn("p0")], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        async with aiohttp.ClientSession() as s:
            cases = [(b'{"prompt": "x", "temperature": NaN}', "temperature: not a finite number"),
                     (b'{"prompt": "x", "extra": {"w": [1, 2, -Infinity]}}', "extra.w[2]: not a finite number"),
                     (b'{"prompt": "x", "top_p": 1e999}', "top_p: not a finite number"),
                     (b"[" * 100_000 + b"]" * 100_000, "body: nested too deeply"),
                     (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "body: nested too deeply")]
            for raw, why in cases:
                async with s.post(url + "/v1/completions", data=raw) as r:
                    text = await r.read()
                    assert r.status == 400 and text.count(b"\n") == 0, text[:200]
                    assert json.loads(text)["error"]["message"].startswith(why), text[:200]
            # A prompt that merely mentions NaN is a request like any other.
            async with s.post(url + "/v1/completions", json={"prompt": "NaN Infinity", "max_tokens": 1}) as r:
                assert r.status == 200
            for method, path, status in (("GET", "/nowhere", 404), ("GET", "/v1/completions", 405)):
                async with s.request(method, url + path) as r:
                    assert r.status == status and (await r.read()).count(b"\n") == 0
                    assert "error" in await r.json()
        # The HTTP parser's refusals are JSON too, and no traceback is logged for them.
        for garbage in (b"NOT HTTP AT ALL\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
            answer = await _raw(url, garbage)
            assert answer.split(b" ", 2)[1] == b"400", answer
            assert _one_json_line(answer)["error"]["code"] == 400
        assert router.counters.bad_http == 2 and router.counters.requests == 1

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test))
    assert len(pre[0].bodies) == 1 and pre[0].bodies[0]["prompt"] == "NaN Infinity"


def test_a_slow_body_holds_no_slot_and_is_cut_off_at_the_body_timeout() -> None:
    pre, dec = [StandIn("p0")], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t0 = asyncio.get_running_loop().time()
        async with aiohttp.ClientSession() as s:  # the one slot is free while the body trickles
            for _ in range(3):
                writer.write(b" ")
                async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.1)
        answer = await asyncio.wait_for(reader.read(), 5.0)
        waited = asyncio.get_running_loop().time() - t0
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and 0.9 <= waited < 3.0, (answer, waited)
        assert "not received within 1.0 s" in _one_json_line(answer)["error"]["message"]
        assert router.counters.body_timeouts == 1 and router.counters.requests == 3

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, max_in_flight=1, body_timeout_s=1.0))


def test_idle_connections_close_at_the_header_timeout_and_the_cap_refuses_cheaply() -> None:
    pre, dec = [StandIn("p0")], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        host, port = url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(16)]
        await asyncio.sleep(0.1)
        assert router.counters.connections == 16
        answer = await _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the 17th: refused
        assert answer.startswith(b"HTTP/1.1 503") and "too many connections" in answer.decode()
        assert router.counters.connections_refused == 1
        # Half a header is no better than none: all are closed at the header timeout.
        idle[0][1].write(b"POST /v1/completions HTTP/1.1\r\nHost:")
        t0 = asyncio.get_running_loop().time()
        for reader, _w in idle:
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
        assert 0.5 <= asyncio.get_running_loop().time() - t0 < 3.0
        for _r, w in idle:
            w.close()
        await asyncio.sleep(0.1)
        assert router.counters.connections == 0
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, max_connections=16, header_timeout_s=1.0))


class _Backends:
    """Stand-in prefill and decode instances on an event loop of their own (a thread)."""

    def __init__(self) -> None:
        self.pre, self.dec = StandIn("p0"), StandIn("d0")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._all("start"), self.loop).result(10)

    async def _all(self, what: str) -> None:
        for s in (self.pre, self.dec):
            await getattr(s, what)()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._all("stop"), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _honest(port: int, timeout_s: float = 5.0) -> tuple[int, float]:
    """One honest request on a fresh connection: (status, seconds to the whole answer)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - t0
    except OSError:
        return 0, time.perf_counter() - t0
    finally:
        c.close()


def _open_connections(port: int) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/health")
        return int(json.loads(c.getresponse().read())["connections"]) - 1  # less this one
    except (OSError, ValueError, KeyError):
        return -1
    finally:
        c.close()


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b" ")


def _siege(tmp_path: Path, slow: int, idle: int, hold_s: float, nofile: int | None = None,
           **cfg: Any) -> tuple[list[tuple[int, float]], int, str]:
    """An ``ark serve-pd`` process under ``slow`` slow-body and ``idle`` idle connections:
    honest requests made while they are held (status, seconds), and the router's log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    back, port = _Backends(), _free_port()
    conf = tmp_path / "pd.toml"
    conf.write_text("".join(f"{k} = {v}\n" for k, v in cfg.items()) +
                    f'[[prefill]]\nurl = "{back.pre.url}"\nengine_id = "p0"\nbootstrap = "http://127.0.0.1:8998"\n'
                    f'[[decode]]\nurl = "{back.dec.url}"\n')
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    log = tmp_path / "router.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ark", "serve-pd", "--config", str(conf), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit)
    held: list[socket.socket] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while _honest(port, 1.0)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
        for k in range(slow + idle):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if k < slow:
                s.sendall(header)
            held.append(s)
        threading.Thread(target=_trickle, args=(held[:slow], stop), daemon=True).start()
        # Under them, not while the router is still taking them in: wait until it holds them.
        settle = time.monotonic() + 30
        while not nofile and _open_connections(port) < slow + idle and time.monotonic() < settle:
            time.sleep(0.1)  # (beyond its cap, with nofile, it never will)
        answers = []
        t_end = time.monotonic() + hold_s
        while time.monotonic() < t_end:
            answers.append(_honest(port))
            time.sleep(0.05)
        return answers, proc.pid, log.read_text()
    finally:
        stop.set()
        for s in held:
            s.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        back.close()


def _check_siege(answers: list[tuple[int, float]], text: str, what: str) -> float:
    times = sorted(t for _s, t in answers)
    worst = times[-1]
    print(f"{what}: {len(answers)} honest requests, statuses {sorted({s for s, _ in answers})}, median "
          f"{times[len(times) // 2] * 1000:.0f} ms, worst {worst * 1000:.0f} ms, log {len(text)} bytes")
    assert answers and all(s == 200 for s, _ in answers), answers
    assert worst < 1.0, worst
    assert "Traceback" not in text and len(text) < 4096, text[:2000]
    return worst


def test_honest_requests_are_answered_within_1_s_under_256_slow_bodies_and_1000_idle_connections(
        tmp_path: Path) -> None:
    answers, _pid, text = _siege(tmp_path, slow=256, idle=1000, hold_s=5.0)
    _check_siege(answers, text, "256 slow + 1000 idle")


def test_under_a_small_descriptor_limit_the_cap_refuses_and_the_log_stays_bounded(tmp_path: Path) -> None:
    # 256 descriptors, 16 in flight (32 upstream): the cap is what is left, and 600 idle
    # connections are more. Beyond the cap each is a canned 503; accept() never fails; the
    # header timeout frees the cap, and honest requests are served again.
    answers, _pid, text = _siege(tmp_path, slow=0, idle=600, hold_s=3.0, nofile=256, max_in_flight=16,
                                 header_timeout_s=1.0, log_every_s=10.0)
    assert {s for s, _ in answers} <= {200, 503, 0} and all(t < 1.0 for s, t in answers if s), answers
    assert answers[-1][0] == 200, answers[-5:]
    assert "Traceback" not in text and "accept failed" not in text and len(text) < 4096, text[:2000]
    assert "connection refused" in text


def test_accept_out_of_descriptors_is_counted_and_logged_once_then_resumes(caplog: pytest.LogCaptureFixture) -> None:
    # Another part of the process has taken every descriptor: accept() fails with EMFILE.
    # The listener pauses and retries; the log gets one line, not one traceback per try.
    pre, dec = [StandIn("p0")], [StandIn("d0")]
    clients = ("import socket, sys, time\ntime.sleep(0.5)\n"
               "s = [socket.create_connection(('127.0.0.1', int(sys.argv[1]))) for _ in range(20)]\ntime.sleep(2.5)\n")

    async def test(url: str, router: Router) -> None:
        port = url.rsplit(":", 1)[1]
        child = subprocess.Popen([sys.executable, "-c", clients, port])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        try:
            await asyncio.sleep(2.0)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert router.counters.accept_errors >= 2  # it kept retrying ...
        await asyncio.sleep(0.5)
        assert router.counters.connections >= 1  # ... and took the waiting ones once it could
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
        await asyncio.get_running_loop().run_in_executor(None, child.wait, 10)

    with caplog.at_level(logging.WARNING, logger="ark.pdrouter"):
        asyncio.run(_with_router({"prefill": pre, "decode": dec}, test))
    lines = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(lines) == 1 and "EMFILE" in lines[0] and not any(r.exc_info for r in caplog.records), lines


def test_a_long_key_around_a_wide_list_names_its_non_finite_field_in_little_memory() -> None:
    key = "k" * 20_000
    raw = ('{"' + key + '": [' + "0," * 20_000 + "NaN]}").encode()
    tracemalloc.start()
    with pytest.raises(Refusal) as caught:
        check_body(raw, 1 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 1e6:.1f} MB"  # the parsed body itself is about 0.3 MB
    refusal = caught.value
    message = str(refusal)
    assert refusal.status == 400 and message == f"{key[:PATH_CHARS]}: not a finite number (NaN and Infinity are refused)"
    assert error_response(400, message).body.count(b"\n") == 0
    # Deep under a cut path, the path stays cut; a short path is named in full.
    assert non_finite_field({key: [{"a": [float("nan")]}]}) == key[:PATH_CHARS]
    assert non_finite_field({"a": [1, {"b": [2, float("inf")]}]}) == "a[1].b[1]"
    assert non_finite_field([1] * 10 + [float("nan")], budget=5) == ""
    assert non_finite_field({"a": [1, 2]}) is None and non_finite_field(float("nan")) == "body"


def test_bodies_being_read_share_one_byte_budget_and_beyond_it_is_a_503() -> None:
    pre, dec = [StandIn("p0")], [StandIn("d0")]

    async def test(url: str, router: Router) -> None:
        assert router.body_budget == 1024  # max_in_flight x max_body_bytes
        host, port = url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b" " * 900)
        await writer.drain()
        await asyncio.sleep(0.3)  # 900 bytes of the budget taken, 124 left
        assert router._reading == 900
        small = json.dumps({"prompt": "x" * 150, "max_tokens": 1}).encode()
        answer = await _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(small) + small, timeout_s=3.0)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert "bytes of request bodies being read" in _one_json_line(answer)["error"]["message"]
        assert router.counters.body_budget_refused == 1 and router._reading == 900
        writer.close()  # the trickler goes: its bytes come back to the budget
        await asyncio.sleep(0.3)
        assert router._reading == 0
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", data=small) as r:
            assert r.status == 200
        assert router._reading == 0 and router.counters.requests == 1

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, max_in_flight=1, max_body_bytes=1024))


class Flood(StandIn):
    """A decode stand-in whose streamed answer never ends (64 KiB chunks until the router
    stops taking them)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"{self.name}-0"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:
                await out.write(b"data: " + b"x" * 65_536 + b"\n\n")
        return out


def test_a_client_that_stops_reading_its_answer_is_cut_off_and_frees_its_slot() -> None:
    pre, dec = [StandIn("p0")], [Flood("d0")]

    async def test(url: str, router: Router) -> None:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.setblocking(False)
        _reader, writer = await asyncio.open_connection(sock=sock)
        req = json.dumps({"prompt": "x", "max_tokens": 10, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(req) + req)
        await asyncio.sleep(0.3)  # it holds the one slot and reads nothing
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 503
            t0 = asyncio.get_running_loop().time()
            while router.counters.write_timeouts == 0 and asyncio.get_running_loop().time() - t0 < 5.0:
                await asyncio.sleep(0.1)
            waited = asyncio.get_running_loop().time() - t0
            assert router.counters.write_timeouts == 1 and waited < 3.0, waited
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 200  # the slot is free again
        writer.close()

    asyncio.run(_with_router({"prefill": pre, "decode": dec}, test, max_in_flight=1, body_timeout_s=1.0))
