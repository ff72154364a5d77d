"""vLLM prefill/decode on loopback with ARK's connector: real vLLM (CPU build), real Mooncake
engines, real agents, the router, and every KV push steered onto its leased path.

Heavy (two vLLM instances, about a minute to start on two cores): marked ``vllm`` and run in
CI's slow stage with the vllm extra installed; skipped without it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="the vllm extra is not installed")
pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")

from ark.agent import cluster as clmod  # noqa: E402
from ark.agent.loopback import AgentProcs, write_cluster  # noqa: E402
from ark.integrations import preload  # noqa: E402
from ark.integrations.vllm_model import ModelShape, make_model, prompt  # noqa: E402

P_IP, D_IP = "127.0.0.1", "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env(host_ip: str, bootstrap_port: int) -> dict[str, str]:
    env = preload.preload_env()
    env.update(VLLM_HOST_IP=host_ip, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bootstrap_port), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def start_vllm(model: Path, port: int, kv: dict[str, Any] | None, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "0.0.0.0",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--enforce-eager", "--served-model-name", "tiny"]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_up(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM on {port} died:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise AssertionError(f"vLLM on {port} did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[dict[str, Any]]:
    wd = tmp_path_factory.mktemp("vllm")
    model = make_model(wd / "model")
    (wd / "api").mkdir()
    cfile, names = write_cluster(wd, 2, lease_min_s=1.0, heartbeat_s=0.1)
    agents = AgentProcs(cfile, names, wd)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n in names:
            agents.start(n)
        agents.wait_ready(names)
        boot, pp, dp = _free_port(), _free_port(), _free_port()
        log = wd / "transfers.jsonl"
        common = {"kv_connector": "ArkMooncakeConnector", "kv_connector_module_path": "ark.integrations.vllm"}
        pre_kv = {**common, "kv_role": "kv_producer", "engine_id": "prefill0", "kv_connector_extra_config": {
            "mooncake_protocol": "tcp", "ark_cluster": str(cfile), "ark_host": names[0], "ark_parts": 2,
            "ark_hosts": {D_IP: names[1]}, "ark_transfer_log": str(log)}}
        dec_kv = {**common, "kv_role": "kv_consumer", "engine_id": "decode0",
                  "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        p = start_vllm(model, pp, pre_kv, vllm_env(P_IP, boot), wd / "prefill.log")
        procs.append(p)
        wait_up(pp, p, wd / "prefill.log")
        d = start_vllm(model, dp, dec_kv, vllm_env(D_IP, boot), wd / "decode.log")
        procs.append(d)
        wait_up(dp, d, wd / "decode.log")
        yield {"wd": wd, "cluster": clmod.load(cfile), "names": names, "agents": agents, "log": log,
               "prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
               "bootstrap": f"http://{P_IP}:{boot}"}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        agents.stop_all()


def test_pd_through_the_router_matches_one_instance_and_every_push_is_steered(pd) -> None:
    import asyncio

    import aiohttp

    from ark.integrations.pdrouter import Router, load_config

    shape = ModelShape()
    prompts = [prompt(n, seed) for seed, n in enumerate((120, 400, 700))]
    cfg = load_config({"prefill": [{"url": pd["prefill"], "engine_id": "prefill0", "bootstrap": pd["bootstrap"]}],
                       "decode": [{"url": pd["decode"]}]})

    async def through_router() -> list[str]:
        router = Router(cfg)
        host, port = await router.start("127.0.0.1", 0)
        url = f"http://{host}:{port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:
                texts = []
                for text in prompts:
                    async with s.post(url, json={"model": "tiny", "prompt": text, "max_tokens": 8,
                                                 "temperature": 0}) as r:
                        assert r.status == 200, await r.text()
                        texts.append((await r.json())["choices"][0]["text"])
                return texts
        finally:
            await router.stop()

    pd_texts = asyncio.run(through_router())
    # The same prompts on one instance (the prefill one, computing everything itself).
    ref = [post(pd["prefill"] + "/v1/completions", {"model": "tiny", "prompt": t, "max_tokens": 8,
                                                    "temperature": 0})["choices"][0]["text"] for t in prompts]
    assert pd_texts == ref and all(len(t.split()) == 8 for t in ref)
    time.sleep(0.5)
    pushes = [json.loads(line) for line in pd["log"].read_text().splitlines()]
    assert len(pushes) >= len(prompts)
    cl, names = pd["cluster"], pd["names"]
    for push in pushes:
        assert push["error"] is None and push["dst"] == names[1] and push["bytes"] > 0
        assert len(push["leases"]) == 2 and all(le["reserved"] for le in push["leases"])
        paths = [le["path"] for le in push["leases"]]
        assert len(set(paths)) == 2
        pm = cl.pathmaps()(cl.host(names[0]).index, cl.host(names[1]).index, push["connections"][0]["dport"])
        for c in push["connections"]:  # each connection on a port of its part's path
            assert c["steered"] and c["part"] in (0, 1) and pm.path_of(c["sport"]) == paths[c["part"]]
    # The KV bytes of each request: its prompt's tokens x the model's KV bytes per token, in blocks.
    total = sum(p["bytes"] for p in pushes)
    assert total >= sum(len(t.split()) for t in prompts) * shape.kv_bytes_per_token * 0.9
