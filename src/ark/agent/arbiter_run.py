"""``ark cluster --control arbiter``: real agents asking a primary and a standby arbiter,
any-to-any load, the primary SIGKILLed halfway.

What it reports:

* ``ecmp_window_s``: from the kill to the first lease reserved again, and the leases that
  said "no arbiter answered" meanwhile (``no_arbiter_leases``);
* ``double_holders``: pairs of exclusive leases on one link whose lifetimes overlapped.
  A lease's lifetime is taken from when its reserve returned to when its release was
  called, which lies within the time the arbiters held it (a grant precedes its answer,
  a release follows the call), so every overlap counted is a real one; leases of the
  whole run are checked, across the takeover;
* ``leaked``: reservations the leading arbiter still holds one lease period after every
  lease was released (read from its exit record), and local flows left in the agents.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ark.agent.client import AgentNotReady, ArkClient, ArkClientError, Lease
from ark.agent.cluster import Cluster
from ark.agent.cluster import load as load_cluster
from ark.agent.loopback import HELD_BYTES, AgentProcs, write_cluster
from ark.core.arbiter_host import NO_ARBITER


@dataclass(frozen=True)
class _Held:
    """One lease as a client saw it: from its grant's return to its release call."""

    src: int
    dst: int
    path: int
    granted: float
    released: float


class _ArbiterLoad:
    def __init__(self, procs: AgentProcs, cluster: Cluster, flows: int, workers: int, seed: int) -> None:
        self.procs, self.cluster, self.flows, self.workers, self.seed = procs, cluster, flows, workers, seed
        self.names = procs.names
        self.index = {h.name: h.index for h in cluster.hosts}
        self.leaf = {h.name: cluster.fabric.hosts[h.index].leaf for h in cluster.hosts}
        self.lock = threading.Lock()
        self.done = 0
        self.errors: list[str] = []
        self.leases: list[_Held] = []
        self.fallbacks: list[tuple[float, str]] = []  # (when, why) of every unreserved lease
        self.halfway = threading.Event()
        self.t_kill: float | None = None  # set by whoever kills the primary
        self.again_at: float | None = None  # the first lease reserved after the kill

    def enough(self) -> bool:
        """``flows`` cycles, and a second of leases granted again after the kill (or a
        minute without any)."""
        if self.done < self.flows:
            return False
        if self.t_kill is None:
            return False
        now = time.monotonic()
        again = self.again_at
        return now - self.t_kill > 60 or (again is not None and now - again >= 1.0)

    def remote(self, n: str, r: random.Random) -> str:
        return r.choice([m for m in self.names if self.leaf[m] != self.leaf[n]])

    def worker(self, wi: int) -> None:
        mine = [n for i, n in enumerate(self.names) if i % self.workers == wi]
        clients = {n: ArkClient(self.procs.api(n), timeout_s=10.0) for n in mine}
        r = random.Random(self.seed * 1000 + wi)
        try:
            while True:
                with self.lock:
                    if self.enough():
                        return
                n = r.choice(mine)
                self._cycle(n, clients[n], r)
        finally:
            for c in clients.values():
                c.close()

    def _cycle(self, n: str, c: ArkClient, r: random.Random) -> None:
        dst = self.remote(n, r)
        try:
            lease = c.reserve(dst, r.randint(10**6, 10**9), wait_ready_s=30)
            granted = time.monotonic()
            time.sleep(r.uniform(0, 0.004))  # the transfer: leases overlap
            released = time.monotonic()
            c.release(lease.flow_id)
        except (ArkClientError, AgentNotReady) as e:
            with self.lock:
                self.errors.append(f"{n}: {e}")
            return
        with self.lock:
            self.done += 1
            if lease.reserved:
                self.leases.append(_Held(self.index[n], lease.dst, lease.path, granted, released))
                if self.again_at is None and self.t_kill is not None and granted > self.t_kill:
                    self.again_at = granted
            else:
                self.fallbacks.append((granted, lease.fallback))
            if self.done == self.flows // 2:
                self.halfway.set()


def double_holders(fabric: Any, leases: list[_Held]) -> int:
    """Pairs of exclusive leases sharing a link with overlapping lifetimes."""
    by_link: dict[int, list[_Held]] = {}
    for le in leases:
        for stage in fabric.stages(le.src, le.dst):
            by_link.setdefault(stage[le.path], []).append(le)
    pairs = 0
    for held in by_link.values():
        held.sort(key=lambda h: h.granted)
        live: list[_Held] = []
        for h in held:
            live = [x for x in live if x.released > h.granted]
            pairs += len(live)
            live.append(h)
    return pairs


def _held_leases(procs: AgentProcs, load: _ArbiterLoad, stop: threading.Event, renew_s: float) -> dict[str, Lease]:
    """One long lease per agent, renewed in the background until ``stop``."""
    held: dict[str, Lease] = {}
    r = random.Random(load.seed)
    for n in load.names:
        with ArkClient(procs.api(n), timeout_s=10.0) as c:
            held[n] = c.reserve(load.remote(n, r), HELD_BYTES)

    def renew() -> None:
        clients = {n: ArkClient(procs.api(n), timeout_s=10.0) for n in held}
        try:
            while not stop.wait(renew_s):
                for n, lease in held.items():
                    with contextlib.suppress(ArkClientError):
                        clients[n].renew(lease.flow_id)
        finally:
            for c in clients.values():
                c.close()

    threading.Thread(target=renew, daemon=True).start()
    return held


def _wait_leader(procs: AgentProcs, names: list[str], timeout_s: float = 30.0) -> float:
    """Until an arbiter grants: the first rank leads after ``takeover_s`` at a cold start."""
    t0 = time.monotonic()
    with ArkClient(procs.api(names[0]), timeout_s=10.0) as c:
        dst = names[1]
        while time.monotonic() - t0 < timeout_s:
            lease = c.reserve(dst, 10**6)
            c.release(lease.flow_id)
            if lease.reserved:
                return time.monotonic() - t0
            time.sleep(0.05)
    raise ArkClientError("no arbiter led within 30 s")


def _arbiter_exit(log: Path) -> dict[str, Any]:
    for line in reversed(log.read_text().splitlines()):
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("event") == "arbiter_stopped":
                return dict(rec)
    return {}


def run_arbiter_cluster(agents: int, flows: int, *, seed: int = 0, workers: int | None = None,
                        lease_min_s: float = 1.0, takeover_s: float = 1.0,
                        workdir: str | None = None) -> dict[str, Any]:
    """Start two arbiters and ``agents`` agents under ``control = "arbiter"``; hold a
    lease per agent, drive ``flows`` any-to-any reserve+release cycles, SIGKILL the
    primary halfway; report the fallback window, double holders and leaks. Policy ``ark``:
    every reserved lease is exclusive, so any two on one link at once are a fault."""
    if agents < 2:
        raise ValueError("agents: need at least 2")
    if flows < 2:
        raise ValueError("flows: must be >= 2")
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ark-arb-")))
        (wd / "api").mkdir(parents=True, exist_ok=True)
        cfile, names = write_cluster(wd, agents, policy="ark", lease_min_s=lease_min_s, spines=max(4, agents),
                                     arbiters=2, takeover_s=takeover_s, control="arbiter")
        procs = AgentProcs(cfile, names, wd)
        stack.callback(procs.stop_all)
        cluster = load_cluster(cfile)
        for n in ("arb0", "arb1", *names):
            procs.start(n)
        procs.wait_ready(names)
        report: dict[str, Any] = {"agents": agents, "arbiters": 2, "flows_requested": flows,
                                  "takeover_s": takeover_s, "first_grant_s": round(_wait_leader(procs, names), 3)}
        load = _ArbiterLoad(procs, cluster, flows, workers or min(agents, 8), seed)
        stop = threading.Event()
        stack.callback(stop.set)
        held = _held_leases(procs, load, stop, lease_min_s / 4)
        threads = [threading.Thread(target=load.worker, args=(i,), daemon=True) for i in range(load.workers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        load.halfway.wait()
        # The primary is whichever leads (at a cold start the first rank started may lose the
        # race): killing the follower instead would stop the leader too (its lease needs it).
        primary = procs.status(names[:1])[names[0]]["arbiter"]["leader"]
        procs.kill(f"arb{primary}")
        t_kill = load.t_kill = time.monotonic()
        for t in threads:
            t.join()
        report.update(_load_figures(load, time.monotonic() - t0, t_kill))
        report.update(_finish(procs, cluster, held, stop, f"arb{1 - primary}"))
        report["double_holders"] = double_holders(cluster.fabric, load.leases)
        return report


def _load_figures(load: _ArbiterLoad, load_s: float, t_kill: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"flows": load.done, "load_s": round(load_s, 3),
                           "cycles_per_s": round(load.done / load_s, 1) if load_s > 0 else 0.0,
                           "client_errors": len(load.errors), "reserved_leases": len(load.leases),
                           "no_arbiter_leases": sum(1 for _, why in load.fallbacks if why == NO_ARBITER),
                           "other_fallbacks": sum(1 for _, why in load.fallbacks if why != NO_ARBITER)}
    if t_kill is not None:
        out["ecmp_window_s"] = round(load.again_at - t_kill, 3) if load.again_at is not None else None
        last = [t for t, why in load.fallbacks if why == NO_ARBITER]
        out["last_no_arbiter_s"] = round(max(last) - t_kill, 3) if last else None
    return out


def _finish(procs: AgentProcs, cluster: Cluster, held: dict[str, Lease], stop: threading.Event,
            standby: str) -> dict[str, Any]:
    """Release the held leases (registered with the standby after the kill), wait one
    lease period, stop the arbiter: what it and the agents still hold."""
    stop.set()
    kept = lapsed = 0
    for n, lease in held.items():
        with ArkClient(procs.api(n), timeout_s=10.0) as c:
            try:
                kept += c.current(lease.flow_id).reserved
                c.release(lease.flow_id)
            except ArkClientError:
                lapsed += 1
    period = cluster.lease()(HELD_BYTES, cluster.fabric.path_rate_bps(0, cluster.fabric.n_hosts - 1, 0))
    time.sleep(period + 0.5)  # the longest lease: whatever no release reached has ended by then
    local = sum(s["local_flows"] for s in procs.status(procs.names).values())
    procs.stop_all()
    exit_rec = _arbiter_exit(procs.workdir / f"{standby}.log")  # the standby, leading since the kill
    return {"held_reserved_at_end": kept, "held_lapsed": lapsed, "held_lease_period_s": round(period, 3),
            "leaked_local": local, "leaked_at_arbiter": exit_rec.get("live"),
            "arbiter_counters": exit_rec.get("counters", {})}
