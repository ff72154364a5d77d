"""NIXL over UCX's TCP transport on the namespace testbed: one agent holds KV blocks (the
prefill side), another reads them with a NIXL READ (the decode side, as vLLM's
``NixlConnector`` pulls), and the spine counters say which path the bytes took.

Which connection carries the KV bytes (checked here with ``strace``, ``ss`` and the spine
counters, and in UCX's ``uct_tcp`` connection manager): the decode side starts the
transfer, the prefill side sends the bytes, and which of the two opened the connection
they travel on depends on who loaded whose metadata.

* **Only the decode side loads the peer's metadata** (vLLM's ``NixlConnector``: the
  decode worker fetches the prefill's over its side channel): the decode's UCX connects to
  the prefill's listener and the prefill answers on that same connection. The KV bytes go
  prefill -> decode on the reverse of a 4-tuple the *decode* chose: ECMP at the prefill's
  leaf hashes (prefill, listener port) -> (decode, the decode's source port). Steer the
  decode process, with source ports taken from a map of that reverse direction
  (:func:`reply_paths`: probes from the prefill host, all from the listener's port, one per
  destination port).
* **Both sides load each other's metadata** (``mutual``): both connect at once, UCX keeps
  each side's own connection for what that side sends, and the KV bytes go on the
  connection the *prefill* opened to the decode's listener: steer the prefill process with
  a map of the forward direction, as for any sender.

``UCX_TCP_PORT_RANGE=P-P`` fixes the listener port so that a map can cover it (the ECMP
hash includes it). ``python -m ark.testbed.nixl hold`` and ``... read`` are the two ends;
:func:`run_pair` starts them in two hosts of a running testbed, counting at the spines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError, spawn_in_host

DEFAULT_LISTEN_PORT = 15100
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # the data interface only (not mgmt0, not lo)


def ucx_env(listen_port: int = DEFAULT_LISTEN_PORT, workers: int = 1) -> dict[str, str]:
    """UCX over TCP on the data interface, its ``workers`` listeners on ports
    ``listen_port .. listen_port + workers - 1`` (one UCX worker each)."""
    if not 1024 <= listen_port <= 0xFFFF - workers or not 1 <= workers <= 16:
        raise TestbedError(f"listen_port: expected 1024..{0xFFFF - workers}, workers 1..16; got {listen_port}, {workers}")
    return {**UCX_TCP, "UCX_TCP_PORT_RANGE": f"{listen_port}-{listen_port + workers - 1}"}


def pattern(seed: int, nbytes: int) -> Any:
    import numpy as np

    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def blocks(nbytes: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of ``n`` nearly equal blocks covering ``nbytes`` (no empty one)."""
    n = max(1, min(n, nbytes))
    q, r = divmod(nbytes, n)
    out, pos = [], 0
    for i in range(n):
        size = q + (i < r)
        out.append((pos, size))
        pos += size
    return out


def _agent(name: str, workers: int) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    ag = nixl_agent(name, nixl_agent_config(backends=[]))
    ag.create_backend("UCX", {"num_workers": str(workers)})
    return ag


def _publish(d: Path, name: str, ag: Any, addr: int) -> None:
    tmp = d / f"{name}.tmp"
    tmp.write_text(json.dumps({"addr": addr, "meta": ag.get_agent_metadata().hex()}))
    tmp.replace(d / f"{name}.json")


def _peer(d: Path, name: str, deadline: float) -> dict[str, Any]:
    f = d / f"{name}.json"
    while not f.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nixl: {name} published no metadata")
        time.sleep(0.02)
    out: dict[str, Any] = json.loads(f.read_text())
    return out


def hold(d: Path, name: str, nbytes: int, seed: int, workers: int, timeout_s: float, peer: str = "") -> int:
    """The prefill side: register ``nbytes`` of the seed's pattern, publish, wait to be read
    (``peer``: load that agent's metadata too, as a mutual exchange does)."""
    buf = pattern(seed, nbytes).copy()
    ag = _agent(name, workers)
    ag.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    _publish(d, name, ag, buf.ctypes.data)
    deadline = time.monotonic() + timeout_s
    if peer:
        ag.add_remote_agent(bytes.fromhex(_peer(d, peer, deadline)["meta"]))
    while not (d / "read.done").exists() and time.monotonic() < deadline:
        ag.get_new_notifs()  # progress: UCX answers the reads from this thread too
        time.sleep(0.01)
    return 0


def read(d: Path, name: str, peer: str, nbytes: int, nblocks: int, seed: int, workers: int,
         timeout_s: float) -> int:
    """The decode side: READ the peer's blocks into its own buffer, check every byte, say so."""
    import numpy as np

    buf = np.zeros(max(1, nbytes), dtype=np.uint8)
    ag = _agent(name, workers)
    ag.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    _publish(d, name, ag, buf.ctypes.data)
    deadline = time.monotonic() + timeout_s
    info = _peer(d, peer, deadline)
    remote = ag.add_remote_agent(bytes.fromhex(info["meta"]))
    parts = blocks(nbytes, nblocks)
    local = ag.get_xfer_descs([(buf.ctypes.data + o, n, 0) for o, n in parts], "DRAM")
    far = ag.get_xfer_descs([(info["addr"] + o, n, 0) for o, n in parts], "DRAM")
    t0 = time.time()
    h = ag.initialize_xfer("READ", local, far, remote, b"read")
    state = ag.transfer(h)
    while state == "PROC" and time.monotonic() < deadline:
        state = ag.check_xfer_state(h)
        time.sleep(0.001)
    t1 = time.time()
    ok = state == "DONE" and bool(np.array_equal(buf[:nbytes], pattern(seed, nbytes)))
    (d / "read.json").write_text(json.dumps({"state": state, "ok": ok, "t0": t0, "t1": t1, "blocks": len(parts)}))
    (d / "read.done").write_text("1")
    return 0 if ok else 1


# ---------------------------------------------------------------------------- driver
@dataclass
class PairRun:
    """One READ between two testbed hosts: its verdict, when the bytes moved, and per KV
    connection (source port at the prefill host) the payload bytes each spine carried."""

    ok: bool
    state: str
    t0: float
    t1: float
    connections: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)  # (sport, dport) -> spine -> bytes
    steer_log: list[str] = field(default_factory=list)

    def spine_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for per in self.connections.values():
            for k, b in per.items():
                out[k] = out.get(k, 0) + b
        return out


def _spawn(st: State, host: int, argv: list[str], log: Path, env: Mapping[str, str]) -> Any:
    return spawn_in_host(st, host, [sys.executable, "-m", "ark.testbed.nixl", *argv], log, env=dict(env))


def run_pair(st: State, src: int, dst: int, nbytes: int, work: Path, *, nblocks: int = 8, workers: int = 1,
             listen_port: int = DEFAULT_LISTEN_PORT, hold_env: Mapping[str, str] | None = None,
             read_env: Mapping[str, str] | None = None, mutual: bool = False, timeout_s: float = 120.0) -> PairRun:
    """Host ``src`` holds ``nbytes`` (the prefill side), host ``dst`` reads them (the decode
    side); ``hold_env``/``read_env`` are added to each side's environment (the interposer and
    its rules); ``mutual``: the prefill side loads the decode's metadata too. The spines
    count while it runs; ``connections`` are the KV bytes' 4-tuples, from ``src``."""
    from ark.testbed.capture import counting

    work.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        f.unlink()
    base = {**os.environ, **ucx_env(listen_port, workers)}
    common = ["--dir", str(work), "--bytes", str(nbytes), "--seed", str(src), "--workers", str(workers),
              "--timeout", str(timeout_s)]
    with counting(st) as counters:
        holder = _spawn(st, src, ["hold", "--name", "prefill", "--peer", "decode" if mutual else "", *common],
                        work / "hold.log", {**base, **(hold_env or {})})
        reader = _spawn(st, dst, ["read", "--name", "decode", "--peer", "prefill", "--blocks", str(nblocks), *common],
                        work / "read.log", {**base, **(read_env or {})})
        try:
            reader.wait(timeout_s + 30)
            holder.wait(30)
        finally:
            for p in (reader, holder):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    res_file = work / "read.json"
    if not res_file.exists():
        raise TestbedError(f"nixl: the reader wrote no result; see {work / 'read.log'}")
    res = json.loads(res_file.read_text())
    lay = st.layout
    src_ip, dst_ip = lay.host_ip(src), lay.host_ip(dst)
    run = PairRun(bool(res["ok"]), str(res["state"]), float(res["t0"]), float(res["t1"]))
    for k, table in enumerate(counters.bytes):
        for (a, sport, b, dport), ivs in table.items():
            if a == src_ip and b == dst_ip:  # from the holder: its listener's (pull) or its own (mutual) port
                per = run.connections.setdefault((int(sport), int(dport)), {})
                per[k] = per.get(k, 0) + int(sum(iv[2] for iv in ivs))
    log = {**(hold_env or {}), **(read_env or {})}.get("ARK_STEER_LOG")
    if log and Path(log).exists():
        run.steer_log = Path(log).read_text().splitlines()
    return run


def free_listen_port(st: State, hosts: Sequence[int], candidates: Sequence[int]) -> int:
    """The first of ``candidates`` that every one of ``hosts`` can bind a listener to. UCX's
    listener does not set ``SO_REUSEADDR``, so a port whose earlier connections the listening
    side closed first stays unusable for a minute (``TIME_WAIT``)."""
    import socket

    lay = st.layout
    for port in candidates:
        ok = True
        for h in hosts:
            with netns.inside(lay.host_ns(h)):
                s = socket.socket()
            try:
                s.bind((lay.host_ip(h), port))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            return port
    raise TestbedError(f"nixl: no free listener port among {list(candidates)[:1]}..{list(candidates)[-1:]}")


def forward_paths(st: State, src: int, dst: int, dport: int, ports: Sequence[int]) -> dict[int, int]:
    """Source port of host ``src`` -> the spine its TCP connections to ``dst``:``dport`` take
    (TTL-limited probes from ``src``'s namespace; ports with no answer are absent)."""
    return _probe(st, src, dst, list(ports), dport=dport)


def reply_paths(st: State, src: int, dst: int, listen_port: int, ports: Sequence[int]) -> dict[int, int]:
    """Source port of a connection host ``dst`` opens to ``src``'s listener on ``listen_port``
    -> the spine that the bytes ``src`` sends back on it take. Probes leave ``src`` from
    ``listen_port`` towards each port (run them before the listener binds that port)."""
    return _probe(st, src, dst, list(ports), sport=listen_port)


def _probe(st: State, src: int, dst: int, ports: list[int], dport: int = 0, sport: int = 0) -> dict[int, int]:
    from ark.agent.probe import probe_ports

    lay = st.layout
    with netns.inside(lay.host_ns(src)):
        res = probe_ports(lay.host_ip(dst), dport, ports, src_ip=lay.host_ip(src), sport=sport)
    routers = lay.routers()
    return {p: routers[ip] for p, ip in res.offenders.items() if ip in routers}


@contextlib.contextmanager
def leased(st: State, src: int, dst: int, work: Path, listen_port: int = DEFAULT_LISTEN_PORT, *,
           idle_s: float = 30.0, sample: int = 128) -> Iterator[tuple[dict[str, str], Path]]:
    """Agents on every host (``src``'s maps probed towards ``dst``:``listen_port``) and a
    connection-lease holder beside ``src``: yields the environment that makes a process on
    ``src`` lease each of its connections to ``dst``'s listener, and the holder's state file."""
    from ark.agent.client import wait_ready
    from ark.integrations import preload
    from ark.testbed.plan import cluster_file
    from ark.testbed.probing import probe

    work.mkdir(parents=True, exist_ok=True)
    cluster = cluster_file(st, "ark", 2.0, sample)
    probe(st, {src: {dst}}, sample, cluster, dport=listen_port)
    procs, apis = [], {}
    lay = st.layout
    try:
        for i in range(st.spec.leaves * st.spec.gpus_per_leaf):
            procs.append(spawn_in_host(st, i, [sys.executable, "-m", "ark", "agent", "--cluster", str(cluster), "--host",
                                               f"gpu{i}", "--log-level", "warning"], work / f"agent-gpu{i}.log"))
            apis[i] = f"ipc://{st.dir}/api/gpu{i}.sock"
        wait_ready(list(apis.values()), 60.0)
        sock, state = work / "connlease.sock", work / "connlease.json"
        sock.unlink(missing_ok=True)
        procs.append(spawn_in_host(st, src, [sys.executable, "-m", "ark.integrations.connlease", "--agent", apis[src],
                                             "--socket", str(sock), "--hosts", f"{lay.host_ip(dst)}=gpu{dst}",
                                             "--state", str(state), "--idle", str(idle_s)], work / "connlease.log"))
        deadline = time.monotonic() + 30
        while not sock.exists():
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise TestbedError(f"connection-lease holder did not start; see {work / 'connlease.log'}")
            time.sleep(0.05)
        rule = preload.EnvRule(lay.host_ip(dst), dport=listen_port, lease=str(sock))
        yield {"LD_PRELOAD": str(preload.library()), "ARK_STEER_RULES": preload.steer_rules([rule])}, state
    finally:
        for p in reversed(procs):  # the holder first: it releases what it holds
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except Exception:
                    p.kill()
                    p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ark.testbed.nixl")
    ap.add_argument("role", choices=("hold", "read"))
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--peer", default="", help="read: the holder; hold: the reader, to load its metadata too")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    if not 1 <= a.bytes <= 1 << 32 or not 1 <= a.workers <= 16 or not 1 <= a.blocks <= 4096:
        ap.error("--bytes 1..4 GiB, --workers 1..16, --blocks 1..4096")
    d = Path(a.dir)
    if a.role == "hold":
        return hold(d, a.name, a.bytes, a.seed, a.workers, a.timeout, a.peer)
    return read(d, a.name, a.peer, a.bytes, a.blocks, a.seed, a.workers, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
