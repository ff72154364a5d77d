"""The connect() interposer with real sockets on loopback, in processes that preload it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ark.integrations import preload

SERVER = """
import json, socket, threading
from ark.integrations.preload import Rule, loaded

def server(close_first=True):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(512)
    def run():
        while True:
            c, _ = srv.accept()
            if close_first:
                c.close()
            else:
                threading.Thread(target=lambda c=c: (c.recv(1), c.close()), daemon=True).start()
    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]

def dial(port, client_closes=False):
    s = socket.create_connection(("127.0.0.1", port))
    sport = s.getsockname()[1]
    if not client_closes:
        s.recv(1)  # the server closed first: no TIME_WAIT here
    s.close()
    return sport
"""


def run(code: str, preloaded: bool = True, base: int = 0) -> dict:
    """Run ``code`` in a fresh process; ``B`` there is ``base``: the first of its source ports
    (drawn per test, so that an immediate rerun does not meet this run's TIME_WAITs)."""
    env = preload.preload_env() if preloaded else None
    res = subprocess.run([sys.executable, "-c", f"B = {base}\n" + SERVER + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def base() -> int:
    return random.randrange(21000, 29000, 10)


def ephemeral() -> range:
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(lo, hi + 1)


def test_without_a_rule_connections_are_the_kernels() -> None:
    out = run("""
        p = server()
        before = [dial(p) for _ in range(20)]
        with Rule("127.0.0.2", hint=1, resolver=lambda d, n: [B + 1]) as r:  # another peer
            inside = [dial(p) for _ in range(5)]
        print(json.dumps({"loaded": loaded(), "ports": before + inside, "stats": r.stats().__dict__}))
    """)
    assert out["loaded"] and all(p in ephemeral() for p in out["ports"])
    assert out["stats"] == {"steered": 0, "fallback": 0, "recorded": 0, "resolves": 0, "ports": 0}
    plain = run("""
        print(json.dumps({"loaded": loaded(), "ports": [dial(server()) for _ in range(5)]}))
    """, preloaded=False)
    assert not plain["loaded"] and all(p in ephemeral() for p in plain["ports"])


def test_steered_connections_bind_free_rule_ports_in_order() -> None:
    b = base()
    out = run("""
        p = server()
        busy = socket.socket(); busy.bind(("0.0.0.0", B + 2))           # held by another socket
        calls = []
        def resolver(dport, need):
            calls.append([dport, need])
            return [B + 1, B + 2, B + 3] if len(calls) == 1 else []
        with Rule("127.0.0.1", hint=3, resolver=resolver) as r:
            ports = [dial(p) for _ in range(3)]
            last = dial(p, client_closes=True)   # leaves TIME_WAIT on its port
            after = dial(p)                       # that port is skipped now
        print(json.dumps({"ports": ports, "last": last, "after": after, "calls": calls, "dport": p,
                          "stats": r.stats().__dict__, "log": [c.__dict__ for c in r.connections()]}))
    """, base=b)
    assert out["calls"] == [[out["dport"], 3]]  # once, with the destination port and the connections expected
    assert out["ports"] == [b + 1, b + 3, b + 1]  # b + 2 is held: skipped, never shared
    assert out["last"] == b + 3 and out["after"] == b + 1
    assert out["stats"] == {"steered": 5, "fallback": 0, "recorded": 0, "resolves": 1, "ports": 3}
    assert [c["sport"] for c in out["log"]] == [b + 1, b + 3, b + 1, b + 3, b + 1]
    assert all(c["steered"] is True and c["dport"] == out["dport"] for c in out["log"])


def test_laned_ports_keep_each_connection_on_its_lane_when_a_port_is_held() -> None:
    b = base()
    out = run("""
        from ark.integrations.preload import Laned
        p, q = server(), server(close_first=False)   # q: the client closes first, so its port is in TIME_WAIT
        busy = socket.socket(); busy.bind(("0.0.0.0", B + 1))            # lane 0's first port, held
        rounds = []
        def resolver(dport, need):
            rounds.append(need)
            if len(rounds) == 1:   # two lanes, interleaved as a multi-path lease hands them out
                return Laned([B + 1, B + 2, B + 3, B + 4, B + 5, B + 6], [0, 1, 0, 1, 0, 1])
            return Laned([B + 7, B + 8], [0, 1]) if len(rounds) == 2 else []
        with Rule("127.0.0.1", hint=4, resolver=resolver) as r:
            ports = [dial(q, client_closes=True) for _ in range(4)]   # each leaves its port in TIME_WAIT
            more = [dial(p) for _ in range(3)]
        try:
            r.add_ports([B + 9, B + 10], [0, 256])
            bad = None
        except ValueError as e:
            bad = str(e)
        print(json.dumps({"ports": ports, "more": more, "rounds": rounds, "stats": r.stats().__dict__, "bad": bad}))
    """, base=b)
    # Lanes in turn: 0, 1, 0, 1, each from its own place; lane 0's held port is stepped over
    # to lane 0's next one, not to lane 1's.
    assert out["ports"] == [b + 3, b + 2, b + 5, b + 4]
    # Then lane 0 has no free port (b+1 held, b+3 and b+5 in TIME_WAIT): the resolver is
    # asked once and its new lane-0 port taken; lane 1 goes on with its own; lane 0 comes
    # round to b+7 again (its server closed first: no TIME_WAIT).
    assert out["more"] == [b + 7, b + 6, b + 7] and len(out["rounds"]) == 2
    assert out["stats"]["fallback"] == 0 and out["stats"]["steered"] == 7
    assert out["bad"].startswith("lanes: expected one integer 0..255 per port")


def test_no_free_port_falls_back_to_an_unbound_connection() -> None:
    b = base()
    out = run("""
        p = server()
        def resolver(dport, need):
            return [B + 1] if need == 2 else []
        hold = []
        with Rule("127.0.0.1", hint=2, resolver=resolver) as r:
            s = socket.create_connection(("127.0.0.1", p)); hold.append(s)  # keeps B + 1
            second = dial(p)
        def boom(dport, need):
            raise RuntimeError("agent down")
        with Rule("127.0.0.1", hint=1, resolver=boom) as r2:
            third = dial(p)
        print(json.dumps({"first": hold[0].getsockname()[1], "second": second, "third": third,
                          "stats": r.stats().__dict__, "err": repr(r2.resolver_error), "stats2": r2.stats().__dict__}))
    """, base=b)
    assert out["first"] == b + 1
    assert out["second"] in ephemeral() and out["third"] in ephemeral()
    assert out["stats"]["steered"] == 1 and out["stats"]["fallback"] == 1 and out["stats"]["resolves"] == 2
    assert "agent down" in out["err"] and out["stats2"]["fallback"] == 1


def test_skipped_port_and_record_only_rules() -> None:
    b = base()
    out = run("""
        p, q = server(), server()
        with Rule("127.0.0.1", skip_port=q, hint=1, resolver=lambda d, n: [B + 1]) as r:
            handshake = dial(q)
            data = dial(p)
        with Rule("127.0.0.1", steer=False) as rec:
            plain = [dial(p) for _ in range(3)]
        print(json.dumps({"handshake": handshake, "data": data, "plain": plain,
                          "log": [[c.sport, c.dport, c.steered] for c in rec.connections()],
                          "stats": rec.stats().__dict__}))
    """, base=b)
    assert out["handshake"] in ephemeral() and out["data"] == b + 1
    assert all(p in ephemeral() for p in out["plain"])
    assert [c[0] for c in out["log"]] == out["plain"] and all(c[2] is None for c in out["log"])
    assert out["stats"]["recorded"] == 3 and out["stats"]["steered"] == 0


def test_rule_arguments_are_checked_and_a_missing_preload_is_one_line() -> None:
    out = run("""
        errs = []
        for kw in ({"dst_ip": "10.0.0"}, {"dst_ip": "127.0.0.1", "skip_port": 70000},
                   {"dst_ip": "127.0.0.1", "hint": 0}):
            try:
                Rule(**kw)
            except ValueError as e:
                errs.append(str(e))
        r = Rule("127.0.0.1")
        try:
            r.add_ports([0])
        except ValueError as e:
            errs.append(str(e))
        r.close()
        try:
            r.stats()
        except ValueError as e:
            errs.append(str(e))
        print(json.dumps(errs))
    """)
    assert [e.split(":")[0] for e in out] == ["dst_ip", "skip_port", "hint", "ports", "rule"]
    res = subprocess.run([sys.executable, "-c", "from ark.integrations.preload import Rule; Rule('127.0.0.1')"],
                         capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "PreloadError: LD_PRELOAD: the ARK interposer is not loaded" in res.stderr


def test_library_builds_once_per_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ARK_CACHE_DIR", str(tmp_path))
    lib = preload.library()
    assert lib.parent == tmp_path and lib.exists() and preload.library() == lib
    env = preload.preload_env({"LD_PRELOAD": f"/x/other.so:{lib}"}, lib)
    assert env["LD_PRELOAD"] == f"{lib} /x/other.so"
    monkeypatch.setenv("ARK_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(preload.PreloadError, match="cc: building"):
        preload.library()


def test_cli_preload_and_bench(capsys) -> None:
    from ark.cli import main

    assert main(["preload"]) == 0
    assert capsys.readouterr().out.strip() == str(preload.library())
    res = subprocess.run([sys.executable, "-m", "ark", "preload", "--", sys.executable, "-c",
                          "from ark.integrations.preload import loaded; print(loaded())"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "True"
    assert main(["bench", "steer", "--connections", "40", "--rounds", "1", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert set(rec["modes"]) == {"plain", "idle", "other", "steered", "skip"}
    assert set(rec["overhead_us"]) == {"other", "steered", "skip"} and rec["target_us"] == 100
    assert all(r["median_us"] > 0 for r in rec["modes"].values())
