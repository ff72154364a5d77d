"""The steered Mooncake engine on loopback: real engines, real agents, real sockets.

Loopback has no fabric, so paths are checked against the agent's own map (which port
leads where); the namespace testbed checks them against spine counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ark.agent import cluster as clmod
from ark.agent.client import ArkClient
from ark.agent.loopback import AgentProcs, write_cluster
from ark.integrations import preload
from ark.integrations.mooncake import SteeredTransferEngine, SteeringError, parse_target, pool_enabled

pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")

RECEIVER = """
import json, sys, time, os
import numpy as np
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.2", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(1 << 24, dtype=np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
ready, done = sys.argv[1], sys.argv[2]
with open(ready + ".tmp", "w") as f:
    json.dump({"rpc": e.get_rpc_port(), "addr": buf.ctypes.data}, f)
os.replace(ready + ".tmp", ready)
while not os.path.exists(done):
    time.sleep(0.05)
n = int(open(done).read())
expect = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
print(json.dumps({"verified": bool(np.array_equal(buf[:n], expect)), "n": n}))
"""

SENDER = """
import json, sys
import numpy as np
from mooncake.engine import TransferEngine
from ark.integrations.mooncake import SteeredTransferEngine
from ark.integrations.preload import Rule, loaded

def time_wait_ports(rport):
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "06" and int(f[2].split(":")[1], 16) == rport:
            out.add(int(f[1].split(":")[1], 16))
    return sorted(out)

info, api, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
target = f"127.0.0.2:{info['rpc']}"
n = 4 << 20
src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
if mode == "steered":  # as a serving engine would: the wrapper in place of TransferEngine
    plain = eng = SteeredTransferEngine(agent=api, hosts={"127.0.0.2": "gpu1"})
elif mode == "split":  # a multi-path lease of two parts per transfer
    plain = eng = SteeredTransferEngine(agent=api, hosts={"127.0.0.2": "gpu1"}, parts=2)
elif mode == "polled":  # the same, each request submitted on its own and its status polled
    plain = eng = SteeredTransferEngine(agent=api, hosts={"127.0.0.2": "gpu1"}, parts=2, poll_s=0.002)
else:
    plain = TransferEngine()
assert plain.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert plain.register_memory(src.ctypes.data, n) == 0
if mode == "steered":
    q = n // 4
    rc = eng.batch_transfer_sync_write(target, [src.ctypes.data + i * q for i in range(4)],
                                       [info["addr"] + i * q for i in range(4)], [q] * 4)
    t = eng.last_transfer()
    rc2 = eng.transfer_sync_write(target, src.ctypes.data, info["addr"], q)
    t2 = eng.last_transfer()
    out = {"rc": [rc, rc2], "time_wait": time_wait_ports(t.dport)}
    for k, x in (("batch", t), ("single", t2)):
        out[k] = {"dport": x.dport, "path": x.lease.path if x.lease else None, "port_paths": x.port_paths, "ecmp": x.ecmp, "flow": list(x.lease.flow_id) if x.lease else None,
                  "ports": x.ports, "steered": x.steered, "error": x.error,
                  "conns": [[c.sport, c.dport, c.steered] for c in x.connections]}
elif mode in ("split", "polled"):
    q = n // 8
    rc = eng.batch_transfer_sync_write(target, [src.ctypes.data + i * q for i in range(8)],
                                       [info["addr"] + i * q for i in range(8)], [q] * 8)
    t = eng.last_transfer()
    out = {"rc": [rc], "dport": t.dport, "paths": [le.path for le in t.leases], "reserved": [le.reserved for le in t.leases],
           "port_paths": t.port_paths, "port_parts": t.port_parts, "parts_used": t.connection_parts(),
           "steered": t.steered, "error": t.error, "repathed": t.repathed,
           "conns": [[c.sport, c.dport, c.steered] for c in t.connections]}
else:  # the plain engine in a preloaded process (its own default, pooled lanes, or one-shot): observed only
    if loaded():
        with Rule("127.0.0.2", skip_port=info["rpc"], steer=False) as r:
            rc = plain.transfer_sync_write(target, src.ctypes.data, info["addr"], n)
        out = {"rc": [rc], "conns": [[c.sport, c.dport, c.steered] for c in r.connections()]}
    else:
        out = {"rc": [plain.transfer_sync_write(target, src.ctypes.data, info["addr"], n)], "conns": []}
print(json.dumps(out))
"""


@pytest.fixture()
def agents(tmp_path):
    (tmp_path / "api").mkdir()
    cfile, names = write_cluster(tmp_path, 2, lease_min_s=0.5, heartbeat_s=0.1)
    procs = AgentProcs(cfile, names, tmp_path)
    for n in names:
        procs.start(n)
    procs.wait_ready(names)
    yield procs, clmod.load(cfile), names
    procs.stop_all()


STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_receiver_left():
    yield
    while STARTED:  # a failed test leaves its receiver waiting for the done file
        p = STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def _receiver(tmp_path, env=None):
    ready, done = tmp_path / "ready.json", tmp_path / "done"
    p = subprocess.Popen([sys.executable, "-c", RECEIVER, str(ready), str(done)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
    STARTED.append(p)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, "receiver did not start"
        time.sleep(0.05)
    return p, json.loads(ready.read_text()), done


def _send(info, api, mode, preloaded=True, one_shot=None):
    env = preload.preload_env() if preloaded else dict(os.environ)
    env.pop("MC_TCP_ENABLE_CONNECTION_POOL", None)
    if one_shot is not None:
        env["MC_TCP_ENABLE_CONNECTION_POOL"] = "0" if one_shot else "1"
    res = subprocess.run([sys.executable, "-c", SENDER, json.dumps(info), api, mode], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _verified(p, done, n):
    done.write_text(str(n))
    out, _ = p.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])["verified"]


def test_steered_writes_use_ports_of_the_leased_path_and_release(agents, tmp_path) -> None:
    procs, cl, names = agents
    assert names == ["gpu0", "gpu1"]
    p, info, done = _receiver(tmp_path)
    out = _send(info, procs.api("gpu0"), "steered")
    assert out["rc"] == [0, 0]
    assert _verified(p, done, 4 << 20)
    maps = cl.pathmaps()
    for k, conns in (("batch", 4), ("single", 1)):
        t = out[k]
        assert t["steered"] and t["error"] is None and t["dport"] != info["rpc"]
        pm = maps(cl.host("gpu0").index, cl.host("gpu1").index, t["dport"])
        used = [c[0] for c in t["conns"]]
        # one connection per buffer, each on its own port of the leased path (the handshake is not steered)
        assert len(used) == conns and len(set(used)) == conns and all(c[1] == t["dport"] for c in t["conns"])
        assert {pm.path_of(s) for s in used} == {t["path"]} and set(used) <= set(t["ports"])
        assert {int(p): v for p, v in t["port_paths"].items()} == dict.fromkeys(t["ports"], t["path"])
        assert len(t["ports"]) >= conns  # one per connection (spares only for ports still in TIME_WAIT)
    # The kernel's own record: the engine closes first, so each steered port sits in TIME_WAIT.
    assert {c[0] for k in ("batch", "single") for c in out[k]["conns"]} <= set(out["time_wait"])
    # Released: no flow left at the agents.
    time.sleep(0.3)
    with ArkClient(procs.api("gpu0")) as c:
        st = c.status()
        assert st["local_flows"] == 0 and st["reservations"] == 0
        assert st["core"]["reserved"] == 2


@pytest.mark.parametrize("mode", ["split", "polled"])
def test_a_multi_path_lease_puts_a_transfers_connections_on_its_parts_round_robin(agents, tmp_path, mode) -> None:
    procs, cl, _names = agents
    p, info, done = _receiver(tmp_path)
    out = _send(info, procs.api("gpu0"), mode)
    assert out["rc"] == [0] and _verified(p, done, 4 << 20)
    assert out["steered"] and out["error"] is None and not out["repathed"]
    assert out["reserved"] == [True, True] and len(set(out["paths"])) == 2
    pm = cl.pathmaps()(cl.host("gpu0").index, cl.host("gpu1").index, out["dport"])
    # Eight connections, four per part, alternating; each on a port of its own part's path.
    used = [c[0] for c in out["conns"]]
    assert len(set(used)) == 8 and out["parts_used"] == [0, 1] * 4
    assert [pm.path_of(s) for s in used] == [out["paths"][k] for k in out["parts_used"]]
    assert {int(s): k for s, k in out["port_parts"].items() if int(s) in used} == dict(zip(used, out["parts_used"], strict=True))
    time.sleep(0.3)
    with ArkClient(procs.api("gpu0")) as c:
        st = c.status()
        assert st["local_flows"] == 0 and st["reservations"] == 0 and st["core"]["reserved"] == 2


HELD = """
import json, socket, sys
import numpy as np
from ark.agent.cluster import load
from ark.integrations.mooncake import SteeredTransferEngine

info, api, cluster, dport = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
hold = int(sys.argv[5])  # how many of path 0's ports to hold (0: all of them)
cl = load(cluster)
bucket = cl.pathmaps()(cl.host("gpu0").index, cl.host("gpu1").index, dport).buckets[0].tolist()
def bindable(p):
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", p))
        except OSError:  # in TIME_WAIT from an earlier run: taken all the same
            return False
    return True

if not hold:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, len(bucket) + 1024), hard))
held = []
for p in bucket[:hold or len(bucket)]:  # the ports the lease and its first more_ports will hand out: all taken
    if bindable(p):
        s = socket.socket(); s.bind(("0.0.0.0", p)); held.append(s)
free = [p for p in bucket[hold:12] if bindable(p)] if hold else []
eng = SteeredTransferEngine(agent=api, hosts={"127.0.0.2": "gpu1"})
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
n = 4 << 20
src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
assert eng.register_memory(src.ctypes.data, n) == 0
q = n // 4
rc = eng.batch_transfer_sync_write(f"127.0.0.2:{info['rpc']}", [src.ctypes.data + i * q for i in range(4)],
                                   [info["addr"] + i * q for i in range(4)], [q] * 4)
t = eng.last_transfer()
print(json.dumps({"rc": rc, "bucket": bucket[:12], "free": free, "ports": t.ports, "port_paths": t.port_paths, "path": t.lease.path,
                  "conns": [[c.sport, c.steered] for c in t.connections], "resolves": t.stats.resolves,
                  "reserved": t.lease.reserved, "steered": t.steered, "error": t.error}))
"""


def test_with_every_path_taken_the_connections_are_left_to_ecmp(agents, tmp_path) -> None:
    procs, _cl, _names = agents
    with ArkClient(procs.api("gpu0")) as c, contextlib.ExitStack() as stack:
        taken = [stack.enter_context(c.lease("gpu1", 10**9)) for _ in range(4)]  # every spine path, renewed
        assert all(x.reserved for x in taken)
        p, info, done = _receiver(tmp_path)
        out = _send(info, procs.api("gpu0"), "steered")
        assert out["rc"] == [0, 0] and _verified(p, done, 4 << 20)
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        for k in ("batch", "single"):
            t = out[k]
            # plain ECMP: no port bound, each connection hashed on its own ephemeral port
            assert t["ecmp"] and t["ports"] == [] and not t["steered"]
            assert all(c[2] is False and lo <= c[0] <= hi for c in t["conns"])
        assert len({c[0] for c in out["batch"]["conns"]}) == 4


def _write_with_ports_held(procs, tmp_path, hold):
    lo = _free_pair()
    p, info, done = _receiver(tmp_path, {"MC_MIN_RPC_PORT": str(lo), "MC_MAX_RPC_PORT": str(lo + 1)})
    data_port = 2 * lo + 1 - info["rpc"]  # Mooncake took the other port of the pair for data
    res = subprocess.run([sys.executable, "-c", HELD, json.dumps(info), procs.api("gpu0"), str(procs.cluster_file),
                          str(data_port), str(hold)], capture_output=True, text=True, env=preload.preload_env(),
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0 and _verified(p, done, 4 << 20)
    return out


def test_held_ports_are_stepped_over_with_more_ports_of_the_same_path(agents, tmp_path) -> None:
    procs, _cl, _names = agents
    out = _write_with_ports_held(procs, tmp_path, 4)
    b = out["bucket"]
    # The lease and its 3 more ports are held: the resolver is called again and gets 4 + 4 spares.
    assert out["path"] == 0 and out["ports"] == b[:12] and out["resolves"] == 2
    assert {int(k): v for k, v in out["port_paths"].items()} == dict.fromkeys(b[:12], 0)
    assert len(out["free"]) >= 4 and out["conns"] == [[port, True] for port in out["free"][:4]]


def test_with_every_port_of_the_path_held_the_transfer_says_why_it_went_unsteered(agents, tmp_path) -> None:
    procs, _cl, _names = agents
    out = _write_with_ports_held(procs, tmp_path, 0)  # every port of path 0: as after a burst (TIME_WAIT)
    assert out["path"] == 0 and out["reserved"] and not out["steered"]
    assert out["conns"] and all(c[1] is False for c in out["conns"])  # each went out on an ephemeral port
    assert "in use on this host (TIME_WAIT)" in out["error"] and f"of path {out['path']}" in out["error"]


def _free_pair() -> int:
    for lo in random.sample(range(18000, 19998, 2), 999):  # a new map each run
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("0.0.0.0", lo))
                b.bind(("0.0.0.0", lo + 1))
            except OSError:
                continue
            return lo
    raise AssertionError("no free port pair")


def test_an_unsteered_engine_connects_as_before(agents, tmp_path) -> None:
    procs, _cl, _names = agents
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for i, (preloaded, one_shot) in enumerate([(True, True), (True, None), (False, None)]):
        (tmp_path / str(i)).mkdir()
        p, info, done = _receiver(tmp_path / str(i))
        out = _send(info, procs.api("gpu0"), "plain", preloaded=preloaded, one_shot=one_shot)
        assert out["rc"] == [0]
        if preloaded:  # one connection, from this thread, on the kernel's ephemeral port (unset: the
            # pinned 0.3.12's default, one connection per request)
            assert len(out["conns"]) == 1 and all(lo <= c[0] <= hi and c[2] is None for c in out["conns"])
        else:  # no interposer: nothing observed
            assert out["conns"] == []
        assert _verified(p, done, 4 << 20)


def test_an_unreachable_agent_leaves_the_write_unsteered(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    p, info, done = _receiver(tmp_path / "a")
    out = _send(info, f"ipc://{tmp_path}/nobody.sock", "steered")
    assert out["rc"] == [0, 0] and _verified(p, done, 4 << 20)
    assert not out["batch"]["steered"] and "no agent at" in out["batch"]["error"]
    assert all(c[2] is False for c in out["batch"]["conns"])


def test_bad_targets_and_pooled_lanes_are_refused() -> None:
    assert parse_target("10.0.0.1:15001") == ("10.0.0.1", 15001)
    for bad in ("10.0.0.1", "10.0.0.1:0", "10.0.0.1:x", 7, "no.such.host.invalid:1"):
        with pytest.raises(SteeringError, match="target_hostname"):
            parse_target(bad)
    assert pool_enabled({"MC_TCP_ENABLE_CONNECTION_POOL": "1"}) and pool_enabled({})  # unset: pooled, 0.3.13's default
    assert not pool_enabled({"MC_TCP_ENABLE_CONNECTION_POOL": "false"})
    for bad in (17, -1, True, "2", 1.5):
        with pytest.raises(SteeringError, match=r"^parts: expected None or an integer 0..16"):
            SteeredTransferEngine(engine=object(), agent="ipc:///nowhere", hosts={}, parts=bad)
    for bad in (-0.001, 0.2, float("nan"), True, "0.01"):
        with pytest.raises(SteeringError, match=r"^poll_s: expected seconds 0..0.1"):
            SteeredTransferEngine(engine=object(), agent="ipc:///nowhere", hosts={}, poll_s=bad)
