"""Agent benchmarks on loopback: idle cost, hostile floods, unauthenticated abuse, and an
engine reserving and releasing back to back (churn).

Each starts real agent processes (:mod:`ark.agent.loopback`), does its damage from this
process with real sockets, and returns figures (no printing): CPU, resident memory of the
target agent before and after, local API latency percentiles, counters.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.auth

from ark.agent.attack import KINDS, hostile_envelopes
from ark.agent.client import AgentTimeout, ArkClient, ArkClientError
from ark.agent.cluster import Cluster
from ark.agent.cluster import load as load_cluster
from ark.agent.loopback import AgentProcs, write_cluster
from ark.agent.sockets import readable


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def thread_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds per thread name (summed over processes): where an agent's time goes."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for t in Path(f"/proc/{pid}/task").iterdir():
                st = (t / "stat").read_text()
                name = "main" if t.name == str(pid) else st[st.index("(") + 1:st.rindex(")")]
                f = st.rsplit(")", 1)[1].split()
                out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tick
    return out


@dataclass
class Bed:
    """Running agents plus one listed host ("X") whose keys this process holds."""

    procs: AgentProcs
    cluster: Cluster
    running: list[str]
    x: str
    workdir: Path

    def pid(self, name: str) -> int:
        return self.procs.procs[name].pid

    def as_x(self, ctx: zmq.Context, target: str) -> zmq.Socket:
        """A DEALER with X's real keys, connected to ``target``'s control socket."""
        xpub, xsec = zmq.auth.load_certificate(str(self.workdir / "keys" / f"{self.x}.key_secret"))
        s = ctx.socket(zmq.DEALER)
        s.curve_publickey, s.curve_secretkey = xpub, xsec
        s.curve_serverkey = self.cluster.host(target).public_key.encode()
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(self.cluster.host(target).control)
        return s


@contextlib.contextmanager
def bed(agents: int = 3, peer_rate: float = 2000.0, fd_limit: int | None = None,
        max_flows_per_host: int = 4096, retention_s: float = 5.0) -> Iterator[Bed]:
    with tempfile.TemporaryDirectory(prefix="ark-bench-") as d:
        wd = Path(d)
        (wd / "api").mkdir()
        cfile, names = write_cluster(wd, agents, extra_hosts=1, heartbeat_s=0.25, peer_rate=peer_rate,
                                     max_flows_per_host=max_flows_per_host, retention_s=retention_s)
        procs = AgentProcs(cfile, names, wd, fd_limit=fd_limit)
        running = names[:agents]
        try:
            for n in running:
                procs.start(n)
            procs.wait_ready(running)
            yield Bed(procs, load_cluster(cfile), running, names[agents], wd)
        finally:
            procs.stop_all()


def _latencies(api: str, stop: threading.Event, dst: str, out: list[float]) -> None:
    """Reserve+release cycles against ``api`` until ``stop``: each cycle's latency."""
    with ArkClient(api, timeout_s=10.0) as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                lease = c.reserve(dst, 10**6)
                c.release(lease.flow_id)
            except ArkClientError:
                out.append(float("inf"))
                continue
            out.append((time.perf_counter() - t) / 2)
            time.sleep(0.005)


def flood(messages_per_s: float = 10_000, seconds: float = 10.0, peer_rate: float = 2000.0) -> dict[str, Any]:
    """One listed peer floods an agent with hostile messages of every kind while an engine
    reserves and releases; the engine's per-request latency and the agent's memory."""
    with bed(peer_rate=peer_rate) as b:
        target, other = b.running[0], b.running[1]
        ctx = zmq.Context()
        try:
            sock = b.as_x(ctx, target)
            time.sleep(0.5)  # CURVE handshake
            rss0, cpu0 = rss_mb(b.pid(target)), thread_cpu_s([b.pid(target)])
            lat: list[float] = []
            stop = threading.Event()
            prober = threading.Thread(target=_latencies, args=(b.procs.api(target), stop, other, lat), daemon=True)
            prober.start()
            sent = _send_paced(sock, b, target, messages_per_s, seconds)
            stop.set()
            prober.join()
            st = b.procs.status([target])[target]
            rss1, cpu1 = rss_mb(b.pid(target)), thread_cpu_s([b.pid(target)])
            alive = b.procs.procs[target].poll() is None
        finally:
            ctx.destroy(0)
    ok = np.asarray([x for x in lat if x != float("inf")]) * 1e3
    return {
        "messages_per_s": messages_per_s, "seconds": seconds, "sent": sent, "peer_rate": peer_rate,
        "api_requests": len(lat), "api_errors": len(lat) - len(ok),
        "api_ms_p50": round(float(np.percentile(ok, 50)), 3) if ok.size else None,
        "api_ms_p99": round(float(np.percentile(ok, 99)), 3) if ok.size else None,
        "rss_mb_before": round(rss0, 1), "rss_mb_after": round(rss1, 1),
        "agent_cpu_s": round(sum(cpu1.values()) - sum(cpu0.values()), 3),
        "invalid": st["node"]["invalid"] + st["core"]["invalid"], "rate_limited": st["node"]["rate_limited"],
        "errors": st["node"]["errors"], "alive": alive,
    }


def churn(seconds: float = 60.0, max_flows_per_host: int = 4096, retention_s: float = 5.0,
          peer_rate: float = 2000.0, parts: int | None = None) -> dict[str, Any]:
    """One engine reserving and releasing back to back, as fast as its agent answers, on a
    real two-agent cluster: cycles per second, refusals (error replies), plain ECMP leases
    and their reasons, and what the peer made of the stream (dropped, rate limited).
    ``parts``: each cycle a multi-path lease of that many parts (its plain ECMP parts
    counted one by one)."""
    with bed(agents=2, peer_rate=peer_rate, max_flows_per_host=max_flows_per_host, retention_s=retention_s) as b:
        src, dst = b.running
        pid = b.pid(src)
        cpu0 = sum(thread_cpu_s([pid]).values())
        r = _churn_cycles(b.procs.api(src), dst, seconds, parts)
        cpu = sum(thread_cpu_s([pid]).values()) - cpu0
        time.sleep(1.0)  # the peer's last batch and syncs
        st = b.procs.status(b.running)
    mine, peer = st[src], st[dst]
    r.update(max_flows_per_host=max_flows_per_host, retention_s=retention_s, peer_rate=peer_rate, parts=parts,
             agent_cpu_us_per_cycle=round(cpu / max(1, r["cycles"]) * 1e6, 1), capped=mine["core"]["capped"],
             peer_overflow=peer["core"]["overflow"], peer_rate_limited=peer["node"]["rate_limited"],
             peer_gaps=peer["node"]["gaps"], peer_sync_applied=peer["node"]["sync_applied"],
             errors=mine["node"]["errors"] + peer["node"]["errors"])
    return r


def _churn_cycles(api: str, dst: str, seconds: float, parts: int | None = None) -> dict[str, Any]:
    """Reserve+release cycles against ``api`` for ``seconds``, back to back: what the engine got."""
    refused: Counter[str] = Counter()
    ecmp: Counter[str] = Counter()
    ends: list[float] = []
    took: list[float] = []
    with ArkClient(api, timeout_s=10.0) as c:
        t0 = time.monotonic()
        while (t := time.monotonic()) - t0 < seconds:
            try:
                if parts is None:
                    leases = [c.reserve(dst, 10**6, wait_ready_s=0)]
                    c.release(leases[0].flow_id)
                else:
                    leases = c.reserve_split(dst, parts * 10**6, parts=parts, wait_ready_s=0)
                    c.release_split([le.flow_id for le in leases])
            except ArkClientError as e:
                refused[str(e)[:100]] += 1
                continue
            now = time.monotonic()
            ends.append(now - t0)
            took.append(now - t)
            ecmp.update(le.fallback for le in leases if le.fallback)
    wall = time.monotonic() - t0
    per_s = np.bincount(np.asarray(ends, dtype=int), minlength=int(seconds))[:int(seconds)]
    ms = np.asarray(took) * 1e3
    return {"seconds": round(wall, 2), "cycles": len(ends), "cycles_per_s": round(len(ends) / wall, 1),
            "cycles_per_s_min": int(per_s.min()) if per_s.size else 0,
            "refusals": sum(refused.values()), "refusal_reasons": dict(refused),
            "ecmp": sum(ecmp.values()), "ecmp_reasons": dict(ecmp),
            "cycle_ms_p50": round(float(np.percentile(ms, 50)), 3) if ms.size else None,
            "cycle_ms_p99": round(float(np.percentile(ms, 99)), 3) if ms.size else None}


def _send_paced(sock: zmq.Socket, b: Bed, target: str, rate: float, seconds: float) -> int:
    xi, dst = b.cluster.host(b.x).index, b.cluster.host(target).index
    gens = [hostile_envelopes(k, xi, dst, time.time, 1 << 30, seed=i) for i, k in enumerate(KINDS)]
    t0, sent = time.monotonic(), 0
    while (elapsed := time.monotonic() - t0) < seconds:
        due = int(elapsed * rate) - sent
        for _ in range(min(due, 2000)):
            sock.send(next(gens[sent % len(gens)]), zmq.NOBLOCK)
            sent += 1
        time.sleep(0.001)
    return sent


def hostile_memory(messages: int = 1_000_000) -> dict[str, Any]:
    """A listed peer sends ``messages`` hostile messages as fast as it can: resident memory
    of the target agent before and after, and that it is still up and answering."""
    with bed(peer_rate=1e7) as b:
        target = b.running[0]
        ctx = zmq.Context()
        try:
            sock = b.as_x(ctx, target)
            time.sleep(0.5)
            pid = b.pid(target)
            rss0, peak = rss_mb(pid), 0.0
            base = int(b.procs.status([target])[target]["node"]["received"])
            xi, dst = b.cluster.host(b.x).index, b.cluster.host(target).index
            t0 = time.monotonic()
            per_kind = messages // len(KINDS)
            for i, kind in enumerate(KINDS):
                for k, data in enumerate(hostile_envelopes(kind, xi, dst, time.time, per_kind, seed=i)):
                    sock.send(data)
                    if k % 20_000 == 0:
                        peak = max(peak, rss_mb(pid))
            received = _wait_received(b, target, base, per_kind * len(KINDS), 600.0)
            wall = time.monotonic() - t0
            rss1 = rss_mb(pid)
            st = b.procs.status([target])[target]
        finally:
            ctx.destroy(0)
    return {"messages": per_kind * len(KINDS), "received": received, "seconds": round(wall, 1),
            "rss_mb_before": round(rss0, 1), "rss_mb_peak": round(max(peak, rss1), 1), "rss_mb_after": round(rss1, 1),
            "growth_mb": round(max(peak, rss1) - rss0, 1), "invalid": st["node"]["invalid"] + st["core"]["invalid"],
            "reservations": st["reservations"], "errors": st["node"]["errors"], "ready": st["ready"]}


def _wait_received(b: Bed, target: str, base: int, n: int, timeout: float) -> int:
    """Wait until the target has taken ``n`` more messages than ``base`` (or the timeout)."""
    deadline = time.monotonic() + timeout
    got = 0
    while time.monotonic() < deadline:
        got = int(b.procs.status([target])[target]["node"]["received"]) - base
        if got >= n:
            return got
        time.sleep(0.5)
    return got


def unauthenticated(announce_mb: int = 200, connections: int = 3, idle: int = 1100,
                    fd_limit: int = 1024) -> dict[str, Any]:
    """Strangers without keys: connections that announce huge handshake frames, then
    ``idle`` silent TCP connections under a ``fd_limit`` descriptor limit. The agent's
    memory, and whether a local client still gets answers."""
    with bed(fd_limit=fd_limit) as b:
        target = b.running[0]
        pid = b.pid(target)
        host, port = b.cluster.host(target).control[len("tcp://"):].rsplit(":", 1)
        rss0 = rss_mb(pid)
        big: list[socket.socket] = []
        senders = [threading.Thread(target=lambda: big.append(_announce(host, int(port), announce_mb << 20)))
                   for _ in range(connections)]
        for th in senders:
            th.start()
        for th in senders:
            th.join(60)
        time.sleep(1.0)
        rss_big = rss_mb(pid)
        socks = []
        for _ in range(idle):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection((host, int(port)), timeout=2))
        time.sleep(1.0)
        with ArkClient(b.procs.api(target), timeout_s=5.0) as c:
            t = time.perf_counter()
            st = c.status()
            api_ms = (time.perf_counter() - t) * 1e3
        rss_idle = rss_mb(pid)
        for s in [*big, *socks]:
            s.close()
        alive = b.procs.procs[target].poll() is None
    return {"announce_mb": announce_mb, "connections": connections, "idle_connections": len(socks),
            "fd_limit": fd_limit, "rss_mb_before": round(rss0, 1), "rss_mb_after_announce": round(rss_big, 1),
            "rss_mb_after_idle": round(rss_idle, 1), "growth_mb": round(max(rss_big, rss_idle) - rss0, 1),
            "api_ms": round(api_ms, 2), "connections_shed": st["node"]["connections_shed"], "alive": alive}


def _announce(host: str, port: int, size: int, send_mb: int = 64) -> socket.socket:
    """A ZMTP 3 greeting for CURVE, a frame header announcing ``size`` bytes, then up to
    ``send_mb`` MiB of it (what a receiver that believes the header would buffer)."""
    s = socket.create_connection((host, port), timeout=2)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
    chunk = b"\0" * (1 << 20)
    with contextlib.suppress(OSError):  # a receiver that refuses the frame closes the connection
        s.sendall(greeting + b"\x06" + struct.pack(">Q", size))
        for _ in range(min(send_mb, size >> 20)):
            s.sendall(chunk)
    return s


def idle_cpu(agents: int, seconds: float, heartbeat_s: float = 0.25) -> dict[str, Any]:
    """CPU of ``agents`` idle agents (no flows) over ``seconds``, per thread kind."""
    with tempfile.TemporaryDirectory(prefix="ark-idle-") as d:
        wd = Path(d)
        (wd / "api").mkdir()
        cfile, names = write_cluster(wd, agents, heartbeat_s=heartbeat_s, spines=max(4, agents))
        procs = AgentProcs(cfile, names, wd)
        try:
            for n in names:
                procs.start(n)
            procs.wait_ready(names)
            time.sleep(1.0)
            pids = [p.pid for p in procs.procs.values()]
            before, t0 = thread_cpu_s(pids), time.monotonic()
            time.sleep(seconds)
            after, wall = thread_cpu_s(pids), time.monotonic() - t0
        finally:
            procs.stop_all()
    per_thread = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(after)}
    total = sum(per_thread.values())
    return {"agents": agents, "seconds": round(wall, 2), "heartbeat_s": heartbeat_s, "cpu_s": round(total, 3),
            "cpu_s_by_thread": per_thread, "cpu_percent_per_agent": round(100 * total / wall / agents, 3)}


def _valid_stream(b: Bed, target: str, count: int, sign: Any) -> Iterator[bytes]:
    """Reserve/release pairs of X's own flows, signed, stamped now: what a busy honest peer sends."""
    from ark.core.envelope import K_DATA, encode_envelope
    from ark.core.messages import Release, Reserve, encode

    fab = b.cluster.fabric
    xi = b.cluster.host(b.x).index
    dsts = [h.index for h in fab.hosts if fab.hosts[h.index].leaf != fab.hosts[xi].leaf]
    inc = 5
    for k in range(count // 2):
        now = time.time()
        r = Reserve((xi, (inc << 32) + k + 1), now, xi, dsts[k % len(dsts)], 4791, k % fab.n_spines,
                    49152 + k % 16384, 10**6, 1e11, False, now + 2.0)
        for seq, m in ((2 * k + 1, r), (2 * k + 2, Release(r.flow, now))):
            raw = encode(m)
            yield encode_envelope(K_DATA, xi, inc, seq, [raw, sign(raw)])


def per_message(messages: int = 40_000, rate: float = 5000.0, burst: int = 100) -> dict[str, Any]:
    """CPU an agent spends per message it receives: one listed peer sends ``messages`` valid
    reserve/release messages at ``rate``, ``burst`` back to back between pauses (1: each
    message wakes the agent on its own, as on a cluster that is not saturated). The
    target's CPU (all threads) over them, and net of what it spends idle over as long
    (heartbeats), measured just before."""
    from ark.agent.keys import Signatures

    # The peer's reservations live for the retention period after their release: room for
    # all of them, so that every RESERVE is applied (none dropped as over the owner's cap).
    with bed(agents=2, peer_rate=1e7, max_flows_per_host=1 << 20) as b:
        target = b.running[0]
        ctx = zmq.Context()
        try:
            sock = b.as_x(ctx, target)
            time.sleep(0.5)
            _xpub, xsec = zmq.auth.load_certificate(str(b.workdir / "keys" / f"{b.x}.key_secret"))
            assert xsec is not None
            stream = _valid_stream(b, target, messages, Signatures(xsec, {}).sign)  # stamped as sent
            pid = b.pid(target)
            idle = _idle_cpu_per_s(pid, min(3.0, messages / rate))
            base = int(b.procs.status([target])[target]["node"]["received"])
            cpu0, t0 = thread_cpu_s([pid]), time.monotonic()
            for i, data in enumerate(stream):
                sock.send(data)
                if i % burst == burst - 1:
                    time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
            got = _wait_received(b, target, base, messages, 120.0)
            cpu1, wall = thread_cpu_s([pid]), time.monotonic() - t0
            st = b.procs.status([target])[target]
        finally:
            ctx.destroy(0)
    by_thread = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 3) for k in cpu1}
    total = sum(by_thread.values())
    net = max(0.0, total - idle * wall)
    return {"messages": messages, "received": got, "rate": rate, "burst": burst, "seconds": round(wall, 2),
            "cpu_s": round(total, 3), "cpu_s_by_thread": by_thread, "idle_cpu_percent": round(100 * idle, 3),
            "cpu_us_per_message": round(total / max(1, got) * 1e6, 2),
            "net_cpu_us_per_message": round(net / max(1, got) * 1e6, 2),
            "invalid": st["node"]["invalid"] + st["core"]["invalid"], "overflow": st["core"]["overflow"],
            "reservations_left": st["reservations"],
            "codec_us": codec_us()}


def codec_us(repeat: int = 20_000) -> dict[str, float]:
    """Microseconds to decode and check one DATA envelope and the RESERVE inside it: the
    typed (msgspec) paths the agent uses, and the field-by-field reference checks."""
    import timeit

    from ark.core import messages
    from ark.core.envelope import K_DATA, decode_envelope, encode_envelope

    raw = messages.encode(messages.Reserve((3, 17), 1000.5, 3, 5, 4791, 2, 51000, 10**9, 1e11, False, 1010.0))
    env = encode_envelope(K_DATA, 3, 7, 42, [raw, b"s" * 64])
    cases = {"envelope": lambda: decode_envelope(env), "message": lambda: messages.decode(raw),
             "message_reference": lambda: messages.decode_checked(raw)}
    return {k: round(min(timeit.repeat(f, number=repeat, repeat=3)) / repeat * 1e6, 3) for k, f in cases.items()}


def _idle_cpu_per_s(pid: int, seconds: float) -> float:
    """CPU seconds per second a process spends with nothing to do but its timers."""
    c0, t0 = sum(thread_cpu_s([pid]).values()), time.monotonic()
    time.sleep(seconds)
    return (sum(thread_cpu_s([pid]).values()) - c0) / (time.monotonic() - t0)


def control_costs(seconds: float = 10.0, messages: int = 20_000, sizes: tuple[int, int] = (4, 12)) -> dict[str, Any]:
    """The terms of the control-plane cost model (``ark.sim.control_cost.AgentCost``),
    measured here: CPU per received data message (:func:`per_message`), and from idle
    agents at two cluster sizes, a fixed base and the cost per peer heartbeat (one HELLO
    received and one sent). A published copy is taken to cost what a heartbeat costs
    beyond receiving one (the same socket path, without the apply)."""
    msg = per_message(messages=messages, rate=5000.0)
    # Two sizes far enough apart, each long enough, that the CPU clock's 10 ms ticks do not
    # decide the slope.
    (n_small, n_large), hb = sizes, 0.25
    small, large = idle_cpu(n_small, seconds), idle_cpu(n_large, seconds)
    slope = (large["cpu_percent_per_agent"] - small["cpu_percent_per_agent"]) / ((n_large - n_small) / hb)  # % per peer-heartbeat/s
    per_hb_us = max(0.0, slope * 1e4)
    base = max(0.0, small["cpu_percent_per_agent"] - (n_small - 1) / hb * per_hb_us / 1e4)
    per_msg_us = float(msg["cpu_us_per_message"])
    return {"per_message_us": round(per_msg_us, 2), "per_peer_heartbeat_us": round(per_hb_us, 2),
            "per_copy_us": round(max(1.0, per_hb_us - per_msg_us), 2), "base_percent": round(base, 3),
            "measured": {"per_message": msg, "idle_small": small, "idle_large": large}}


def _transport_sender(endpoint: str, server_key: bytes, messages: int, rate: float) -> None:
    """The peer of :func:`transport_floor`: a CURVE DEALER sending ``messages`` small frames."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.curve_serverkey = server_key
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    time.sleep(0.5)  # the CURVE handshake
    t0, body = time.monotonic(), b"x" * 120
    for i in range(messages):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        s.send(body)
    s.send(b"")
    time.sleep(0.5)
    ctx.destroy(0)


def transport_floor(messages: int = 15_000, rate: float = 1500.0) -> dict[str, Any]:
    """What ZeroMQ with CURVE costs per message before an agent does any work: a ROUTER
    that polls and receives one message per wakeup, as an agent does on a quiet cluster.
    The receiving process's CPU (main and I/O threads) per message: this machine's speed
    in the unit every agent figure is in."""
    import multiprocessing

    ctx = zmq.Context()
    pub, sec = zmq.curve_keypair()
    r = ctx.socket(zmq.ROUTER)
    r.curve_secretkey, r.curve_publickey, r.curve_server = sec, pub, True
    port = r.bind_to_random_port("tcp://127.0.0.1")
    sender = multiprocessing.get_context("spawn").Process(
        target=_transport_sender, args=(f"tcp://127.0.0.1:{port}", pub, messages, rate), daemon=True)
    sender.start()
    poller = zmq.Poller()
    poller.register(r, zmq.POLLIN)
    got, cpu0, t0, done = 0, 0.0, 0.0, False
    t_start = time.monotonic()
    deadline = t_start + 60 + messages / rate
    try:
        while not done and time.monotonic() < deadline:
            if not poller.poll(1000):
                continue
            if not got:
                cpu0, t0 = time.process_time(), time.monotonic()
            while not done and readable(r):  # the agent's own readiness check
                frames = r.recv_multipart(copy=False)
                done = not frames[-1].bytes
                got += not done
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    finally:
        sender.join(5)
        ctx.destroy(0)
    if not got:
        raise AgentTimeout(f"transport: no message arrived from the sender within {deadline - t_start:.0f} s")
    return {"messages": got, "rate": rate, "seconds": round(wall, 2), "cpu_s": round(cpu, 3),
            "cpu_us_per_message": round(cpu / max(1, got) * 1e6, 2)}
