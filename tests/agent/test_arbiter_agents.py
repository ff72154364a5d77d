"""Agents under ``control = "arbiter"``, real processes on loopback: leases decided by the
arbiter, a killed primary (ECMP meanwhile, then the standby with the held leases
registered), renew and release through it."""

from __future__ import annotations

import time
from pathlib import Path

from ark.agent.client import ArkClient
from ark.agent.cluster import load as load_cluster
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core.arbiter_host import NO_ARBITER
from tests.agent.test_arbiter_process import _until


def test_agents_take_the_arbiters_decisions_and_survive_a_killed_primary(tmp_path: Path) -> None:
    # takeover_s 2: the reserve right after the kill falls inside the window with no leader
    # however slow a loaded machine is (at 0.5 s the standby sometimes led by then).
    cf, names = write_cluster(tmp_path, 4, arbiters=2, takeover_s=2.0, lease_min_s=20.0, control="arbiter")
    procs = AgentProcs(cf, names, tmp_path)
    for n in ("arb0", "arb1", *names):
        procs.start(n)
    try:
        procs.wait_ready(names)
        a, b, c = (ArkClient(procs.api(n), timeout_s=5.0) for n in names[:3])  # names alternate leaves
        first = _until(lambda: (le := a.reserve(names[1], 10**9)).reserved and le, 15.0)  # arb0 leads after 2 s
        assert first and first.reserved
        second = c.reserve(names[1], 10**9)  # another sender on the same leaf: another spine
        assert second.reserved and second.path != first.path
        split = a.reserve_split(names[3], 4 * 10**9, parts=2)
        assert [le.reserved for le in split] == [True, True]
        assert len({first.path, second.path, *(le.path for le in split)}) == 4  # four spines, four holders
        st = a.status()
        assert st["control"] == "arbiter" and st["arbiter"]["up"] and st["peers"] == {}
        assert a.renew(first.flow_id).expires >= first.expires
        a.release_split([le.flow_id for le in split])
        procs.kill("arb0")
        t_kill = time.monotonic()
        fallback = a.reserve(names[3], 10**9)  # waits for a timeout at each arbiter, then plain ECMP
        assert not fallback.reserved and fallback.fallback == NO_ARBITER
        back = _until(lambda: (le := c.reserve(names[3], 10**9)).reserved and le, 15.0)
        window = time.monotonic() - t_kill
        assert back and back.reserved and window < 8.0, (window, c.reserve(names[3], 10**9), c.status()["arbiter"])
        assert _until(lambda: a.status()["arbiter"]["counters"]["registered"] >= 1, 5.0)  # found by its probes
        status = a.status()["arbiter"]
        assert status["leader"] == 1 and status["up"]
        renewed = a.renew(first.flow_id)  # registered with the standby: it renews there, on its path
        assert renewed.reserved and renewed.path == first.path
        cl = load_cluster(cf)
        assert cl.control == "arbiter"
        for client in (a, b, c):
            client.close()
    finally:
        procs.stop_all()


def test_ark_cluster_under_arbiters_kills_the_primary_with_no_double_holder_and_no_leak() -> None:
    from ark.agent.arbiter_run import run_arbiter_cluster

    r = run_arbiter_cluster(4, 400, seed=1, lease_min_s=0.5, takeover_s=0.5)
    assert r["client_errors"] == 0 and r["flows"] >= 400
    assert r["double_holders"] == 0 and r["leaked_at_arbiter"] == 0 and r["leaked_local"] == 0
    assert r["no_arbiter_leases"] > 0 and r["ecmp_window_s"] is not None and r["ecmp_window_s"] < 5.0
    assert r["held_reserved_at_end"] == 4 and r["held_lapsed"] == 0  # registered with the standby, kept
    assert r["arbiter_counters"]["takeovers"] == 1 and r["arbiter_counters"]["registered"] >= 4


def test_double_holders_counts_overlapping_exclusive_leases_on_a_link() -> None:
    from ark.agent.arbiter_run import _Held, double_holders
    from ark.core.topology import preset

    fab = preset("paper")  # hosts 0-7 on leaf 0, 8-15 on leaf 1
    a = _Held(0, 8, 1, 0.0, 1.0)
    after = _Held(1, 9, 1, 1.5, 2.0)  # the same spine, later: fine
    during = _Held(2, 10, 1, 0.5, 0.7)  # the same spine while a holds it
    elsewhere = _Held(3, 11, 2, 0.5, 0.7)
    assert double_holders(fab, [a, after, elsewhere]) == 0
    assert double_holders(fab, [a, after, during, elsewhere]) >= 1
