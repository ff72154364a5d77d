"""``ark bench arbiter``: a real arbiter process under real load generators.

One ``ark arbiter`` process (CURVE on loopback, the cluster's own keys) and one load
generator process that speaks for every host of the fabric (a DEALER per host, each with
that host's key). The generator runs open-loop: it sends asks at the offered rate
whatever the answers do, and releases each granted lease ``hold_s`` later, so a
*decision* is an ask, its grant, a release and its acknowledgement. Per offered rate:
the decisions completed per second, request-to-grant latency (P50, P99, measured by the
generator: its own queueing included), and the arbiter process's CPU per decision (its
main and ZeroMQ threads, from /proc). The rate it sustains is the highest offered rate
whose decisions all complete at that rate (within 2%) with no standing queue (P99 at most
``STANDING_QUEUE_MS``); the knee is the first rate beyond it. The generator's own CPU is
reported beside the arbiter's: on a small machine it, not the arbiter, may be what stops
the sweep. A last step offers 80% of the sustained rate and reports its latency.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import random
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import zmq

from ark.agent.bench import transport_floor
from ark.agent.cluster import load as load_cluster
from ark.agent.cluster import read_secret_key
from ark.agent.loopback import AgentProcs, write_cluster
from ark.core import arbiter_wire as w

RATES = (2000.0, 5000.0, 10_000.0, 15_000.0, 20_000.0, 30_000.0, 40_000.0)
# A P99 beyond this means a queue that grew during the step: the rate is not sustained.
STANDING_QUEUE_MS = 50.0


def _generator(cluster_file: str, rate: float, seconds: float, hold_s: float, seed: int, q: Any) -> None:
    """The load process: its result, or its error, goes to ``q``."""
    try:
        _load(cluster_file, rate, seconds, hold_s, seed, q)
    except Exception as e:
        q.put({"error": f"{type(e).__name__}: {e}"})


def _load(cluster_file: str, rate: float, seconds: float, hold_s: float, seed: int, q: Any) -> None:
    """Asks from the first leaf's hosts to random hosts of the last leaf at ``rate``, open loop."""
    cl = load_cluster(cluster_file)
    arb = cl.arbiters[0]
    ctx = zmq.Context()
    socks: dict[int, zmq.Socket] = {}
    poller = zmq.Poller()
    for h in cl.hosts:
        pub, sec = read_secret_key(str(h.secret_key_file))
        s = ctx.socket(zmq.DEALER)
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, arb.public_key.encode()
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(arb.control)
        socks[h.index] = s
        poller.register(s, zmq.POLLIN)
    leaves: dict[int, list[int]] = {}
    for h in cl.hosts:
        leaves.setdefault(cl.fabric.hosts[h.index].leaf, []).append(h.index)
    src, dst = leaves[min(leaves)], leaves[max(leaves)]
    rng = random.Random(seed)
    for i, s_ix in enumerate(src):  # the CURVE handshakes, and a first answer from each
        socks[s_ix].send(w.encode(w.Ping(i, 0)))
    for s_ix in src:
        socks[s_ix].recv()
    q.put(_offer(socks, poller, src, dst, rng, rate, seconds, hold_s))
    ctx.destroy(0)


def _offer(socks: dict[int, zmq.Socket], poller: zmq.Poller, src: list[int], dst: list[int], rng: random.Random,
           rate: float, seconds: float, hold_s: float) -> dict[str, Any]:
    sent_at: dict[int, float] = {}
    releases: list[tuple[float, int, tuple[int, int]]] = []
    lat: list[float] = []
    rid, asked, granted, reserved, dropped, epoch = 1 << 20, 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    end = t0 + seconds
    drain_until = end + 2.0
    while True:
        now = time.perf_counter()
        due = min(int((now - t0) * rate), int(seconds * rate))
        while asked < due:  # open loop: what is due goes out now, however late
            h = src[asked % len(src)]
            rid += 1
            sent_at[rid] = time.perf_counter()
            socks[h].send(w.encode(w.Ask(rid, epoch, rng.choice(dst), rng.randrange(1, 10**9), 4791)), zmq.NOBLOCK)
            asked += 1
        while releases and releases[0][0] <= now:
            _, h, flow = heapq.heappop(releases)
            rid += 1
            socks[h].send(w.encode(w.Drop(rid, epoch, [flow])), zmq.NOBLOCK)
        if now > drain_until or (now > end and not sent_at and not releases and dropped >= reserved):
            break
        for s, _ in poller.poll(1):
            while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                reply = w.decode_to_host(s.recv())
                t = time.perf_counter()
                if isinstance(reply, w.Grant):
                    lat.append(t - sent_at.pop(reply.rid, t))
                    granted += 1
                    for p in reply.parts:
                        if p.reserved:
                            reserved += 1
                            heapq.heappush(releases, (t + hold_s, p.flow[0], p.flow))
                elif isinstance(reply, w.Dropped):
                    dropped += 1
    wall = max(time.perf_counter() - t0, seconds)
    arr = np.asarray(lat) if lat else np.zeros(0)
    return {"offered_per_s": rate, "asked": asked, "granted": granted, "reserved": reserved, "released": dropped,
            "completed_per_s": round(granted / seconds, 1), "wall_s": round(wall, 2),
            "grant_p50_ms": round(float(np.percentile(arr, 50)) * 1e3, 3) if arr.size else None,
            "grant_p99_ms": round(float(np.percentile(arr, 99)) * 1e3, 3) if arr.size else None,
            "unanswered": len(sent_at)}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _step(procs: AgentProcs, cluster_file: Path, rate: float, seconds: float, hold_s: float, seed: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    pid = procs.procs["arb0"].pid
    gen = ctx.Process(target=_generator, args=(str(cluster_file), rate, seconds, hold_s, seed, q), daemon=True)
    gen.start()
    cpu0 = _cpu_s(pid)
    res: dict[str, Any] = q.get(timeout=seconds + 60)
    gen_cpu = _cpu_s(gen.pid) if gen.pid is not None else 0.0
    if "error" in res:
        raise RuntimeError(f"arbiter bench: the load generator failed: {res['error']}")
    cpu = _cpu_s(pid) - cpu0
    gen.join(10)
    decisions = max(1, res["granted"])
    res.update(arbiter_cpu_s=round(cpu, 2), arbiter_cpu_us_per_decision=round(cpu / decisions * 1e6, 1),
               arbiter_cores=round(cpu / res["wall_s"], 2), generator_cores=round(gen_cpu / res["wall_s"], 2),
               sustained=res["granted"] >= 0.98 * res["asked"] and res["unanswered"] == 0
               and res["completed_per_s"] >= 0.98 * rate and (res["grant_p99_ms"] or 0.0) <= STANDING_QUEUE_MS)
    return res


def arbiter_bench(rates: tuple[float, ...] = RATES, seconds: float = 3.0, hold_s: float = 0.05,
                  hosts: int = 64, spines: int = 8, policy: str = "ark") -> dict[str, Any]:
    """The sweep (see the module docstring); stops at the first rate not sustained."""
    floor = transport_floor(3000, 1500.0)
    with tempfile.TemporaryDirectory(prefix="ark-arbiter-bench-") as tmp:
        wd = Path(tmp)
        cluster_file, _ = write_cluster(wd, hosts, policy=policy, spines=spines, arbiters=1,
                                        max_flows_per_host=1 << 16, lease_min_s=5.0)
        doc = tomllib.loads(cluster_file.read_text())
        # The generator sends many hosts' worth at once: the per-host rate limit is not what is measured.
        doc["cluster"].update(arbiter_rate_per_host=1e7, arbiter_burst_per_host=1 << 20)
        cluster_file.write_text(tomli_w.dumps(doc))
        procs = AgentProcs(cluster_file, [], wd)
        procs.start("arb0")
        try:
            time.sleep(1.5)
            steps: list[dict[str, Any]] = []
            for i, rate in enumerate(sorted(rates)):
                steps.append(_step(procs, cluster_file, rate, seconds, hold_s, i))
                if not steps[-1]["sustained"]:
                    break
            ok = [s for s in steps if s["sustained"]]
            sustained = max((s["completed_per_s"] for s in ok), default=0.0)
            at80 = _step(procs, cluster_file, 0.8 * sustained, seconds, hold_s, 99) if sustained else None
        finally:
            procs.stop_all()
    knee = next((s["offered_per_s"] for s in steps if not s["sustained"]), None)
    return {"policy": policy, "hosts": hosts, "spines": spines, "seconds_per_step": seconds, "hold_s": hold_s,
            "steps": steps, "sustained_per_s": sustained, "knee_offered_per_s": knee, "at_80_percent": at80,
            "machine": {"cpus": os.cpu_count(), "transport_us_per_message": floor["cpu_us_per_message"]}}


def _ping_until_pong(sock: zmq.Socket, deadline: float, every_s: float = 0.01) -> tuple[float | None, int]:
    """Ping one arbiter until it answers leading (a Pong): when, and its epoch."""
    rid = 0
    while time.monotonic() < deadline:
        rid += 1
        sock.send(w.encode(w.Ping(rid, 0)))
        if sock.poll(int(every_s * 1000)):
            reply = w.decode_to_host(sock.recv())
            if isinstance(reply, w.Pong):
                return time.monotonic(), reply.epoch
        while sock.poll(0):
            sock.recv()
    return None, -1


def takeover(trials: int = 3, takeover_s: float = 1.0) -> dict[str, Any]:
    """A primary SIGKILLed under a standby: how long no arbiter answers (the time a host
    would give plain ECMP), per trial; two real arbiter processes on loopback."""
    gaps: list[float] = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory(prefix="ark-arbiter-takeover-") as tmp:
            wd = Path(tmp)
            cluster_file, names = write_cluster(wd, 2, arbiters=2, takeover_s=takeover_s)
            cl = load_cluster(cluster_file)
            pub, sec = read_secret_key(str(cl.host(names[0]).secret_key_file))
            ctx = zmq.Context()
            socks = []
            for a in cl.arbiters:
                s = ctx.socket(zmq.DEALER)
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, a.public_key.encode()
                s.setsockopt(zmq.LINGER, 0)
                s.connect(a.control)
                socks.append(s)
            procs = AgentProcs(cluster_file, [], wd)
            try:
                procs.start("arb0")
                procs.start("arb1")
                if _ping_until_pong(socks[0], time.monotonic() + 30)[0] is None:
                    raise RuntimeError("arbiter bench: the primary never led")
                time.sleep(2 * takeover_s)  # the standby follows, its beats flow
                procs.kill("arb0")
                t_kill = time.monotonic()
                t_up, epoch = _ping_until_pong(socks[1], t_kill + 30)
                if t_up is None or epoch % 2 != 1:
                    raise RuntimeError("arbiter bench: the standby never led")
                gaps.append(round(t_up - t_kill, 3))
            finally:
                procs.stop_all()
                ctx.destroy(0)
    return {"trials": trials, "takeover_s": takeover_s, "heartbeat_s": takeover_s / 5,
            "no_arbiter_s": gaps, "no_arbiter_s_max": max(gaps)}
