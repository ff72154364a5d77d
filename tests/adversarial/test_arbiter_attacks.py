"""A listed host attacking the arbiter, real processes: it asks for every path, floods, and
replays its requests; an honest agent beside it keeps getting reserved leases."""

from __future__ import annotations

import time
from pathlib import Path

from ark.agent.client import ArkClient
from ark.agent.cluster import load as load_cluster
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core import arbiter_wire as w
from ark.core.arbiter import SEQ_SHIFT
from tests.agent.test_arbiter_process import _Host, _until


def test_a_flooding_greedy_host_is_capped_and_an_honest_agent_still_reserves(tmp_path: Path) -> None:
    # 32 spines: more paths than its cap of 16 live reservations, so the cap is what stops it.
    # 200 requests/s per host: a flood of 3,000 outruns it however slowly this machine serves it.
    # The honest agent waits up to 2 s for its answer, not the default 0.1 s: on two cores the
    # flooder's encryption, the arbiter's decryption of 3,000 messages and the agent share the
    # CPUs, and a CI run once took 0.1 s to answer it (the claim is that it is served, not how
    # fast a starved machine serves it; its latency is in the failure message).
    cf, names = write_cluster(tmp_path, 4, arbiters=1, control="arbiter", max_flows_per_host=16, lease_min_s=30.0,
                              spines=32, arbiter_rate_per_host=200.0, arbiter_timeout_s=2.0)
    cl = load_cluster(cf)
    idx = {n: cl.host(n).index for n in names}  # names alternate leaves: 0 and 2 on one, 1 and 3 on the other
    procs = AgentProcs(cf, [names[3]], tmp_path)
    procs.start("arb0")
    procs.start(names[3])
    hostile = _Host(cf, names[0])  # a listed host's key, driven by hand
    try:
        procs.wait_ready([names[3]])
        assert isinstance(_until(lambda: hostile.call(0, w.Ping(1, 0), 0.5), 10.0), w.Pong)
        sock = hostile.socks[0]
        n = 3000
        t0 = time.monotonic()
        for rid in range(10, 10 + n):  # every path, as fast as it can: 16 parts each
            sock.send(w.encode(w.Ask(rid, 0, idx[names[1]], 10**9, 4791, 16)))
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as victim:
            t_ask = time.monotonic()
            lease = victim.reserve(names[2], 10**9)  # the other direction: links the attacker cannot hold
            latency = time.monotonic() - t_ask
        answers = []
        while len(answers) < n and sock.poll(5000):
            answers.append(w.decode_to_host(sock.recv()))
        flood_s = time.monotonic() - t0
        parts = [p for a in answers if isinstance(a, w.Grant) for p in a.parts]
        assert len(answers) == n and len(parts) == 16 * n
        reserved = [p for p in parts if p.reserved]
        assert len(reserved) == 16  # its cap of live reservations, whatever it asks
        why = {p.why.split(":")[0] for p in parts if not p.reserved}
        assert "rate limited" in why and "cap" in why, why
        assert lease.reserved and latency < 2.0, (lease, latency, flood_s)

        # Replays: a request id among its last 64 gets the kept answer and changes nothing.
        last = answers[-1]
        again = hostile.call(0, w.Ask(10 + n - 1, 0, idx[names[1]], 10**9, 4791, 16))
        assert again == last
        # Registering a flow of the current epoch that was never handed out: refused.
        epoch = last.epoch
        forged = w.Held((idx[names[0]], epoch << SEQ_SHIFT | 999_999), idx[names[1]], 4791, 0, 10**9, False, 10.0)
        reg = hostile.call(0, w.Register(10_000_000, epoch, [forged]))
        assert isinstance(reg, w.Grant) and not reg.parts[0].reserved and reg.parts[0].why == "unknown"
        # Naming the honest agent's flow: counted, nothing happens to it.
        hostile.call(0, w.Drop(10_000_001, epoch, [lease.flow_id]))
        with ArkClient(procs.api(names[3]), timeout_s=5.0) as victim:
            assert victim.renew(lease.flow_id).reserved
    finally:
        hostile.close()
        procs.stop_all()
