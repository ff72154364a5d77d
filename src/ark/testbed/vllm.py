"""vLLM prefill/decode on the namespace testbed (``ark testbed run --engine vllm``).

A *fleet* of vLLM instances starts once per invocation: prefill instances in hosts of the
first leaf, decode instances in hosts of the last, each under the ``connect()``
interposer with :class:`ark.integrations.vllm.ArkMooncakeConnector` (the prefill side's
pushes steered; its mode file says how), ``VLLM_HOST_IP`` its data address, and the decode
side's Mooncake ports drawn from two ports that the agents probe. Every (seed, scheme) run
then reuses it: the mode file switches the prefill instances between ``ecmp`` (observe
only), ``ark`` (a single-path lease per push) and ``ark-split`` (a multi-path lease).

One run: the seed's hash keys, probes, agents; the testbed's own senders move background KV
flows (the seeded workload minus the fleet's hosts) under the same scheme, so uplinks and
spines are contended; a client (in a prefill host, over the management network) sends the
seeded requests through the P/D router (:mod:`ark.integrations.pdrouter`) at their times
and measures, as a user would, time to first token and time per output token of each
streamed answer. After the
requests, each prompt is sent once more to a prefill instance alone (greedy): its answer
must equal the P/D answer. The prefill instances' transfer logs give every push, which the
spine counters then check against the lease's paths.

``python -m ark.testbed.vllm client PLAN OUT`` is that client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError, spawn_in_host

if TYPE_CHECKING:
    import subprocess

HTTP_PORT = 8100  # each instance's OpenAI server (inside its host namespace)
BOOTSTRAP_PORT = 8998  # the prefill side's Mooncake bootstrap server
RPC_PORTS = (15100, 15101)  # the decode side's Mooncake handshake and data ports (both probed)
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0
# Ports probed from each prefill host to each decode host: a push opens one connection per
# contiguous block range (4 to 44 seen here), each stays in TIME_WAIT for a minute, and a
# flow may take at most 64 extra ports and 1/8 of its path's, so a path needs about 500.
FLEET_SAMPLE = 4096
START_TIMEOUT_S = 600.0  # instances start one after another on a busy 2-core machine


class Request(msgspec.Struct):
    id: int
    start_s: float
    prompt: str
    tokens: int


class ClientPlan(msgspec.Struct):
    """What the client process sends, and where."""

    router: dict[str, Any]  # RouterConfig as plain data
    prefill_urls: list[str]
    requests: list[Request]
    t0: float
    max_tokens: int = MAX_TOKENS


def requests_for(seed: int, n: int, window_s: float, tokens: tuple[int, int] = (200, 1000)) -> list[Request]:
    """``n`` requests with seeded prompt lengths, Poisson-spaced over ``window_s``."""
    from ark.integrations.vllm_model import prompt

    rng = random.Random(f"ark-vllm-requests-{seed}")
    t, out = 0.0, []
    for i in range(n):
        k = rng.randint(*tokens)
        out.append(Request(i, round(t, 4), prompt(k, seed * 100_003 + i), k))
        t += rng.expovariate(n / window_s)
    return out


class Fleet:
    """The vLLM instances of an invocation: started once, stopped at the end."""

    def __init__(self, st: State, model: Path, prefill: Sequence[int], decode: Sequence[int], cluster: Path,
                 work: Path, poll_s: float = 0.0) -> None:
        self.st, self.model, self.prefill, self.decode = st, model, list(prefill), list(decode)
        self.cluster, self.work, self.poll_s = cluster, work, poll_s
        self.mode_file = work / "mode.json"
        self.procs: list[subprocess.Popen[bytes]] = []
        work.mkdir(parents=True, exist_ok=True)

    def log_of(self, host: int) -> Path:
        return self.work / f"transfers-gpu{host}.jsonl"

    def set_mode(self, scheme: str, parts: int) -> None:
        mode = {"steer": scheme != "ecmp", "parts": parts if scheme == "ark-split" else None}
        tmp = self.mode_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(mode))
        os.replace(tmp, self.mode_file)

    def _env(self, host: int) -> dict[str, str]:
        from ark.integrations.preload import preload_env

        env = preload_env()
        env.update(VLLM_HOST_IP=self.st.layout.host_ip(host), VLLM_MOONCAKE_BOOTSTRAP_PORT=str(BOOTSTRAP_PORT),
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   MC_TCP_ENABLE_CONNECTION_POOL="0",
                   MC_MIN_RPC_PORT=str(RPC_PORTS[0]), MC_MAX_RPC_PORT=str(RPC_PORTS[1]))
        return env

    def _kv_config(self, host: int, producer: bool) -> dict[str, Any]:
        cfg: dict[str, Any] = {"kv_connector": "ArkMooncakeConnector", "kv_connector_module_path": "ark.integrations.vllm",
                               "kv_role": "kv_producer" if producer else "kv_consumer",
                               "engine_id": f"{'prefill' if producer else 'decode'}-gpu{host}"}
        extra: dict[str, Any] = {"mooncake_protocol": "tcp"}
        if producer:
            extra.update(ark_cluster=str(self.cluster), ark_host=f"gpu{host}", ark_mode_file=str(self.mode_file),
                         ark_transfer_log=str(self.log_of(host)), ark_poll_s=self.poll_s)
        cfg["kv_connector_extra_config"] = extra
        return cfg

    def start(self, progress: Any) -> None:
        """Start every instance, one at a time (each loads the model and warms up)."""
        self.set_mode("ecmp", 0)
        for host in [*self.prefill, *self.decode]:
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                    "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--dtype", "float32", "--max-model-len", "2048",
                    "--max-num-seqs", "8", "--enforce-eager", "--served-model-name", "tiny",
                    # Every scheme of a seed sends the same prompts: a cached prefix would spare
                    # the later schemes' prefill, and a decode instance holding it would pull nothing.
                    "--no-enable-prefix-caching",
                    "--kv-transfer-config", json.dumps(self._kv_config(host, host in self.prefill))]
            t = time.monotonic()
            self.procs.append(spawn_in_host(self.st, host, argv, self.work / f"vllm-gpu{host}.log", self._env(host)))
            self._wait_up(host, self.procs[-1])
            progress(f"vLLM {'prefill' if host in self.prefill else 'decode'} gpu{host} up in {time.monotonic() - t:.0f} s")

    def _wait_up(self, host: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise TestbedError(f"vLLM in gpu{host} exited; see {self.work}/vllm-gpu{host}.log")
            try:
                with netns.inside(self.st.layout.host_ns(host)):
                    urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/v1/models", timeout=2).close()
                return
            except OSError:
                time.sleep(1.0)
        raise TestbedError(f"vLLM in gpu{host} not up after {START_TIMEOUT_S:.0f} s; see {self.work}/vllm-gpu{host}.log")

    def stop(self) -> None:
        from ark.testbed.run import _stop

        _stop(self.procs)
        self.procs.clear()

    def router_config(self) -> dict[str, Any]:
        lay = self.st.layout
        return {"mode": "sequential",
                "prefill": [{"url": f"http://{lay.mgmt_ip(h)}:{HTTP_PORT}", "engine_id": f"prefill-gpu{h}",
                             "bootstrap": f"http://{lay.host_ip(h)}:{BOOTSTRAP_PORT}"} for h in self.prefill],
                "decode": [{"url": f"http://{lay.mgmt_ip(h)}:{HTTP_PORT}"} for h in self.decode]}

    def pushes(self, t0: float, t1: float) -> list[dict[str, Any]]:
        """The prefill instances' pushes that started between ``t0`` and ``t1`` (wall time)."""
        out = []
        for h in self.prefill:
            f = self.log_of(h)
            if f.exists():
                for line in f.read_text().splitlines():
                    rec = json.loads(line)
                    if t0 <= rec["t0"] <= t1:
                        out.append({**rec, "src": h})
        return sorted(out, key=lambda r: r["t0"])


# ---------------------------------------------------------------------------- the client
async def _one(session: Any, url: str, req: Request, t0: float, max_tokens: int) -> dict[str, Any]:
    """One streamed request through the router, at its time: TTFT, TPOT and its text."""
    planned = t0 + req.start_s
    await asyncio.sleep(max(0.0, planned - time.time()))
    sent = time.time()
    body = {"model": "tiny", "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps, text, err = [], [], None
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                err = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "choices" not in chunk:  # the server failed mid-answer (a KV load that failed)
                        err = str(chunk.get("error", chunk))[:200]
                        break
                    piece = chunk["choices"][0].get("text", "")
                    if piece:
                        stamps.append(time.time())
                        text.append(piece)
    except Exception as e:  # a failed request is its record's
        err = f"{type(e).__name__}: {e}"
    rec: dict[str, Any] = {"id": req.id, "tokens": req.tokens, "start_s": req.start_s, "late_s": sent - planned,
                           "error": err, "text": "".join(text), "chunks": len(stamps)}
    if stamps:
        rec["ttft_s"] = stamps[0] - sent
        rec["e2e_s"] = stamps[-1] - sent
        rec["tpot_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return rec


async def _reference(session: Any, url: str, req: Request, max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return str((await r.json())["choices"][0]["text"])


async def client(plan: ClientPlan) -> dict[str, Any]:
    import aiohttp
    from aiohttp import web

    from ark.integrations.pdrouter import Router, load_config

    runner = web.AppRunner(Router(load_config(plan.router)).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
    try:
        # A request whose KV never arrives fails at the decode side only after minutes (its
        # connector's abort timeout): two minutes is already a failure here.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as s:
            recs = await asyncio.gather(*(_one(s, url, r, plan.t0, plan.max_tokens) for r in plan.requests))
            t_end = time.time()
            # The same prompts on one instance alone, after the measured window.
            for r, req in zip(recs, plan.requests, strict=True):
                ref = await _reference(s, plan.prefill_urls[req.id % len(plan.prefill_urls)], req, plan.max_tokens)
                r["reference"] = ref
                r["match"] = r["error"] is None and r["text"] == ref
    finally:
        await runner.cleanup()
    return {"requests": recs, "t_end": t_end}


def summarize_requests(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT and TPOT mean/P50/P95 (s) over the requests that answered, and the mismatches."""
    out: dict[str, Any] = {"vllm_requests": len(recs), "vllm_errors": sum(1 for r in recs if r["error"]),
                           "output_mismatches": sum(1 for r in recs if not r["match"]),
                           "mismatched_ids": [r["id"] for r in recs if not r["match"]]}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        vals = np.asarray([r[key] for r in recs if r.get(key) is not None])
        name = key[:-2]
        out.update({f"{name}_mean_s": float(vals.mean()) if len(vals) else float("nan"),
                    f"{name}_p50_s": float(np.percentile(vals, 50)) if len(vals) else float("nan"),
                    f"{name}_p95_s": float(np.percentile(vals, 95)) if len(vals) else float("nan")})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.testbed.vllm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("client")
    c.add_argument("plan")
    c.add_argument("out")
    a = ap.parse_args(argv)
    plan = msgspec.json.decode(Path(a.plan).read_bytes(), type=ClientPlan)
    res = asyncio.run(client(plan))
    Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------- one run
def run(st: State, params: Any, fleet: Fleet, n_requests: int, progress: Any) -> dict[str, Any]:
    """One (seed, scheme) with the fleet up: background flows, the client's requests through
    the router, spine counters over both; the record of the run."""
    from ark.testbed.capture import counting
    from ark.testbed.fabric import rekey
    from ark.testbed.plan import cluster_file, cross_leaf_pairs, plan_flows
    from ark.testbed.probing import probe_or_check
    from ark.testbed.run import CpuMeter, TestbedRun, _record, _stop

    flows, load = plan_flows(st, params.requests, params.qps, params.seed)
    busy = {*fleet.prefill, *fleet.decode}
    background = [f for f in flows if f.src not in busy and f.dst not in busy]
    cluster = cluster_file(st, params.scheme if params.scheme != "ecmp" else "ark", params.lease_min_s, params.sample, 0.0)
    keys, rekeyed = rekey(st, params.seed)
    probe_info = probe_or_check(st, cross_leaf_pairs(st, background), params.sample, cluster, True, progress)
    fleet_pairs = {p: set(fleet.decode) for p in fleet.prefill}
    fleet_probe = probe_or_check(st, fleet_pairs, FLEET_SAMPLE, cluster, True, progress, list(RPC_PORTS))
    tr = TestbedRun(st, params, background, progress)
    window = max((f.start_s for f in background), default=10.0)
    reqs = requests_for(params.seed, n_requests, window)
    try:
        receivers = tr.start_receivers()
        tr.start_agents(cluster)
        tr.wait_receivers(receivers)
        fleet.set_mode(params.scheme, params.parts)
        t0 = time.time() + 1.5
        lay = st.layout
        plan = ClientPlan(router=fleet.router_config(), requests=reqs, t0=t0,
                          prefill_urls=[f"http://{lay.mgmt_ip(h)}:{HTTP_PORT}" for h in fleet.prefill])
        (tr.work / "client-plan.json").write_bytes(msgspec.json.encode(plan))
        cpu = CpuMeter()
        with counting(st) as counters:
            sprocs = tr.start_senders(t0)
            # In a prefill host, talking to every instance over the management network (the
            # router's HTTP never crosses the data fabric).
            cp = spawn_in_host(st, fleet.prefill[0], [sys.executable, "-m", "ark.testbed.vllm", "client",
                                                      str(tr.work / "client-plan.json"), str(tr.work / "client.json")],
                               tr.work / "client.log")
            tr.procs.append(cp)
            tr.wait_senders(sprocs, t0)
            cp.wait(max(60.0, window + 600.0))
            busy_frac = cpu.busy()
    finally:
        _stop(tr.procs)
    if not (tr.work / "client.json").exists():
        raise TestbedError(f"vLLM client wrote no results; see {tr.work}/client.log")
    res = json.loads((tr.work / "client.json").read_text())
    rec = _record(st, params, background, tr.results(), counters, probe_info, load, {})
    rec.update(engine="vllm", hash_keys=keys, cpu_busy_fraction=round(busy_frac, 4), rekeyed=rekeyed,
               fleet_probe_agreement_fraction=fleet_probe["probe_agreement_fraction"],
               background_flows=len(background), **summarize_requests(res["requests"]))
    rec["vllm"] = res["requests"]
    rec.update(push_summary(st, fleet.pushes(t0 - 1.0, res["t_end"]), counters))
    return rec


def push_summary(st: State, pushes: list[dict[str, Any]], counters: Any) -> dict[str, Any]:
    """Each push's switches from the spine counters, and whether a steered push's bytes all
    crossed the paths its lease named."""
    from ark.testbed.run import _expected, _top

    lay = st.layout
    ips = {lay.host_ip(i): i for i in range(st.spec.leaves * st.spec.gpus_per_leaf)}
    checked = []
    for p in pushes:
        dst_ip = p["target"].split(":")[0]
        src, dst = p["src"], ips.get(dst_ip)
        conns = []
        for c in p["connections"]:
            crossed = counters.spines_of((lay.host_ip(src), c["sport"], dst_ip, c["dport"]), p["t0"], p["t1"])
            conns.append({**c, "spine_bytes": {str(k): v for k, v in sorted(crossed.items())},
                          "spine": _top(st, crossed)})
        p["connections"] = conns
        steered = bool(conns) and all(c["steered"] for c in conns)
        if steered and dst is not None and p["leases"] and not p["ecmp"]:
            p["path_match"] = all(not c["spine_bytes"] or set(c["spine_bytes"]) ==
                                  {str(x) for x in _expected(st, src, dst, c["path"])} for c in conns) \
                and any(c["spine_bytes"] for c in conns)
            checked.append(p["path_match"])
    secs = np.asarray([p["t1"] - p["t0"] for p in pushes]) if pushes else np.asarray([])
    return {"pushes": pushes, "push_count": len(pushes), "push_bytes": sum(p["bytes"] for p in pushes),
            "push_mean_s": float(secs.mean()) if len(secs) else float("nan"),
            "push_p95_s": float(np.percentile(secs, 95)) if len(secs) else float("nan"),
            "push_path_checked": len(checked),
            "push_path_match_fraction": sum(checked) / len(checked) if checked else None}


def fleet_hosts(st: State, per_side: int) -> tuple[list[int], list[int]]:
    """Prefill hosts on the first leaf, decode hosts on the last (other pod on 3 tiers)."""
    g = st.spec.gpus_per_leaf
    if per_side > g:
        raise TestbedError(f"vllm: at most {g} instances per side (hosts on a leaf); got {per_side}")
    last = (st.spec.leaves - 1) * g
    return list(range(per_side)), list(range(last, last + per_side))
