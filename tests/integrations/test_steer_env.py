"""Process-wide rules of the connect() interposer (ARK_STEER_RULES) and its deferred bind, with
real sockets on loopback in processes that preload it: what an engine that keeps its
connections (UCX's TCP transport) meets, without a line of ARK in the engine."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from ark.integrations import preload
from ark.integrations.preload import EnvRule, SteerRulesError, steer_rules

CHILD = """
import json, socket, threading

def listener(ip, port):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ip, port))
    srv.listen(64)
    def run():
        while True:
            c, _ = srv.accept()
            c.close()
    threading.Thread(target=run, daemon=True).start()
    return srv

def dial(ip, port, bind_first=None):
    s = socket.socket()
    if bind_first is not None:
        s.bind((bind_first, 0))  # as UCX does with UCX_TCP_EP_BIND_SRC_ADDR=try
    s.connect((ip, port))
    me = s.getsockname()
    s.recv(1)  # the server closed first: no TIME_WAIT on our side
    s.close()
    return list(me)
"""


def run(code: str, env: dict[str, str]) -> tuple[dict, str]:
    full = preload.preload_env(dict(__import__("os").environ, **env))
    res = subprocess.run([sys.executable, "-c", CHILD + textwrap.dedent(code)], capture_output=True, text=True,
                         env=full, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def ports() -> tuple[int, list[int]]:
    """A listener port and eight source ports, drawn per test (an immediate rerun meets no TIME_WAIT)."""
    b = random.randrange(21000, 29000, 20)
    return b, list(range(b + 1, b + 9))


def test_connections_take_the_lanes_in_turn_and_deferred_binds_get_rule_ports(tmp_path) -> None:
    dport, p = ports()
    rules = steer_rules([EnvRule("127.0.0.1", ((p[0], p[1]), (p[2], p[3])), dport)])
    log = tmp_path / "steer.log"
    out, err = run(f"""
        srv = listener("127.0.0.1", {dport})
        plain = dial("127.0.0.1", {dport})
        bound = dial("127.0.0.1", {dport}, bind_first="127.0.0.1")
        third = dial("127.0.0.1", {dport}, bind_first="127.0.0.1")
        other = dial("127.0.0.1", {dport})
        l2 = socket.socket(); l2.bind(("127.0.0.1", 0)); l2.listen(1)  # a deferred bind flushed by listen()
        s = socket.socket(); s.bind(("127.0.0.1", 0)); mine = s.getsockname()[1]  # ... and by getsockname()
        from ark.integrations.preload import env_status
        st = env_status()
        print(json.dumps(dict(ports=[plain[1], bound[1], third[1], other[1]], listen=l2.getsockname()[1],
                              mine=mine, rules=st.rules, error=st.error, deferred=[st.deferred, st.deferred_steered],
                              log=[[c.sport, c.dport, c.steered] for c in st.connections[0]])))
    """, {"ARK_STEER_RULES": rules, "ARK_STEER_LOG": str(log)})
    assert out["rules"] == 1 and out["error"] == "" and err == ""
    # lane 0, lane 1, lane 0 (its next port), lane 1: each connection on the next path
    assert out["ports"] == [p[0], p[2], p[1], p[3]]
    assert out["listen"] != 0 and out["mine"] != 0
    assert out["deferred"] == [4, 2]  # two binds before connect() (steered), one before listen(), one before getsockname()
    assert out["log"] == [[q, dport, True] for q in out["ports"]]
    lines = log.read_text().splitlines()
    assert lines == [f"127.0.0.1 {dport} {q} {lane} 1" for q, lane in zip(out["ports"], [0, 1, 0, 1], strict=True)]


def test_other_destinations_and_an_engines_own_port_are_left_alone() -> None:
    dport, p = ports()
    rules = steer_rules([EnvRule("127.0.0.2", ((p[0],),)), EnvRule("127.0.0.1", ((p[1],),), dport + 1)])
    out, _ = run(f"""
        listener("127.0.0.1", {dport}); listener("127.0.0.2", {dport})
        any_port = dial("127.0.0.2", {dport})          # rule without a dport: any port of that address
        other_port = dial("127.0.0.1", {dport})        # a rule for another port of this address
        s = socket.socket(); s.bind(("127.0.0.1", {p[2]})); s.connect(("127.0.0.2", {dport}))  # the engine's own port
        own = s.getsockname()[1]; s.recv(1); s.close()
        print(json.dumps(dict(any=any_port[1], other=other_port[1], own=own)))
    """, {"ARK_STEER_RULES": rules})
    assert out["any"] == p[0] and out["other"] not in p and out["own"] == p[2]


@pytest.mark.parametrize(("value", "why"), [
    ("127.0.0.1=ports:1,2;bad", "rule 2 (bad): expected IP[:DPORT]=ports:LIST"),
    ("300.0.0.1=ports:1", "destination: expected an IPv4 address"),
    ("127.0.0.1:0=ports:1", "dport: expected 1..65535"),
    ("127.0.0.1=ports:1,,2", "ports: expected 1..65535"),
    ("127.0.0.1=ports:70000", "ports: expected 1..65535"),
    ("127.0.0.1=lease:run/x", "lease: expected an absolute socket path"),
    ("127.0.0.1=bogus:1", "source: expected ports:LIST"),
    ("127.0.0.1=ports:1;127.0.0.1=ports:2", "a second rule for this destination"),
    (";", "no rule"),
])
def test_a_bad_value_loads_no_rule_and_says_why_in_one_line(value: str, why: str) -> None:
    dport, p = ports()
    out, err = run(f"""
        listener("127.0.0.1", {dport})
        from ark.integrations.preload import env_status
        st = env_status()
        print(json.dumps(dict(port=dial("127.0.0.1", {dport}, bind_first="127.0.0.1")[1], rules=st.rules,
                              error=st.error, deferred=st.deferred)))
    """, {"ARK_STEER_RULES": value.replace("ports:1", f"ports:{p[0]}")})
    assert out["rules"] == 0 and out["deferred"] == 0 and out["port"] not in p
    assert len(err.splitlines()) == 1 and err.startswith("ark-steer: ARK_STEER_RULES: rule ") and why in err
    assert why in out["error"]


def test_deferral_can_be_switched_off_and_a_bad_switch_loads_nothing() -> None:
    dport, p = ports()
    rules = steer_rules([EnvRule("127.0.0.1", ((p[0], p[1]),), dport)])
    code = f"""
        listener("127.0.0.1", {dport})
        print(json.dumps(dict(bound=dial("127.0.0.1", {dport}, bind_first="127.0.0.1")[1], plain=dial("127.0.0.1", {dport})[1])))
    """
    off, _ = run(code, {"ARK_STEER_RULES": rules, "ARK_STEER_DEFER": "0"})
    assert off["bound"] not in p and off["plain"] == p[0]  # bound by the engine: its own; unbound: steered
    bad, err = run(code, {"ARK_STEER_RULES": rules, "ARK_STEER_DEFER": "yes"})
    assert bad["bound"] not in p and bad["plain"] not in p
    assert err.strip() == "ark-steer: ARK_STEER_DEFER: expected 0 or 1; got yes; no rule loaded"


def test_rules_are_checked_in_python_as_the_interposer_checks_them() -> None:
    assert steer_rules([EnvRule("10.0.1.1", ((20001, 20005), (20002,)), 15100)]) == "10.0.1.1:15100=ports:20001,20005/20002"
    for bad, msg in [([], "expected 1..64 rules"), ([EnvRule("x", ((1,),))], "rule 1: destination"),
                     ([EnvRule("10.0.0.1", ((1,),), 70000)], "rule 1: dport"),
                     ([EnvRule("10.0.0.1", ())], "rule 1: paths"), ([EnvRule("10.0.0.1", ((0,),))], "rule 1: ports"),
                     ([EnvRule("10.0.0.1", ((1,),)), EnvRule("10.0.0.1", ((2,),))], "rule 2: a second rule")]:
        with pytest.raises(SteerRulesError, match=msg):
            steer_rules(bad)
