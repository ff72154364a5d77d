"""Connection leases (ark.integrations.connlease): real agents on loopback, a holder answering
the connect() interposer's lease rules, and a preloaded process that opens, keeps, closes and
idles real TCP connections; the holder follows them in this namespace's socket table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ark.agent.client import ArkClient, ArkClientError
from ark.integrations import preload
from ark.integrations.connlease import ConnLeases, _parse_ask, handle, serve, socket_table
from ark.integrations.preload import EnvRule, steer_rules
from tests.integrations.conftest import two_agents


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[str]:
    """gpu0's local API; gpu1 is behind another leaf."""
    with two_agents(tmp_path, lease_min_s=2.0) as path:  # leases outlive a loaded machine's pauses
        yield path


CHILD = """
import json, socket, sys, time
conns = []
def dial():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # as UCX does: the interposer defers it to connect()
    s.connect(("127.0.0.1", DPORT))
    conns.append(s)
    return s.getsockname()[1]
ports = [dial(), dial()]
from ark.integrations.preload import env_status
print(json.dumps({"ports": ports, "leases": env_status().leases}), flush=True)
for line in sys.stdin:  # "close": close the first; "send": move bytes on the second; "quit"
    cmd = line.strip()
    if cmd == "close":
        conns[0].close()
    elif cmd == "send":
        conns[1].sendall(b"x" * 1000)
    elif cmd == "quit":
        break
    print("ok", flush=True)
"""


def _listener() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []

    def run() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            held.append(c)
            threading.Thread(target=lambda c=c: [None for _ in iter(lambda: c.recv(65536), b"")], daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return srv, srv.getsockname()[1]


def _sweep_until(leases: ConnLeases, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, leases.state()
        leases.sweep(socket_table(), time.monotonic())
        time.sleep(0.05)


def test_each_connection_gets_a_lease_of_its_own_on_distinct_paths_held_while_it_lives(api, tmp_path) -> None:
    srv, dport = _listener()
    sock = str(tmp_path / "connlease.sock")
    stop = threading.Event()
    with ArkClient(api) as client:
        leases = ConnLeases(client, {"127.0.0.1": "gpu1"}, nbytes=1 << 20, idle_s=0.6)
        serve(sock, leases, stop)
        env = preload.preload_env(dict(os.environ, ARK_STEER_RULES=steer_rules([EnvRule("127.0.0.1", dport=dport,
                                                                                         lease=sock)])))
        child = subprocess.Popen([sys.executable, "-c", CHILD.replace("DPORT", str(dport))], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None and child.stdin is not None
            out = json.loads(child.stdout.readline())
            assert out["leases"] == [[2, 2, 0]]  # two asked, two on leased ports
            live = sorted(leases.live.values(), key=lambda c: c.sport)
            assert sorted(c.sport for c in live) == sorted(out["ports"]) and all(c.state == "held" for c in live)
            assert len({c.path for c in live}) == 2  # one peer pair, two paths
            leases.sweep(socket_table(), time.monotonic())
            assert len(leases.live) == 2, leases.state()  # both still open: renewed
            first = next(c for c in live if c.sport == out["ports"][0])
            child.stdin.write("close\n")
            child.stdin.flush()
            child.stdout.readline()
            _sweep_until(leases, lambda: first.state == "closed")
            with pytest.raises(ArkClientError):
                client.renew(first.flow)  # released at the agent
            second = next(c for c in live if c is not first)
            for _ in range(3):  # bytes keep it held past idle_s ...
                child.stdin.write("send\n")
                child.stdin.flush()
                child.stdout.readline()
                time.sleep(0.3)
                leases.sweep(socket_table(), time.monotonic())
            assert second.state == "held"
            _sweep_until(leases, lambda: second.state == "idle")  # ... and none gives it back
            assert leases.live == {}
            child.stdin.write("quit\n")
            child.stdin.flush()
        finally:
            stop.set()
            child.kill()
            child.wait()
            srv.close()


def test_the_holder_refuses_what_it_cannot_place_and_drops_malformed_asks(api) -> None:
    assert _parse_ask("ask 10.0.0.1 80") == ("10.0.0.1", 80)
    for bad in ("ask 10.0.0.1", "ask 10.0.0.999 80", "ask 10.0.0.1 0", "ask 10.0.0.1 99999", "give 1.2.3.4 5", ""):
        assert _parse_ask(bad) is None
    with ArkClient(api) as client:
        leases = ConnLeases(client, {"127.0.0.1": "gpu1"}, max_conns=1)
        assert "no host of this cluster" in str(leases.ask("10.9.9.9", 80, 0.0))
        got = leases.ask("127.0.0.1", 80, 0.0)
        assert not isinstance(got, str)
        assert "1 connection leases held" in str(leases.ask("127.0.0.1", 80, 0.0))
        leases.sweep({}, 10.0)  # asked, never opened: released after PENDING_S
        assert leases.live == {} and leases.ended[-1].state == "failed" and leases.refused == 2
        for line, want in ((b"ask 127.0.0.1 80\nfail\n", "failed"), (b"junk\n", "malformed"), (b"x" * 300, "malformed")):
            a, b = socket.socketpair()
            a.sendall(line)
            assert handle(b, leases) == want
            a.close()
        assert leases.live == {}


def test_lease_rules_are_checked_and_an_absent_holder_leaves_the_engine_s_own_port(tmp_path) -> None:
    assert steer_rules([EnvRule("10.0.1.1", dport=15100, lease="/run/ark/c.sock")]) == "10.0.1.1:15100=lease:/run/ark/c.sock"
    with pytest.raises(preload.SteerRulesError, match="lease"):
        steer_rules([EnvRule("10.0.1.1", ((1,),), lease="/x")])
    srv, dport = _listener()
    env = preload.preload_env(dict(os.environ, ARK_STEER_RULES=f"127.0.0.1:{dport}=lease:{tmp_path}/none.sock"))
    code = textwrap.dedent(f"""
        import json, socket
        from ark.integrations.preload import env_status
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.connect(("127.0.0.1", {dport}))
        print(json.dumps({{"port": s.getsockname()[1], "leases": env_status().leases}}))
    """)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30, check=True)
    out = json.loads(res.stdout)
    assert out["port"] != 0 and out["leases"] == [[1, 0, 1]]  # asked, no holder: the engine's own port
    srv.close()



def test_a_holder_that_hangs_up_mid_exchange_costs_the_engine_nothing(tmp_path) -> None:
    """A holder that answers ports and hangs up before hearing which one: the engine's
    connection still takes the port, and its process is not killed by SIGPIPE."""
    srv, dport = _listener()
    lport = dport + 1 if dport < 60000 else dport - 1
    path = str(tmp_path / "rude.sock")
    rude = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rude.bind(path)
    rude.listen(4)

    def answer() -> None:
        conn, _ = rude.accept()
        conn.makefile("rb").readline()
        conn.sendall(f"ports {lport}\n".encode())
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    env = preload.preload_env(dict(os.environ, ARK_STEER_RULES=f"127.0.0.1:{dport}=lease:{path}"))
    code = textwrap.dedent(f"""
        import json, socket, time
        from ark.integrations.preload import env_status
        time.sleep(0.2)
        s = socket.socket(); s.connect(("127.0.0.1", {dport}))
        print(json.dumps({{"port": s.getsockname()[1], "leases": env_status().leases}}))
    """)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out == {"port": lport, "leases": [[1, 1, 0]]}
    rude.close()
    srv.close()
