"""vLLM's NixlConnector (CPU KV cache, NIXL over UCX TCP) between two namespace hosts: one
request through a prefill and a decode instance, the decode process steered by the connect()
interposer's process-wide rule, the KV bytes checked at the spines and the answer against a
single instance's. Root, the vllm extra and NIXL in its environment (scripts/install-vllm.sh,
then scripts/install-nixl.sh .venv-vllm); run with -m vllm."""

from __future__ import annotations

import pytest

from ark.integrations.preload import EnvRule
from ark.testbed import fabric as tbm
from ark.testbed import netns
from tests.testbed.test_nixl_testbed import ECMP, LISTENS, PROBED, ephemeral, plan, steer_env

pytestmark = [pytest.mark.vllm, pytest.mark.root,
              pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    pytest.importorskip("nixl._api", reason="nixl is not installed (scripts/install-nixl.sh .venv-vllm)")
    base = str(tmp_path_factory.mktemp("tbv"))
    tbm.down("arkv", base)
    st = tbm.up(tbm.TestbedSpec(leaves=2, spines=4, gpus_per_leaf=1, prefix="arkv"), base)
    yield st
    tbm.down("arkv", base)


def test_vllm_nixl_pull_crosses_the_spine_the_decode_rule_names_and_answers_as_one_instance(bed, tmp_path):
    from ark.integrations.vllm_model import make_model
    from ark.testbed.nixl import free_listen_port, reply_paths
    from ark.testbed.vllm_nixl import one_request, start

    st, prefill, decode = bed, 0, 1
    listen = free_listen_port(st, (prefill, decode), LISTENS)
    window, target, ports = plan(reply_paths(st, prefill, decode, listen, PROBED),
                                 reply_paths(st, prefill, decode, listen, ECMP))
    model = make_model(tmp_path / "model")
    rule = EnvRule(st.layout.host_ip(prefill), (tuple(ports),), listen)
    procs = []
    try:
        procs.append(start(st, prefill, model, tmp_path, listen))
        procs.append(start(st, decode, model, tmp_path, listen, steer_env(rule, tmp_path / "steer.log")))
        # The decode connects to the prefill at the first request: from then on its kernel's own
        # ports all miss the target spine (not before: vLLM's startup needs more than four).
        with ephemeral(st, decode, window):
            res = one_request(st, prefill, decode, "The quick brown fox " * 40)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    assert res.text == res.reference and res.kv_params.get("transfer_mode", "pull") == "pull"
    kv = {key: per for key, per in res.connections.items() if key[0] == listen}  # from the prefill's listener
    assert len(kv) == 1, res.connections
    ((_, dport), per), = kv.items()
    assert dport in ports and set(per) == {target}
    assert sum(per.values()) >= 160 * 16 * 1024  # the prompt's KV cache: ~160 tokens of 16 KiB
    assert (tmp_path / "steer.log").read_text().split("\n")[0] == f"{st.layout.host_ip(prefill)} {listen} {dport} 0 1"
