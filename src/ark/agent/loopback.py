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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ark.agent.client import AgentNotReady, ArkClient, ArkClientError, wait_ready

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
) -> tuple[Path, list[str]]:
    """Keys and a cluster file for ``n`` agents on a 2-leaf fabric with ``spines`` spines.

    ``extra_hosts`` more hosts get keys and entries but no process is started for them
    by default (tests use them as strangers or impostors).
    """
    import zmq.auth

    total = n + extra_hosts
    per_leaf = max(1, math.ceil(total / 2))
    names = [f"gpu{(i % 2) * per_leaf + i // 2}" for i in range(total)]  # alternate leaves
    keys = workdir / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    ports = free_ports(total)
    lines = [
        "[cluster]",
        f'policy = "{policy}"',
        f"lease_min_s = {lease_min_s}",
        f"heartbeat_s = {heartbeat_s}",
        "peer_timeout_s = 1.0",
        "sync_timeout_s = 1.0",
        "",
        "[fabric]",
        f"leaves = 2\nspines = {spines}\ngpus_per_leaf = {per_leaf}",
        "",
    ]
    for i, name in enumerate(names):
        pub_file, _sec_file = zmq.auth.create_certificates(str(keys), name)
        pub, _ = zmq.auth.load_certificate(pub_file)
        lines += [
            "[[hosts]]",
            f'name = "{name}"',
            f'control = "tcp://127.0.0.1:{ports[i]}"',
            f'api = "ipc://{workdir}/api/{name}.sock"',
            f'public_key = "{pub.decode()}"',
            f'secret_key_file = "keys/{name}.key_secret"',
            "",
        ]
    path = workdir / "cluster.toml"
    path.write_text("\n".join(lines))
    return path, names


@dataclass
class AgentProcs:
    cluster_file: Path
    names: list[str]
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def api(self, name: str) -> str:
        return f"ipc://{self.workdir}/api/{name}.sock"

    def start(self, name: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ark", "agent", "--cluster", str(self.cluster_file), "--host", name],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
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


def _status(procs: AgentProcs, names: list[str], samples: int = 0) -> dict[str, dict[str, Any]]:
    out = {}
    for n in names:
        c = ArkClient(procs.api(n), timeout_s=10.0)
        try:
            out[n] = c.status(samples)
        finally:
            c.close()
    return out


def _tables(procs: AgentProcs, names: list[str]) -> dict[str, set[tuple[int, int]]]:
    out = {}
    for n in names:
        c = ArkClient(procs.api(n), timeout_s=10.0)
        try:
            out[n] = {(f[0], f[1]) for f in c.call({"op": "table"})["flows"]}
        finally:
            c.close()
    return out


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
) -> dict[str, Any]:
    """Start ``agents`` agents, drive ``flows`` reserve+release cycles, optionally
    SIGKILL ``kill`` agents halfway and restart them; report what happened.

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
    tmp = tempfile.TemporaryDirectory(prefix="ark-cluster-") if workdir is None else None
    wd = Path(workdir or tmp.name)  # type: ignore[union-attr]
    (wd / "api").mkdir(parents=True, exist_ok=True)
    # As many spines as agents: the held leases plus the load leave paths free, so
    # that requests reserve (and broadcast) instead of falling back to ECMP.
    cfile, names = write_cluster(wd, agents, policy=policy, lease_min_s=lease_min_s, spines=max(4, agents))
    from ark.agent import cluster as clmod

    cl = clmod.load(cfile)
    leaf = {h.name: cl.fabric.hosts[h.index].leaf for h in cl.hosts}
    procs = AgentProcs(cfile, names, wd)
    rng = random.Random(seed)
    report: dict[str, Any] = {"agents": agents, "flows_requested": flows, "killed": kill}
    try:
        t0 = time.monotonic()
        for n in names:
            procs.start(n)
        procs.wait_ready(names)
        report["startup_s"] = round(time.monotonic() - t0, 3)

        # ---- held leases: the tables must agree while they are live
        held: dict[str, tuple[ArkClient, Any]] = {}
        for n in names:
            c = ArkClient(procs.api(n))
            dst = rng.choice([m for m in names if leaf[m] != leaf[n]])
            held[n] = (c, c.reserve(dst, HELD_BYTES))
        stop_renew = threading.Event()

        def renewer() -> None:
            # The held leases live as long as the run: renew them like an engine would.
            while not stop_renew.wait(lease_min_s / 4):
                for c, lease in list(held.values()):
                    with contextlib.suppress(ArkClientError):
                        c.renew(lease.flow_id)

        renew_thread = threading.Thread(target=renewer, daemon=True)
        renew_thread.start()
        time.sleep(0.3)
        st = _status(procs, names)
        live_equal = len({s["digest"] for s in st.values()}) == 1 and all(s["reservations"] == agents for s in st.values())

        # ---- propagation on a quiet fabric: paced reservations, one at a time
        def all_samples() -> dict[str, list[float]]:
            return {n: list(v["propagation_samples"]) for n, v in _status(procs, names, samples=50_000).items()}

        base = {n: len(v) for n, v in all_samples().items()}
        paced = min(paced_cycles, flows)
        pc = {n: ArkClient(procs.api(n)) for n in names}
        for k in range(paced):
            n = names[k % agents]
            dst = rng.choice([m for m in names if leaf[m] != leaf[n]])
            lease = pc[n].reserve(dst, 10**6)
            time.sleep(1.0 / paced_rate)
            pc[n].release(lease.flow_id)
        for c in pc.values():
            c.close()
        time.sleep(0.2)
        quiet = np.concatenate(
            [np.asarray(v[base[n]:], dtype=float) for n, v in all_samples().items()] or [np.zeros(0)]
        )
        report["paced_cycles"] = paced
        report["propagation_samples"] = int(quiet.size)
        report["propagation_ms_p50"] = round(float(np.percentile(quiet, 50)) * 1e3, 3) if quiet.size else None
        report["propagation_ms_p99"] = round(float(np.percentile(quiet, 99)) * 1e3, 3) if quiet.size else None
        base = {n: len(v) for n, v in all_samples().items()}

        # ---- the load
        victims = rng.sample(names, kill)
        done = [0]
        errors: list[str] = []
        lock = threading.Lock()
        kill_at = flows // 2 if kill else None
        killed_flows: dict[str, tuple[int, int]] = {}
        resync_ok: dict[str, bool] = {}
        kill_event = threading.Event()
        restarted = threading.Event()
        nworkers = workers or min(agents, 8)

        def worker(wi: int) -> None:
            mine = [n for i, n in enumerate(names) if i % nworkers == wi]
            clients = {n: ArkClient(procs.api(n), timeout_s=10.0) for n in mine}
            r = random.Random(seed * 1000 + wi)
            try:
                while True:
                    with lock:
                        if done[0] >= flows:
                            return
                    n = r.choice(mine)
                    if n in victims and kill_event.is_set() and not restarted.is_set():
                        time.sleep(0.01)
                        continue
                    dst = r.choice([m for m in names if leaf[m] != leaf[n]])
                    c = clients[n]
                    try:
                        lease = c.reserve(dst, r.randint(10**6, 10**9), wait_ready_s=30)
                        c.release(lease.flow_id)
                    except (ArkClientError, AgentNotReady) as e:
                        clients[n].close()
                        clients[n] = ArkClient(procs.api(n), timeout_s=10.0)
                        with lock:
                            errors.append(f"{n}: {e}")
                        time.sleep(0.05)
                        continue
                    with lock:
                        done[0] += 1
                        if kill_at is not None and done[0] == kill_at:
                            kill_event.set()
            finally:
                for c in clients.values():
                    c.close()

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(nworkers)]
        t_load = time.monotonic()
        cpu0 = procs.cpu_s()
        for t in threads:
            t.start()
        if kill:
            while not kill_event.wait(0.05):
                if not any(t.is_alive() for t in threads):
                    break
            # SIGKILL the victims while each holds a lease (its held one).
            for v in victims:
                killed_flows[v] = held[v][1].flow_id
                c_v, _ = held.pop(v)
                procs.kill(v)
                c_v.close()
            t_kill = time.monotonic()
            survivors = [n for n in names if n not in victims]
            lease_period = lease_min_s + 2.0 * HELD_BYTES * 8 / (100e9 * cl.fabric.efficiency)
            cleared_at = None
            while time.monotonic() - t_kill < 3 * lease_period + 2:
                try:
                    tables = _tables(procs, survivors)
                except ArkClientError:
                    continue
                if not any(f in t for t in tables.values() for f in killed_flows.values()):
                    cleared_at = time.monotonic() - t_kill
                    break
                time.sleep(0.05)
            report["dead_reservations_cleared_s"] = None if cleared_at is None else round(cleared_at, 3)
            report["lease_period_s"] = round(lease_period, 3)
            for v in victims:
                procs.start(v)
            # A restarted agent must refuse to reserve until it has resynchronised.
            refused: dict[str, int] = {}
            for v in victims:
                c = ArkClient(procs.api(v), timeout_s=10.0)
                try:
                    refused[v] = 0
                    deadline = time.monotonic() + 30
                    while True:
                        try:
                            lease = c.call({"op": "reserve", "dst": next(m for m in names if leaf[m] != leaf[v]), "nbytes": 10**6})["lease"]
                            break
                        except AgentNotReady:
                            refused[v] += 1
                        except ArkClientError:
                            pass  # not listening yet
                        if time.monotonic() > deadline:
                            raise ArkClientError(f"{v} never became ready")
                        time.sleep(0.01)
                    s = c.status()
                    synced = sum(1 for p in s["peers"].values() if p["synced"])
                    resync_ok[v] = s["node"]["sync_applied"] >= 1 and synced == agents - 1
                    c.release((lease["flow_id"][0], lease["flow_id"][1]))
                finally:
                    c.close()
            report["restart_refusals_before_ready"] = refused
            restarted.set()
        for t in threads:
            t.join()
        load_s = time.monotonic() - t_load
        if not kill:  # restarted processes would reset their counters
            # CPU of all agent processes (main and ZeroMQ threads) per cycle: what caps
            # the aggregate rate on a small machine.
            report["agents_cpu_ms_per_cycle"] = round((procs.cpu_s() - cpu0) / max(1, done[0]) * 1e3, 3)
        report["flows"] = done[0]
        report["load_s"] = round(load_s, 3)
        report["cycles_per_s"] = round(done[0] / load_s, 1) if load_s > 0 else 0.0
        report["client_errors"] = len(errors)
        if kill:
            report["resync_before_reserve"] = bool(resync_ok) and all(resync_ok.get(v, False) for v in victims)

        # ---- end: release the held leases, wait one lease period, compare
        st = _status(procs, names, samples=50_000)
        loaded = np.concatenate(
            [np.asarray(s["propagation_samples"][base.get(n, 0):], dtype=float) for n, s in st.items()]
        )
        report["races"] = int(sum(s["core"]["races_lost"] for s in st.values()))
        report["invalid_messages"] = int(sum(s["node"]["invalid"] + s["core"]["invalid"] for s in st.values()))
        for counter in ("gaps", "sync_applied", "digest_mismatches", "unsent"):
            report[counter] = int(sum(s["node"].get(counter, 0) for s in st.values()))
        report["propagation_loaded_ms_p50"] = round(float(np.percentile(loaded, 50)) * 1e3, 3) if loaded.size else None
        report["propagation_loaded_ms_p99"] = round(float(np.percentile(loaded, 99)) * 1e3, 3) if loaded.size else None
        stop_renew.set()
        renew_thread.join()
        lapsed = 0
        for c, lease in held.values():
            try:
                c.release(lease.flow_id)
            except ArkClientError:
                lapsed += 1  # its lease ran out: the renewer fell behind
            c.close()
        report["held_leases_lapsed"] = lapsed
        time.sleep(lease_min_s + 0.5)
        st = _status(procs, names)
        report["leaked"] = int(sum(s["reservations"] for s in st.values()))
        end_equal = len({s["digest"] for s in st.values()}) == 1
        report["digests_equal"] = bool(live_equal and end_equal)
        report["digests_equal_live"] = bool(live_equal)
        report["digests_equal_end"] = bool(end_equal)
    finally:
        procs.stop_all()
        if tmp is not None:
            tmp.cleanup()
    return report


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    import json

    print(json.dumps(run_cluster(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)))
    os._exit(0)
