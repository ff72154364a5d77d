"""Real agent processes on loopback: set-up, a reserve/release load, kills and restarts.

Used by ``ark cluster`` and the tests. Every agent is a separate ``python -m ark agent``
process with its own CURVE key pair, talking over 127.0.0.1 TCP; the driver talks to
each agent's local API through :class:`ark.agent.client.ArkClient`.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ark.agent.client import AgentNotReady, ArkClient, ArkClientError, wait_ready
from ark.agent.cluster import ArbiterTable, Cluster, ClusterFile, ClusterSettings, HostTable
from ark.agent.cluster import load as load_cluster
from ark.agent.keys import create_keypair
from ark.core.fabric_config import FabricConfig
from ark.core.node import Lease

HELD_BYTES = 10**10  # the long-lived leases: 10 GB, a lease of a few seconds


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def write_cluster(
    workdir: Path,
    n: int,
    *,
    policy: str = "ark",
    lease_min_s: float = 1.0,
    heartbeat_s: float = 0.25,
    extra_hosts: int = 0,
    spines: int = 4,
    peer_rate: float = 2000.0,
    max_flows_per_host: int = 4096,
    retention_s: float = 5.0,
    sends_to: dict[str, list[str]] | None = None,
    metrics: bool = False,
    arbiters: int = 0,
    gpus_per_leaf: int | None = None,
    takeover_s: float = 1.0,
    control: Literal["broadcast", "arbiter"] = "broadcast",
    arbiter_rate_per_host: float = 2000.0,
    arbiter_timeout_s: float = 0.1,
    arbiter_burst_per_host: int = 256,
) -> tuple[Path, list[str]]:
    """Keys and a cluster file for ``n`` agents on a 2-leaf fabric with ``spines`` spines.

    ``extra_hosts`` more hosts get keys and entries but no process is started for them
    by default (tests use them as strangers or impostors). ``sends_to`` (host name ->
    the names it sends KV flows to) makes the cluster scoped (``scope = "declared"``).
    ``metrics``: every host gets a ``metrics_port`` too. ``arbiters``: that many
    ``[[arbiters]]`` (``arb0``, ...; keys beside the hosts'). ``gpus_per_leaf``: a larger
    fabric than the hosts need (the others have no entry). ``control = "arbiter"``: the
    agents ask the arbiters (give ``arbiters`` >= 1), each host at most
    ``arbiter_rate_per_host`` tokens a second (burst ``arbiter_burst_per_host``), and fall
    back to ECMP when no answer comes within ``arbiter_timeout_s``.
    """
    total = n + extra_hosts
    per_leaf = max(1, math.ceil(total / 2), gpus_per_leaf or 0)
    names = [f"gpu{(i % 2) * per_leaf + i // 2}" for i in range(total)]  # alternate leaves
    ports = free_ports((2 * total if metrics else total) + arbiters)
    hosts = []
    for i, name in enumerate(names):
        kp = create_keypair(workdir / "keys", name)
        hosts.append(HostTable(name=name, control=f"tcp://127.0.0.1:{ports[i]}", api=f"ipc://{workdir}/api/{name}.sock",
                               public_key=kp.public_key, sign_key=kp.sign_key, secret_key_file=f"keys/{name}.key_secret",
                               sends_to=list((sends_to or {}).get(name, [])),
                               metrics_port=ports[total + i] if metrics else None))
    settings = ClusterSettings(policy=policy, lease_min_s=lease_min_s, heartbeat_s=heartbeat_s,
                               peer_timeout_s=max(1.0, 2 * heartbeat_s), sync_timeout_s=1.0,
                               max_clock_offset_s=min(0.1, lease_min_s / 4), state_dir="state", peer_rate=peer_rate,
                               max_flows_per_host=max_flows_per_host, retention_s=retention_s,
                               scope="full" if sends_to is None else "declared", takeover_s=takeover_s,
                               control=control, arbiter_rate_per_host=arbiter_rate_per_host,
                               arbiter_timeout_s=arbiter_timeout_s, arbiter_burst_per_host=arbiter_burst_per_host)
    arbs = []
    for r in range(arbiters):
        kp = create_keypair(workdir / "keys", f"arb{r}")
        arbs.append(ArbiterTable(name=f"arb{r}", control=f"tcp://127.0.0.1:{ports[-arbiters + r]}",
                                 public_key=kp.public_key, secret_key_file=f"keys/arb{r}.key_secret"))
    path = ClusterFile(cluster=settings, fabric=FabricConfig(leaves=2, spines=spines, gpus_per_leaf=per_leaf),
                       hosts=hosts, arbiters=arbs).save(workdir / "cluster.toml")
    return path, names


@dataclass
class AgentProcs:
    cluster_file: Path
    names: list[str]
    workdir: Path
    fd_limit: int | None = None  # start the agents under this descriptor limit (soft and hard)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pythonpath: str | None = None  # run another build's code (its src/): a benchmark's old build

    def api(self, name: str) -> str:
        return f"ipc://{self.workdir}/api/{name}.sock"

    def start(self, name: str) -> None:
        """Start the agent ``name`` (an ``arb...`` name: that arbiter)."""
        limit = self.fd_limit

        def limited() -> None:  # in the child, before exec
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with open(self.workdir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "ark", *(("arbiter", "--name") if name.startswith("arb") else ("agent", "--host")),
                 name, "--cluster", str(self.cluster_file)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=limited if limit else None,
                env=None if self.pythonpath is None else {**os.environ, "PYTHONPATH": self.pythonpath},
            )

    def cpu_s(self) -> float:
        """User + system CPU seconds of the running agent processes (Linux /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for p in self.procs.values():
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def wait_ready(self, names: list[str], timeout_s: float = 30.0) -> None:
        wait_ready([self.api(n) for n in names], timeout_s)

    def ask(self, names: list[str], req: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """One request to each named agent; their replies."""
        out = {}
        for n in names:
            with ArkClient(self.api(n), timeout_s=10.0) as c:
                out[n] = c.call(req)
        return out

    def status(self, names: list[str], samples: int = 0) -> dict[str, dict[str, Any]]:
        return {n: r["status"] for n, r in self.ask(names, {"op": "status", "samples": samples}).items()}

    def tables(self, names: list[str]) -> dict[str, set[tuple[int, int]]]:
        return {n: {(f[0], f[1]) for f in r["flows"]} for n, r in self.ask(names, {"op": "table"}).items()}


def _ms_percentile(samples: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(samples, q)) * 1e3, 3) if samples.size else None


class LoopbackRun:
    """The steps of ``ark cluster``: start, hold leases, pace, load (with kills), finish."""

    def __init__(self, procs: AgentProcs, cluster: Cluster, *, seed: int, lease_min_s: float) -> None:
        self.procs, self.cluster = procs, cluster
        self.names = procs.names
        self.leaf = {h.name: cluster.fabric.hosts[h.index].leaf for h in cluster.hosts}
        self.rng = random.Random(seed)
        self.seed, self.lease_min_s = seed, lease_min_s
        self.report: dict[str, Any] = {}
        self.held: dict[str, tuple[ArkClient, Lease]] = {}
        self._stop_renew = threading.Event()

    def remote(self, n: str, rng: random.Random) -> str:
        return rng.choice([m for m in self.names if self.leaf[m] != self.leaf[n]])

    def start(self) -> None:
        t0 = time.monotonic()
        for n in self.names:
            self.procs.start(n)
        self.procs.wait_ready(self.names)
        self.report["startup_s"] = round(time.monotonic() - t0, 3)

    def hold(self) -> bool:
        """One long lease per agent, renewed in the background; do the tables agree on them?"""
        for n in self.names:
            c = ArkClient(self.procs.api(n))
            self.held[n] = (c, c.reserve(self.remote(n, self.rng), HELD_BYTES))
        self._renewer = threading.Thread(target=self._renew_held, daemon=True)
        self._renewer.start()
        time.sleep(0.3)
        st = self.procs.status(self.names)
        agents = len(self.names)
        return len({s["digest"] for s in st.values()}) == 1 and all(s["reservations"] == agents for s in st.values())

    def _renew_held(self) -> None:
        # The held leases live as long as the run: renew them like an engine would.
        while not self._stop_renew.wait(self.lease_min_s / 4):
            for c, lease in list(self.held.values()):
                with contextlib.suppress(ArkClientError):
                    c.renew(lease.flow_id)

    def samples(self) -> dict[str, list[float]]:
        return {n: list(v["propagation_samples"]) for n, v in self.procs.status(self.names, 50_000).items()}

    def paced(self, cycles: int, rate: float) -> None:
        """Propagation on a quiet fabric: reservations one at a time at ``rate`` per second."""
        base = {n: len(v) for n, v in self.samples().items()}
        pc = {n: ArkClient(self.procs.api(n)) for n in self.names}
        for k in range(cycles):
            n = self.names[k % len(self.names)]
            lease = pc[n].reserve(self.remote(n, self.rng), 10**6)
            time.sleep(1.0 / rate)
            pc[n].release(lease.flow_id)
        for c in pc.values():
            c.close()
        time.sleep(0.2)
        quiet = np.concatenate([np.asarray(v[base[n]:], dtype=float) for n, v in self.samples().items()] or [np.zeros(0)])
        self.report.update(paced_cycles=cycles, propagation_samples=int(quiet.size),
                           propagation_ms_p50=_ms_percentile(quiet, 50), propagation_ms_p99=_ms_percentile(quiet, 99))

    def finish(self, base: dict[str, int]) -> None:
        """Counters under load, then release the held leases and compare the tables."""
        st = self.procs.status(self.names, samples=50_000)
        loaded = np.concatenate([np.asarray(s["propagation_samples"][base.get(n, 0):], dtype=float) for n, s in st.items()])
        r = self.report
        r["races"] = int(sum(s["core"]["races_lost"] for s in st.values()))
        r["invalid_messages"] = int(sum(s["node"]["invalid"] + s["core"]["invalid"] for s in st.values()))
        for counter in ("gaps", "sync_applied", "digest_mismatches", "unsent", "received", "errors", "rate_limited"):
            r[counter] = int(sum(s["node"].get(counter, 0) for s in st.values()))
        r["messages_received"] = r.pop("received")
        r["sync_merge_fraction"] = round(r["sync_applied"] / max(1, r["messages_received"]), 5)
        r["propagation_loaded_ms_p50"] = _ms_percentile(loaded, 50)
        r["propagation_loaded_ms_p99"] = _ms_percentile(loaded, 99)
        self._stop_renew.set()
        self._renewer.join()
        lapsed = 0
        for c, lease in self.held.values():
            try:
                c.release(lease.flow_id)
            except ArkClientError:
                lapsed += 1  # its lease ran out: the renewer fell behind
            c.close()
        r["held_leases_lapsed"] = lapsed
        time.sleep(self.lease_min_s + 0.5)
        st = self.procs.status(self.names)
        r["leaked"] = int(sum(s["reservations"] for s in st.values()))
        r["digests_equal_end"] = len({s["digest"] for s in st.values()}) == 1

    def close(self) -> None:
        self._stop_renew.set()
        for c, _ in self.held.values():
            c.close()


class Load:
    """``flows`` reserve+release cycles from worker threads; optionally kill agents halfway."""

    def __init__(self, run: LoopbackRun, flows: int, victims: list[str], workers: int) -> None:
        self.run, self.flows, self.victims, self.workers = run, flows, victims, workers
        self.done = 0
        self.started = 0  # cycles claimed: exactly ``flows`` complete, whatever the workers
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.kill_at = flows // 2 if victims else None
        self.kill_event = threading.Event()
        self.restarted = threading.Event()

    def worker(self, wi: int) -> None:
        run = self.run
        mine = [n for i, n in enumerate(run.names) if i % self.workers == wi]
        clients = {n: ArkClient(run.procs.api(n), timeout_s=10.0) for n in mine}
        r = random.Random(run.seed * 1000 + wi)
        try:
            while True:
                n = r.choice(mine)
                if n in self.victims and self.kill_event.is_set() and not self.restarted.is_set():
                    time.sleep(0.01)
                    continue
                with self.lock:
                    if self.started >= self.flows:
                        return
                    self.started += 1
                if not self._cycle(n, clients, r):
                    with self.lock:
                        self.started -= 1  # failed: another try takes its place
        finally:
            for c in clients.values():
                c.close()

    def _cycle(self, n: str, clients: dict[str, ArkClient], r: random.Random) -> bool:
        c = clients[n]
        try:
            lease = c.reserve(self.run.remote(n, r), r.randint(10**6, 10**9), wait_ready_s=30)
            c.release(lease.flow_id)
        except (ArkClientError, AgentNotReady) as e:
            c.close()
            clients[n] = ArkClient(self.run.procs.api(n), timeout_s=10.0)
            with self.lock:
                self.errors.append(f"{n}: {e}")
            time.sleep(0.05)
            return False
        with self.lock:
            self.done += 1
            if self.kill_at is not None and self.done == self.kill_at:
                self.kill_event.set()
        return True


def _kill_and_restart(run: LoopbackRun, load: Load, threads: list[threading.Thread]) -> None:
    """SIGKILL the victims while each holds a lease; time the clean-up; restart them."""
    while not load.kill_event.wait(0.05):
        if not any(t.is_alive() for t in threads):
            break
    killed: dict[str, tuple[int, int]] = {}
    for v in load.victims:
        c_v, lease = run.held.pop(v)
        killed[v] = lease.flow_id
        run.procs.kill(v)
        c_v.close()
    t_kill = time.monotonic()
    survivors = [n for n in run.names if n not in load.victims]
    rate = run.cluster.fabric.path_rate_bps(0, run.cluster.fabric.n_hosts - 1, 0)
    lease_period = run.cluster.lease()(HELD_BYTES, rate)
    cleared_at = None
    while time.monotonic() - t_kill < 3 * lease_period + 2:
        try:
            tables = run.procs.tables(survivors)
        except ArkClientError:
            continue
        if not any(f in t for t in tables.values() for f in killed.values()):
            cleared_at = time.monotonic() - t_kill
            break
        time.sleep(0.05)
    run.report["dead_reservations_cleared_s"] = None if cleared_at is None else round(cleared_at, 3)
    run.report["lease_period_s"] = round(lease_period, 3)
    for v in load.victims:
        run.procs.start(v)
    refused, resync_ok = {}, {}
    for v in load.victims:
        refused[v], resync_ok[v] = _first_reserve_after_restart(run, v)
    run.report["restart_refusals_before_ready"] = refused
    run.report["resync_before_reserve"] = bool(resync_ok) and all(resync_ok.values())
    load.restarted.set()


def _first_reserve_after_restart(run: LoopbackRun, v: str) -> tuple[int, bool]:
    """A restarted agent must refuse to reserve until it has resynchronised."""
    refused = 0
    with ArkClient(run.procs.api(v), timeout_s=10.0) as c:
        deadline = time.monotonic() + 30
        while True:
            try:
                dst = next(m for m in run.names if run.leaf[m] != run.leaf[v])
                lease = c.call({"op": "reserve", "dst": dst, "nbytes": 10**6})["lease"]
                break
            except AgentNotReady:
                refused += 1
            except ArkClientError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ArkClientError(f"{v} never became ready")
            time.sleep(0.01)
        s = c.status()
        synced = sum(1 for p in s["peers"].values() if p["synced"])
        ok = s["node"]["sync_applied"] >= 1 and synced == len(run.names) - 1
        c.release((lease["flow_id"][0], lease["flow_id"][1]))
    return refused, ok


def run_cluster(
    agents: int,
    flows: int,
    kill: int = 0,
    *,
    seed: int = 0,
    workers: int | None = None,
    lease_min_s: float = 1.0,
    workdir: str | None = None,
    policy: str = "ark",
    paced_cycles: int = 200,
    paced_rate: float = 50.0,
    hogs: int = 0,
) -> dict[str, Any]:
    """Start ``agents`` agents, drive ``flows`` reserve+release cycles, optionally
    SIGKILL ``kill`` agents halfway and restart them; report what happened. ``hogs``
    busy processes run beside the agents all along (an overloaded host).

    RESERVE propagation is measured twice: on a quiet fabric (``paced_cycles`` one at a
    time at ``paced_rate`` per second: ``propagation_ms_*``) and under the full load
    (``propagation_loaded_ms_*``, which includes queueing behind a saturated CPU).
    """
    if agents < 2:
        raise ValueError("agents: need at least 2")
    if not 0 <= kill < agents:
        raise ValueError(f"kill: must be 0..{agents - 1}")
    if flows < 1:
        raise ValueError("flows: must be >= 1")
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ark-cluster-")))
        (wd / "api").mkdir(parents=True, exist_ok=True)
        # As many spines as agents: the held leases plus the load leave paths free, so
        # that requests reserve (and broadcast) instead of falling back to ECMP.
        cfile, names = write_cluster(wd, agents, policy=policy, lease_min_s=lease_min_s, spines=max(4, agents))
        procs = AgentProcs(cfile, names, wd)
        stack.callback(procs.stop_all)
        for _ in range(hogs):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            stack.callback(hog.kill)
        run = LoopbackRun(procs, load_cluster(cfile), seed=seed, lease_min_s=lease_min_s)
        stack.callback(run.close)
        run.report.update(agents=agents, flows_requested=flows, killed=kill, hogs=hogs)
        run.start()
        live_equal = run.hold()
        run.paced(min(paced_cycles, flows), paced_rate)
        base = {n: len(v) for n, v in run.samples().items()}
        _drive(run, Load(run, flows, run.rng.sample(names, kill), workers or min(agents, 8)))
        run.finish(base)
        report = run.report
    report["digests_equal_live"] = bool(live_equal)
    report["digests_equal"] = bool(live_equal and report["digests_equal_end"])
    return report


def _drive(run: LoopbackRun, load: Load) -> None:
    threads = [threading.Thread(target=load.worker, args=(i,), daemon=True) for i in range(load.workers)]
    t_load = time.monotonic()
    cpu0 = run.procs.cpu_s()
    for t in threads:
        t.start()
    if load.victims:
        _kill_and_restart(run, load, threads)
    for t in threads:
        t.join()
    load_s = time.monotonic() - t_load
    r = run.report
    if not load.victims:  # restarted processes would reset their counters
        # CPU of all agent processes (main and ZeroMQ threads) per cycle: what caps
        # the aggregate rate on a small machine.
        r["agents_cpu_ms_per_cycle"] = round((run.procs.cpu_s() - cpu0) / max(1, load.done) * 1e3, 3)
    r["flows"] = load.done
    r["load_s"] = round(load_s, 3)
    r["cycles_per_s"] = round(load.done / load_s, 1) if load_s > 0 else 0.0
    r["client_errors"] = len(load.errors)
