"""Real agent processes over ZeroMQ on loopback: API, leases, kills, security, fuzzing."""

from __future__ import annotations

import contextlib
import random
import time

import msgpack
import pytest
import zmq
import zmq.auth

from ark.agent import cluster as clmod
from ark.agent.client import ArkClient, ArkClientError
from ark.agent.loopback import AgentProcs, run_cluster, write_cluster
from ark.core.messages import Release, Reserve, encode
from ark.core.node import K_DATA, K_HELLO, encode_envelope


@pytest.fixture()
def trio(tmp_path):
    """Three running agents plus a fourth listed host ("X") that no agent runs."""
    (tmp_path / "api").mkdir()
    cfile, names = write_cluster(tmp_path, 3, lease_min_s=0.6, heartbeat_s=0.1, extra_hosts=1)
    procs = AgentProcs(cfile, names, tmp_path)
    running = names[:3]
    for n in running:
        procs.start(n)
    procs.wait_ready(running)
    cl = clmod.load(cfile)
    yield procs, cl, running, names[3]
    procs.stop_all()


def tables(procs, names):
    out = {}
    for n in names:
        with ArkClient(procs.api(n)) as c:
            out[n] = c.call({"op": "table"})
    return out


def other_leaf(cl, name):
    me = cl.fabric.hosts[cl.host(name).index].leaf
    return next(h.name for h in cl.hosts if cl.fabric.hosts[h.index].leaf != me)


def test_reserve_renew_release_over_real_sockets(trio) -> None:
    procs, cl, running, _x = trio
    src = running[0]
    dst = other_leaf(cl, src)
    with ArkClient(procs.api(src)) as c:
        lease = c.reserve(dst, 10**6)
        assert lease.reserved and 49152 <= lease.src_port <= 65535 and lease.flow_label is not None
        assert cl.pathmaps()(cl.host(src).index, cl.host(dst).index, 4791).path_of(lease.src_port) == lease.path
        time.sleep(0.2)
        t = tables(procs, running)
        assert len({v["digest"] for v in t.values()}) == 1
        assert all([lease.flow_id[0], lease.flow_id[1]] == v["flows"][0][:2] for v in t.values())
        renewed = c.renew(lease.flow_id)
        assert renewed.expires > lease.expires
        c.release(lease.flow_id)
        time.sleep(0.2)
        assert all(v["flows"] == [] for v in tables(procs, running).values())
        with pytest.raises(ArkClientError, match="not an active local flow"):
            c.release(lease.flow_id)
        with pytest.raises(ArkClientError, match="dst"):
            c.call({"op": "reserve", "dst": "nosuch", "nbytes": 1})
        with pytest.raises(ArkClientError, match="op: must be one of"):
            c.call({"op": "explode"})
        assert "ark_reservations" in c.metrics()
        from ark.agent.metrics import METRICS  # what the reference pages list is what is exported
        text = c.metrics()
        assert all(f"# TYPE {name} {kind}" in text for name, kind, _ in METRICS)
        ports = c.ports(dst)
        assert len(ports) == 4 and len(set(ports)) == 4
        # Fabric-change ops: the current lease follows the flow; maps reload in place.
        lease = c.reserve(dst, 10**6)
        assert c.current(lease.flow_id) == lease
        assert c.reload() == {}  # the same maps: nothing moved
        with pytest.raises(ArkClientError, match="refresh: the cluster file has no routers_file"):
            c.refresh()
        with pytest.raises(ArkClientError, match="peers: expected a list"):
            c.call({"op": "refresh", "peers": "gpu1"})
        # More ports of the lease's path, for an engine opening several connections.
        path, more = c.more_ports(lease.flow_id, 3)
        pm = cl.pathmaps()(cl.host(src).index, cl.host(dst).index, 4791)
        assert path == lease.path and len(set(more) | {lease.src_port}) == 4 and {pm.path_of(p) for p in more} == {path}
        for bad, why in ((0, "must be >= 1"), (1025, "must be <= 1024"), (True, "must be an integer"),
                         ("3", "must be an integer")):
            with pytest.raises(ArkClientError, match=rf"^n: {why}"):
                c.call({"op": "more_ports", "flow": list(lease.flow_id), "n": bad})
        c.release(lease.flow_id)
        with pytest.raises(ArkClientError, match="not an active local flow"):
            c.current(lease.flow_id)
        with pytest.raises(ArkClientError, match="not an active local flow"):
            c.more_ports(lease.flow_id, 1)


def test_lease_context_manager_renews_until_exit(trio) -> None:
    procs, cl, running, _x = trio
    src = running[1]
    with ArkClient(procs.api(src)) as c, c.lease(other_leaf(cl, src), 10**6) as lease:
        time.sleep(1.5)  # more than two lease periods: only renewals keep it alive
        t = tables(procs, running)
        assert all(any(f[:2] == list(lease.flow_id) for f in v["flows"]) for v in t.values())
    time.sleep(0.2)
    assert all(v["flows"] == [] for v in tables(procs, running).values())


def _x_keys(tmp_path, x):
    return zmq.auth.load_certificate(str(tmp_path / "keys" / f"{x}.key_secret"))


def test_unknown_key_can_neither_subscribe_nor_inject(trio, tmp_path) -> None:
    procs, cl, running, x = trio
    target = cl.host(running[0])
    ctx = zmq.Context()
    try:
        # Receiving: a stranger listens on X's address with its own keys. The agents'
        # links to X are pinned to X's public key, so the handshake fails: nothing.
        spub, ssec = zmq.curve_keypair()
        rogue = ctx.socket(zmq.ROUTER)
        rogue.curve_server = True
        rogue.curve_publickey, rogue.curve_secretkey = spub, ssec
        rogue.bind(cl.host(x).control)
        assert not rogue.poll(2000), "a stranger must receive nothing"
        rogue.close(0)
        # Control: with X's real keys on the same address, heartbeats do arrive.
        xpub, xsec = _x_keys(tmp_path, x)
        legit = ctx.socket(zmq.ROUTER)
        legit.curve_server = True
        legit.curve_publickey, legit.curve_secretkey = xpub, xsec
        for _ in range(100):  # closing is asynchronous: wait for the port to be free
            try:
                legit.bind(cl.host(x).control)
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        assert legit.poll(5000), "a listed key at a listed address receives heartbeats"
        legit.close(0)
        # Sending: a stranger connects to a real agent. ZAP refuses its key.
        inj = ctx.socket(zmq.DEALER)
        inj.curve_publickey, inj.curve_secretkey = spub, ssec
        inj.curve_serverkey = target.public_key.encode()
        inj.connect(target.control)
        xi = cl.host(x).index
        before = tables(procs, running)
        with ArkClient(procs.api(running[0])) as c:
            received_before = c.status()["node"]["received"]
        for k in range(200):
            m = Reserve((xi, 1000 + k), time.time(), xi, target.index, 4791, 0, 49152, 10**9, 1e11, False, time.time() + 5)
            # The refused handshake leaves no connection: sends fail or go nowhere.
            with contextlib.suppress(zmq.Again):
                inj.send(encode_envelope(K_DATA, xi, 1, k + 1, [encode(m), b""]), zmq.NOBLOCK)
            time.sleep(0.002)
        time.sleep(0.3)
        assert tables(procs, running) == before
        with ArkClient(procs.api(running[0])) as c:
            st = c.status()
        # Only heartbeats from the two real peers arrived meanwhile, nothing from the stranger.
        assert st["node"]["invalid"] == 0 and not st["peers"][x]["up"]
        assert st["node"]["received"] - received_before < 200
    finally:
        ctx.destroy(0)


def _as_x(ctx, cl, x, tmp_path, running):
    """Sockets holding X's real keys, one to each running agent."""
    xpub, xsec = _x_keys(tmp_path, x)
    socks = []
    for n in running:
        s = ctx.socket(zmq.DEALER)
        s.curve_publickey, s.curve_secretkey = xpub, xsec
        s.curve_serverkey = cl.host(n).public_key.encode()
        s.connect(cl.host(n).control)
        socks.append(s)
    time.sleep(0.5)  # CURVE handshakes
    return socks


def test_known_peer_cannot_reserve_in_another_hosts_name(trio, tmp_path) -> None:
    procs, cl, running, x = trio
    ctx = zmq.Context()
    try:
        socks = _as_x(ctx, cl, x, tmp_path, running)
        xi, victim = cl.host(x).index, cl.host(running[1]).index
        dst = cl.host(running[0]).index
        before = tables(procs, running)
        now = time.time()
        for k in range(50):
            forged = Reserve((victim, 10**6 + k), now, victim, dst, 4791, 0, 49152, 10**9, 1e11, False, now + 5)
            for s in socks:
                s.send(encode_envelope(K_HELLO, xi, 7, k, [b"\0" * 8, now - 2.5, now - 1.0, now, []]))
                # The envelope claims to come from the victim: the channel says X.
                s.send(encode_envelope(K_DATA, victim, 7, k + 1, [encode(forged), b""]))
                # Honest envelope, but X speaks for the victim's flows.
                s.send(encode_envelope(K_DATA, xi, 7, k + 1, [encode(forged), b""]))
                s.send(encode_envelope(K_DATA, xi, 7, k + 1, [encode(Release((victim, 1), now)), b""]))
            time.sleep(0.005)
        time.sleep(0.3)
        assert tables(procs, running) == before
        for n in running:
            with ArkClient(procs.api(n)) as c:
                st = c.status()
            assert st["node"]["invalid"] + st["core"]["invalid"] >= 100, st["node"]
    finally:
        ctx.destroy(0)


def test_fuzzed_messages_are_counted_and_dropped(trio, tmp_path) -> None:
    procs, cl, running, x = trio
    ctx = zmq.Context()
    rng = random.Random(5)
    try:
        socks = _as_x(ctx, cl, x, tmp_path, running)
        xi = cl.host(x).index
        dst = cl.host(running[0]).index
        good = encode(Reserve((xi, 1), time.time(), xi, dst, 4791, 0, 49152, 10**9, 1e11, False, time.time() + 5))
        valid_env = encode_envelope(K_DATA, xi, 9, 1, [good, b""])
        before = tables(procs, running)
        for k in range(3000):
            kind = k % 6
            if kind == 0:
                data = rng.randbytes(rng.randint(0, 64))
            elif kind == 1:
                data = valid_env[: rng.randint(0, len(valid_env) - 1)]  # truncated
            elif kind == 2:
                b = bytearray(valid_env)
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                data = bytes(b)
            elif kind == 3:
                data = encode_envelope(K_DATA, xi, 9, 10 + k, [b"\x90" * 5000, b""])  # oversized payload
            elif kind == 4:
                data = msgpack.packb([99, K_DATA, xi, 9, 10 + k, [good, b""]])  # wrong version
            else:
                data = encode_envelope(K_DATA, xi, 9, 10 + k, [good[:-3], b""])  # truncated message
            for s in socks:
                s.send(data)
            if k % 200 == 0:
                time.sleep(0.01)
        time.sleep(0.5)
        for n in running:
            with ArkClient(procs.api(n)) as c:
                st = c.status()
            assert st["ready"]
            assert st["node"]["invalid"] + st["core"]["invalid"] >= 1000
        # Flipped bits can make a valid reservation by X (X's own key, X's channel): the
        # only thing that may change is X's own entries.
        after = tables(procs, running)
        for n in running:
            others = [f for f in after[n]["flows"] if f[0] != xi]
            assert others == [f for f in before[n]["flows"] if f[0] != xi]
        assert all(p.poll() is None for p in procs.procs.values()), "no agent may crash"
    finally:
        ctx.destroy(0)


def test_cluster_with_a_kill_and_restart(tmp_path) -> None:
    res = run_cluster(4, 300, kill=1, lease_min_s=1.0, workdir=str(tmp_path))
    assert res["flows"] >= 300 and res["leaked"] == 0
    assert res["digests_equal"] and res["resync_before_reserve"]
    assert res["dead_reservations_cleared_s"] is not None
    assert res["dead_reservations_cleared_s"] <= res["lease_period_s"] + 0.5
    assert res["invalid_messages"] == 0


def test_cluster_file_errors_name_the_field(tmp_path) -> None:
    cfile, _ = write_cluster(tmp_path, 2)
    text = cfile.read_text()
    bad = tmp_path / "bad.toml"
    for old, new, match in [
        ('policy = "ark"', 'policy = "greedy"', "cluster.policy"),
        ('name = "gpu0"', 'name = "gpu99"', r"hosts\[0\].name"),
        ("tcp://127.0.0.1:", "udp://127.0.0.1:", r"hosts\[0\].control"),
        ("lease_min_s = 1.0", "lease_min_s = -1", "cluster.lease_min_s"),
        ("[fabric]", "[fabric]\nbogus = 1", "fabric.bogus"),
    ]:
        bad.write_text(text.replace(old, new, 1))
        with pytest.raises(clmod.ClusterError, match=match):
            clmod.load(bad)
    k = text.index('public_key = "') + len('public_key = "')
    bad.write_text(text[:k] + "short" + text[k + 40:])
    with pytest.raises(clmod.ClusterError, match="public_key"):
        clmod.load(bad)


def test_cli_status_ports_keygen_and_cluster(trio, tmp_path) -> None:
    import json
    import subprocess
    import sys

    procs, cl, running, x = trio
    run = lambda *a: subprocess.run([sys.executable, "-m", "ark", *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    p = run("status", "--cluster", str(procs.cluster_file), "--host", running[0], "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["ready"] and st["peers"][running[1]]["up"] and not st["peers"][x]["up"]
    p = run("status", "--cluster", str(procs.cluster_file), "--host", running[0])
    assert p.returncode == 0 and "peers" in p.stdout
    dst = other_leaf(cl, running[0])
    p = run("ports", "--cluster", str(procs.cluster_file), "--host", running[0], "--peer", dst)
    ports = [int(v) for v in p.stdout.strip().split(",")]
    pm = cl.pathmaps()(cl.host(running[0]).index, cl.host(dst).index, 4791)
    assert [pm.path_of(v) for v in ports] == [0, 1, 2, 3]
    # Honest about what engines take: one list for this peer only, process-wide in Mooncake RDMA.
    assert "for this peer only" in p.stderr and "list[i % n]" in p.stderr and "USE_MLX5DV=ON" in p.stderr
    p = run("ports", "--cluster", str(procs.cluster_file), "--host", running[0], "--peer", "nosuch")
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "nosuch" in p.stderr
    p = run("keygen", "--out", str(tmp_path / "k"), "--name", "h1")
    assert p.returncode == 0 and (tmp_path / "k" / "h1.key_secret").exists()
    p = run("cluster", "--agents", "3", "--flows", "60", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["flows"] >= 60 and res["leaked"] == 0 and res["digests_equal"]
    assert res["agents_cpu_ms_per_cycle"] > 0
    p = run("agent", "--cluster", str(procs.cluster_file), "--host", "gpu77")
    assert p.returncode != 0 and "gpu77" in p.stderr and "Traceback" not in p.stderr


def test_cluster_path_maps_from_files(tmp_path) -> None:
    """An operator's map files (ark pathmap --save) take precedence over the fabric's hashes."""
    import subprocess
    import sys

    cfile, _ = write_cluster(tmp_path, 2)
    maps = tmp_path / "maps"
    maps.mkdir()
    text = cfile.read_text().replace("[cluster]", '[cluster]\npathmap_dir = "maps"', 1)
    cfile.write_text(text)
    cl = clmod.load(cfile)
    src, dst = cl.hosts[0], cl.hosts[1]
    f = maps / f"{src.name}__{dst.name}__4791.json"
    p = subprocess.run(
        [sys.executable, "-m", "ark", "pathmap", "--hash", "crc16-ccitt", "--seed", "9",
         "--src", cl.fabric.hosts[src.index].ip, "--dst", cl.fabric.hosts[dst.index].ip,
         "--paths", "4", "--save", str(f)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = cl.pathmaps()(src.index, dst.index, 4791)
    assert loaded.hash == "crc16-ccitt" and loaded.seed == 9
    other = cl.pathmaps()(dst.index, src.index, 4791)  # no file: from the fabric
    assert other.hash == cl.fabric.leaves[0].hash


def test_scoped_agents_talk_only_within_their_declared_traffic(tmp_path) -> None:
    """scope = "declared" over real sockets: senders hear each other, a host that sends
    nothing hears nobody and reserves nothing; a destination not declared is reserved only
    when its paths use no link outside the sender's component (here: the same two leaves)."""
    (tmp_path / "api").mkdir()
    sends = {"gpu0": ["gpu3"], "gpu1": ["gpu4"]}  # leaf 0 -> leaf 1; gpu2 and leaf 1 send nothing
    cfile, names = write_cluster(tmp_path, 6, lease_min_s=0.6, heartbeat_s=0.1, sends_to=sends)
    procs = AgentProcs(cfile, names, tmp_path)
    try:
        for n in names:
            procs.start(n)
        procs.wait_ready(names)
        st = procs.status(names)
        assert sorted(st["gpu0"]["peers"]) == ["gpu1"] and sorted(st["gpu1"]["peers"]) == ["gpu0"]
        assert all(st[n]["peers"] == {} for n in ("gpu2", "gpu3", "gpu4", "gpu5"))
        with ArkClient(procs.api("gpu0")) as c:
            lease = c.reserve("gpu3", 10**6)
            other = c.reserve("gpu5", 10**6)  # not declared, but its links are the component's
            assert lease.reserved and other.reserved
        for src, dst in (("gpu2", "gpu3"), ("gpu3", "gpu0")):  # senders of nothing: plain ECMP
            with ArkClient(procs.api(src)) as c:
                assert not c.reserve(dst, 10**6).reserved
        time.sleep(0.3)
        t = tables(procs, names)
        held = {n: {tuple(f[:2]) for f in t[n]["flows"]} for n in names}
        assert held["gpu0"] == held["gpu1"] == {tuple(lease.flow_id), tuple(other.flow_id)}
        assert all(not held[n] for n in ("gpu2", "gpu3", "gpu4", "gpu5"))
        assert procs.status(["gpu2"])["gpu2"]["node"]["received"] == 0
    finally:
        procs.stop_all()


def test_multi_path_lease_over_real_sockets(trio) -> None:
    procs, cl, running, _x = trio
    src = running[0]
    dst = other_leaf(cl, src)
    pm = cl.pathmaps()(cl.host(src).index, cl.host(dst).index, 4791)
    with ArkClient(procs.api(src)) as c:
        parts = c.reserve_split(dst, 3 * 10**6, parts=3)
        assert len({p.path for p in parts}) == 3 and all(p.reserved for p in parts)
        assert [pm.path_of(p.src_port) for p in parts] == [p.path for p in parts]
        time.sleep(0.2)
        t = tables(procs, running)
        assert len({v["digest"] for v in t.values()}) == 1 and all(len(v["flows"]) == 3 for v in t.values())
        renewed = c.renew_split([p.flow_id for p in parts])
        assert [r.flow_id for r in renewed] == [p.flow_id for p in parts]
        assert all(r.expires > p.expires for r, p in zip(renewed, parts, strict=True))
        # A part that is gone (released on its own here) fails the whole renewal: the lease is lost.
        c.release(parts[1].flow_id)
        with pytest.raises(ArkClientError, match="not an active local flow"):
            c.renew_split([p.flow_id for p in parts])
        c.release_split([parts[0].flow_id, parts[2].flow_id])
        time.sleep(0.2)
        assert all(v["flows"] == [] for v in tables(procs, running).values())
        # The size-aware default: one part per split_part_bytes, at most one per path.
        assert len(c.reserve_split(dst, 1, parts=0)) == 1
        auto = c.reserve_split(dst, 10**12, parts=0)
        assert len(auto) == cl.fabric.n_paths(cl.host(src).index, cl.host(dst).index)
        c.release_split([p.flow_id for p in auto])
        # Ports for the connections the caller will open come with the reservation: seven
        # connections over three parts are three ports a part, each on its part's path.
        got = c.reserve_ports(dst, 3 * 10**6, parts=3, connections=7)
        assert [len(ports) for _, ports in got] == [3, 3, 3]
        for le, ports in got:
            assert ports[0] == le.src_port and {pm.path_of(p) for p in ports} == {le.path}
        assert len({p for _, ports in got for p in ports}) == 9
        # They are the flow's extra ports: more_ports does not hand them out again.
        _path, more = c.more_ports(got[0][0].flow_id, 2)
        assert not set(more) & {p for _, ports in got for p in ports}
        c.release_split([le.flow_id for le, _ in got])
        (single, ports), = c.reserve_ports(dst, 10**6, connections=2)
        assert ports[0] == single.src_port and len(ports) == 2 and pm.path_of(ports[1]) == single.path
        c.release(single.flow_id)
        # A local user asking for the most connections gets no more than the flow's cap of
        # extra ports (64) and 1/8 of the path's bucket: the flows after it keep theirs.
        (greedy, ports), = c.reserve_ports(dst, 10**6, connections=1024)
        assert 1 < len(ports) <= 1 + min(64, len(pm.buckets[greedy.path]) // 8)
        c.release(greedy.flow_id)
        for req, why in (({"parts": 17}, r"^parts: must be <= 16"), ({"parts": -1}, r"^parts: must be >= 0"),
                         ({"parts": "2"}, r"^parts: must be an integer"),
                         ({"connections": 1025}, r"^connections: must be <= 1024"),
                         ({"connections": -1}, r"^connections: must be >= 0")):
            with pytest.raises(ArkClientError, match=why):
                c.call({"op": "reserve", "dst": dst, "nbytes": 1, **req})
        with pytest.raises(ArkClientError, match="give either flow"):
            c.call({"op": "renew", "flow": [0, 1], "flows": [[0, 1]]})
        with pytest.raises(ArkClientError, match="give either flow"):
            c.call({"op": "release"})
        with pytest.raises(ArkClientError, match=r"^flows: must be a list of length <= 16"):
            c.call({"op": "release", "flows": [[0, k] for k in range(17)]})


def test_multi_path_lease_context_manager_renews_and_releases_every_part(trio) -> None:
    procs, cl, running, _x = trio
    src = running[1]
    with ArkClient(procs.api(src)) as c, c.lease(other_leaf(cl, src), 2 * 10**6, parts=2) as held:
        assert len(held.parts) == 2 and len(set(held.paths)) == 2 and len(set(held.src_ports)) == 2
        assert held.ports == [[le.src_port] for le in held.parts]  # no connections named: only their own
        time.sleep(1.5)  # more than two lease periods: only renewals keep the parts alive
        held.check()
        t = tables(procs, running)
        assert all({tuple(f[:2]) for f in v["flows"]} == set(held.flow_ids()) for v in t.values())
    time.sleep(0.2)
    assert all(v["flows"] == [] for v in tables(procs, running).values())
