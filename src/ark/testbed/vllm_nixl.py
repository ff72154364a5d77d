"""vLLM's ``NixlConnector`` between two testbed hosts: a prefill and a decode instance (vLLM's
CPU build, the KV cache in host memory, ``kv_buffer_device = "cpu"``), NIXL over UCX TCP on
the data interface, one request through both as a P/D router sends it, the decode's answer
against the prefill instance's own, and the spines the KV bytes crossed.

The request: the prefill instance gets it with ``max_tokens = 1`` and ``kv_transfer_params =
{"do_remote_decode": true}``; its answer's ``kv_transfer_params`` (the blocks, its engine
id, side-channel address) go with the request to the decode instance, whose connector
fetches the prefill's NIXL metadata over the side channel and pulls the blocks with a READ.
Only the decode side loads the other's metadata, so the KV bytes ride the decode's UCX
connection back (:mod:`ark.testbed.nixl`): the decode process is the one to steer.

vLLM's connector gives NIXL ``num_threads`` 4 by default: five UCX workers, each with its
own listener and its own connection to the peer. Here ``num_threads`` is 0 (one worker,
one listener on ``listen_port``, one connection), so that one rule covers it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError, spawn_in_host
from ark.testbed.nixl import ucx_env

HTTP_PORT = 8100
SIDE_PORT = 5600  # the NIXL side channel (metadata for the decode side)
START_TIMEOUT_S = 600.0


def _env(st: State, host: int, listen_port: int, extra: Mapping[str, str]) -> dict[str, str]:
    ip = st.layout.host_ip(host)
    return {**os.environ, "VLLM_HOST_IP": ip, "VLLM_NIXL_SIDE_CHANNEL_HOST": ip,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **ucx_env(listen_port), **extra}


def _call(st: State, host: int, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300.0) -> Any:
    url = f"http://{st.layout.host_ip(host)}:{HTTP_PORT}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with netns.inside(st.layout.host_ns(host)), urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def start(st: State, host: int, model: Path, work: Path, listen_port: int,
          extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A vLLM instance with the NIXL connector in ``host``, up (its API answers)."""
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
          "kv_connector_extra_config": {"num_threads": 0}}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--enforce-eager", "--served-model-name", "tiny", "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv)]
    log = work / f"vllm-gpu{host}.log"
    proc = spawn_in_host(st, host, argv, log, _env(st, host, listen_port, extra_env or {}))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TestbedError(f"vLLM in gpu{host} exited; see {log}")
        try:
            _call(st, host, "/v1/models", timeout_s=2.0)
            return proc
        except OSError:
            time.sleep(2.0)
    proc.kill()
    raise TestbedError(f"vLLM in gpu{host} not up after {START_TIMEOUT_S:.0f} s; see {log}")


@dataclass
class PdResult:
    """One request through a prefill and a decode instance."""

    text: str  # the decode instance's answer
    reference: str  # the prefill instance's own answer to the same request
    kv_params: dict[str, Any]
    connections: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)  # KV 4-tuples -> spine -> bytes


def one_request(st: State, prefill: int, decode: int, prompt: str, max_tokens: int = 16) -> PdResult:
    """The request as a P/D router sends it (instances already up), counted at the spines."""
    from ark.testbed.capture import counting

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reference = _call(st, prefill, "/v1/completions", body)["choices"][0]["text"]
    with counting(st) as counters:
        pre = _call(st, prefill, "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params":
                                                    {"do_remote_decode": True, "do_remote_prefill": False}})
        params = pre.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise TestbedError("vLLM: the prefill instance returned no kv_transfer_params")
        text = _call(st, decode, "/v1/completions", {**body, "kv_transfer_params": params})["choices"][0]["text"]
        time.sleep(0.3)  # the last packets reach the counters
    res = PdResult(text, reference, params)
    src, dst = st.layout.host_ip(prefill), st.layout.host_ip(decode)
    for k, table in enumerate(counters.bytes):
        for (a, sport, b, dport), ivs in table.items():
            if a == src and b == dst:
                per = res.connections.setdefault((int(sport), int(dport)), {})
                per[k] = per.get(k, 0) + int(sum(iv[2] for iv in ivs))
    return res
