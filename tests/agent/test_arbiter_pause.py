"""A stopped primary (SIGSTOP) with real ``ark arbiter`` processes on loopback: while it is
stopped the standby leads and a real agent reserves there; a host that has not heard the
new epoch asks the primary during the stop and again right after it resumes. The primary's
lease ran out while it was stopped: it answers nothing until it has heard its peer, and no
link ever has two exclusive holders."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ark.agent.client import ArkClient
from ark.agent.cluster import load as load_cluster
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core import arbiter_wire as w
from tests.agent.test_arbiter_process import _Host, _until

TAKEOVER_S = 0.5


def _answers(host: _Host, rank: int, rids: set[int], timeout_s: float) -> dict[int, w.ToHost]:
    """The answers ``host`` gets from arbiter ``rank`` to the requests ``rids`` already sent."""
    got: dict[int, w.ToHost] = {}
    s, end = host.socks[rank], time.monotonic() + timeout_s
    while got.keys() != rids and s.poll(max(0, int((end - time.monotonic()) * 1000))):
        reply = w.decode_to_host(s.recv())
        if reply.rid in rids:
            got[reply.rid] = reply
    return got


def _leader(host: _Host) -> tuple[int, w.Pong] | None:
    """The arbiter that answers a ping, and its answer."""
    for rank in range(len(host.socks)):
        r = host.call(rank, w.Ping(1 + rank, 0), 0.5)
        if isinstance(r, w.Pong):
            return rank, r
    return None


def _exit_counters(log: Path) -> dict[str, Any]:
    """The counters in an arbiter's exit record (its last ``arbiter_stopped`` line)."""
    found: dict[str, Any] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "arbiter_stopped" in line:
            try:
                found = json.loads(line).get("counters", {})
            except ValueError:
                continue
    return found


def pause_trial(wd: Path, pause_s: float) -> dict[str, Any]:
    """One trial: the primary stopped ``pause_s`` seconds; the grants every host got."""
    cf, names = write_cluster(wd, 4, arbiters=2, takeover_s=TAKEOVER_S, lease_min_s=20.0, control="arbiter")
    agent_name, other = names[0], names[2]  # leaf-mates (names alternate leaves): one uplink per spine
    cl = load_cluster(cf)
    dst_agent, dst_other = names[1], cl.host(names[3]).index
    procs = AgentProcs(cf, [agent_name], wd)
    for n in ("arb0", "arb1", agent_name):
        procs.start(n)
    host = _Host(cf, other)
    primary = None
    try:
        procs.wait_ready([agent_name])
        pong = _until(lambda: _leader(host), 10.0)  # at a cold start the first rank started may win the race
        assert pong, pong
        lead, epoch = pong[0], pong[1].epoch
        primary = procs.procs[f"arb{lead}"]
        time.sleep(2 * TAKEOVER_S)  # the standby follows; its acknowledgements keep the primary's lease
        primary.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        host.socks[lead].send(w.encode(w.Ask(2, epoch, dst_other, 10**9, 4791)))  # waits at the stopped primary
        with ArkClient(procs.api(agent_name), timeout_s=5.0) as agent:
            held = _until(lambda: (le := agent.reserve(dst_agent, 10**9)).reserved and le, pause_s - 0.1)
            time.sleep(max(0.0, t_stop + pause_s - time.monotonic()))
            primary.send_signal(signal.SIGCONT)
            host.socks[lead].send(w.encode(w.Ask(3, epoch, dst_other, 10**9, 4791)))  # still the old epoch
            answers = _answers(host, lead, {2, 3}, 2.0)
            if not held:  # a short stop: the standby may lead only after it
                held = _until(lambda: (le := agent.reserve(dst_agent, 10**9)).reserved and le, 10.0)
            agent_epoch = agent.status()["arbiter"]["epoch"]
        assert held and held.reserved, held
        grants = [("agent", agent_epoch, held.path)]
        grants += [("host", a.epoch, p.path) for a in answers.values() if isinstance(a, w.Grant)
                   for p in a.parts if p.reserved and not p.shared]
        # Both senders are on one leaf, both destinations on the other: one path, one uplink.
        doubles = sum(1 for i, g in enumerate(grants) for h in grants[i + 1:] if g[2] == h[2])
        return {"pause_s": round(pause_s, 2), "double_holders": doubles, "grants": grants, "primary_rank": lead,
                "old_epoch": epoch, "answers": sorted((rid, type(a).__name__, getattr(a, "why", ""))
                                                      for rid, a in answers.items())}
    finally:
        if primary is not None:
            primary.send_signal(signal.SIGCONT)
        host.close()
        procs.stop_all()


def _trials(tmp_path: Path, pauses: list[float]) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(pauses):
        wd = tmp_path / f"trial{i}"
        wd.mkdir()
        r = pause_trial(wd, p)
        log = wd / f"arb{r['primary_rank']}.log"
        r["primary"] = {k: v for k, v in _exit_counters(log).items() if k in ("no_lease", "paused", "granted", "refused")}
        out.append(r)
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["double_holders"] == 0, r
        assert all(e > r["old_epoch"] for _, e, _ in r["grants"]), r  # nothing granted under the old epoch
        assert r["primary"].get("paused", 0) >= 1, r  # it saw that it had been stopped


def test_a_stopped_primary_answers_nothing_from_its_stale_table(tmp_path: Path) -> None:
    _check(_trials(tmp_path, [1.0, 2.5]))


@pytest.mark.slow
def test_twenty_stops_of_one_to_ten_seconds_leave_no_link_with_two_holders(tmp_path: Path) -> None:
    rng = random.Random(31)
    results = _trials(tmp_path, [rng.uniform(1.0, 10.0) for _ in range(20)])
    print(json.dumps([{k: r[k] for k in ("pause_s", "double_holders", "grants", "answers", "primary")}
                      for r in results]))
    _check(results)
