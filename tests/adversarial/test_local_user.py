"""A local user against a real agent: its metrics endpoint, its API socket, its leases.

Real agent processes (``python -m ark agent``), real TCP and Unix sockets, real clients.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ark.agent import cluster as clmod
from ark.agent.bench import Bed, bed
from ark.agent.client import ArkClient
from ark.agent.holders import CHECK_S
from ark.agent.loopback import AgentProcs, write_cluster
from ark.agent.metrics import SCRAPE_TIMEOUT_S, SCRAPES_AT_ONCE

FD_LIMIT = 1024
IDLE = 1100  # more idle connections than the agent has descriptors


@pytest.fixture(scope="module")
def metered(tmp_path_factory) -> Iterator[tuple[AgentProcs, str, int]]:
    """One agent with a metrics port, under a 1,024-descriptor limit."""
    wd = tmp_path_factory.mktemp("metered")
    (wd / "api").mkdir(mode=0o700)
    cfile, names = write_cluster(wd, 1, metrics=True)
    procs = AgentProcs(cfile, names, wd, fd_limit=FD_LIMIT)
    procs.start(names[0])
    try:
        procs.wait_ready(names)
        port = clmod.load(cfile).host(names[0]).metrics_port
        assert port is not None
        yield procs, names[0], port
    finally:
        procs.stop_all()


def _scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _node(procs: AgentProcs, name: str) -> dict:
    return procs.status([name])[name]["node"]


@contextlib.contextmanager
def _descriptors(n: int) -> Iterator[None]:
    """This process may hold ``n`` descriptors for a while."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n)), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_scrape_is_valid_prometheus_text(metered) -> None:
    port = metered[2]
    status, text = _scrape(port)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert status == 200 and {"ark_reservations", "ark_invalid_messages", "ark_reserved_links",
                              "ark_reserve_propagation_seconds"} <= names, names
    assert _scrape(port, "/nosuch")[0] == 404


def test_idle_connections_to_the_metrics_port_are_shed_within_the_descriptor_budget(metered) -> None:
    """1,100 idle connections to an agent limited to 1,024 descriptors: it keeps at most
    its cap of them, sheds the rest as they come, stays up, answers, and scrapes after."""
    procs, name, port = metered
    pid = procs.procs[name].pid
    before = _node(procs, name)
    socks: list[socket.socket] = []
    reset = 0  # shed so fast that the reset came before connect() returned
    with _descriptors(IDLE + 256):
        try:
            for _ in range(IDLE):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except ConnectionResetError:
                    reset += 1
            time.sleep(0.2)
            during = _node(procs, name)  # the local API answers during the flood
            agent_fds = len(os.listdir(f"/proc/{pid}/fd"))
        finally:
            for s in socks:
                s.close()
    assert procs.procs[name].poll() is None
    assert len(socks) + reset == IDLE and agent_fds < FD_LIMIT - 256, agent_fds
    assert during["metrics_open"] <= SCRAPES_AT_ONCE
    assert during["metrics_shed"] - before["metrics_shed"] >= IDLE - 2 * SCRAPES_AT_ONCE, during
    status, text = _scrape(port)
    assert status == 200 and "ark_reservations_total" in text


def test_half_a_request_is_closed_after_the_timeout(metered) -> None:
    """A slow loris: a request line, then one header byte every 0.2 s, never the end."""
    procs, name, port = metered
    before = _node(procs, name)["metrics_timed_out"]
    s = socket.create_connection(("127.0.0.1", port), timeout=0.2)
    t0 = time.monotonic()
    closed = None
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        while time.monotonic() - t0 < SCRAPE_TIMEOUT_S + 3:
            try:
                s.sendall(b"X")
                if s.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the agent
                closed = time.monotonic() - t0
                break
    finally:
        s.close()
    assert closed is not None and SCRAPE_TIMEOUT_S - 0.3 <= closed <= SCRAPE_TIMEOUT_S + 1.0, closed
    assert _node(procs, name)["metrics_timed_out"] == before + 1
    assert _scrape(port)[0] == 200


def _spellings(d: Path) -> dict[str, str]:
    """The first agent's API socket, written three more ways."""
    (d / "link").symlink_to(d / "api")
    return {"doubled slash": f"ipc://{d}/api//gpu0.sock", "symlinked directory": f"ipc://{d}/link/gpu0.sock",
            "relative": "ipc://api/./gpu0.sock"}


def test_a_second_agent_never_takes_over_a_live_api_socket(tmp_path) -> None:
    """The same socket spelled another way by a second agent: it refuses in one line, and
    the first keeps its socket and answers."""
    (tmp_path / "api").mkdir(mode=0o700)
    cfile, names = write_cluster(tmp_path, 2)
    procs = AgentProcs(cfile, names, tmp_path)
    procs.start(names[0])
    try:
        procs.wait_ready(names[:1])
        text = cfile.read_text()
        for how, api in _spellings(tmp_path).items():
            other = tmp_path / f"other-{how.replace(' ', '-')}.toml"
            # gpu1's entry points at gpu0's socket; gpu0's elsewhere, so that the file is valid.
            other.write_text(text.replace(f'"ipc://{tmp_path}/api/gpu0.sock"', f'"ipc://{tmp_path}/api/unused.sock"')
                             .replace(f'"ipc://{tmp_path}/api/gpu1.sock"', f'"{api}"'))
            p = subprocess.run([sys.executable, "-m", "ark", "agent", "--cluster", str(other), "--host", names[1]],
                               capture_output=True, text=True, timeout=20, cwd=tmp_path)
            assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, (how, p.stderr)
            assert f"api: {api} is served by another running agent" in p.stderr, (how, p.stderr)
            assert (tmp_path / "api" / "gpu0.sock").exists(), how
            with ArkClient(procs.api(names[0]), timeout_s=2.0) as c:
                assert c.status()["name"] == names[0], how
    finally:
        procs.stop_all()
    assert not (tmp_path / "api" / "gpu0.sock").exists()  # removed by its own agent at exit


def test_two_spellings_of_one_api_socket_in_a_cluster_file_are_refused(tmp_path) -> None:
    cfile, _ = write_cluster(tmp_path, 2)
    text = cfile.read_text().replace(f"{tmp_path}/api/gpu1.sock", f"{tmp_path}/api//gpu0.sock")
    cfile.write_text(text)
    with pytest.raises(clmod.ClusterError, match=r"^hosts\[1\]\.api: the same as hosts\[0\]'s"):
        clmod.load(cfile)


_HOLDERS = {
    # Renewed in the background like an engine's lease: its connections are open when it dies.
    "renewing": """
import sys, time
from ark.agent.client import ArkClient
with ArkClient(sys.argv[1]).lease(sys.argv[2], 10**12) as held:
    print(held.flow_id[0], held.flow_id[1], flush=True)
    time.sleep(600)
""",
    # A multi-path lease of four parts (one finds every path taken: plain ECMP, in no
    # table): every part is released.
    "split": """
import sys, time
from ark.agent.client import ArkClient
with ArkClient(sys.argv[1]).lease(sys.argv[2], 10**12, parts=4) as held:
    assert sum(p.reserved for p in held.parts) == 3
    print(*(v for p in held.parts if p.reserved for v in p.flow_id), flush=True)
    time.sleep(600)
""",
    # Reserved, then its connection closed: nothing on the API socket tells its death.
    "closed": """
import sys, time
from ark.agent.client import ArkClient
with ArkClient(sys.argv[1]) as c:
    lease = c.reserve(sys.argv[2], 10**12)
print(lease.flow_id[0], lease.flow_id[1], flush=True)
time.sleep(600)
""",
}


def _flows(b: Bed) -> dict[str, set[tuple[int, int]]]:
    return b.procs.tables(b.running)


def _killed_holder(b: Bed, script: str) -> float:
    """Start a client process that holds a lease of minutes, SIGKILL it: seconds until no
    agent's table has its flow."""
    src, dst = b.running
    p = subprocess.Popen([sys.executable, "-c", script, b.procs.api(src), dst], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, "the client did not get a lease"
        vals = [int(v) for v in line.split()]
        flows = set(zip(vals[::2], vals[1::2], strict=True))
        deadline = time.monotonic() + 5
        while not all(flows <= f for f in _flows(b).values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(flows <= f for f in _flows(b).values())
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while any(flows & f for f in _flows(b).values()) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        return time.monotonic() - t0
    finally:
        p.kill()
        p.wait()


def test_the_leases_of_a_killed_client_are_released_within_the_bound() -> None:
    """A client process holding a lease of minutes is SIGKILLed: its agent releases the
    flow, and the peer sees the RELEASE, within CHECK_S. A client that only closed its
    connection (its process alive) keeps its lease."""
    with bed(agents=2) as b:
        src, dst = b.running
        with ArkClient(b.procs.api(src)) as c:
            mine = c.reserve(dst, 10**12)  # this process stays alive: its flow must stay
        released = {how: _killed_holder(b, script) for how, script in _HOLDERS.items()}
        assert all(s <= CHECK_S + 0.3 for s in released.values()), released
        time.sleep(CHECK_S + 0.2)  # a full periodic check later, the live process's flow is there
        assert all(mine.flow_id in f for f in _flows(b).values())
        # One flow per single-path holder, four for the multi-path one.
        assert b.procs.status([src])[src]["node"]["vanished_client_releases"] == len(_HOLDERS) + 3


def test_a_clients_identity_is_looked_up_once_per_connection_and_again_after_a_close() -> None:
    """The agent reads a client's pid and /proc entry on its connection's first request
    only; any connection closing makes it look every client up again (a process that is
    gone is never taken from the cache). Its flows are held all the same."""
    with bed(agents=2) as b:
        src, dst = b.running
        with ArkClient(b.procs.api(src)) as c:
            c.status()
            time.sleep(0.3)  # the connections of earlier clients (readiness) have closed
            base = c.status()["node"]["client_lookups"]
            for _ in range(30):
                lease = c.reserve(dst, 10**6)
                c.renew(lease.flow_id)
                c.release(lease.flow_id)
            assert c.status()["node"]["client_lookups"] == base
            with ArkClient(b.procs.api(src)) as other:
                other.status()  # a second connection: looked up once
            time.sleep(0.3)  # its close empties the cache
            held = c.reserve(dst, 10**6)
            assert c.status()["node"]["client_lookups"] == base + 2
            assert held.flow_id in b.procs.tables([src])[src]
