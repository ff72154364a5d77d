"""Leases steering QPs (ark.integrations.verbs.lease_qps): real agents on loopback, and QPs
connected by the small engine against the STAND-IN libibverbs.so.1 (see test_verbs.py: it
records what each ibv_modify_qp received after the interposer; no RDMA device is involved)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ark.core.roce import flow_label_for_sport
from tests.integrations.conftest import two_agents
from tests.integrations.test_verbs import run


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[str]:
    """gpu0's local API; gpu1 is behind another leaf."""
    with two_agents(tmp_path, lease_min_s=0.5) as path:
        yield path


def test_a_multi_path_lease_steers_every_thread_s_qps_part_by_part_until_the_block_ends(built, api) -> None:
    out = run(built, f"""
        from ark.agent.client import ArkClient, ArkClientError
        with ArkClient({api!r}) as c:
            with verbs.lease_qps(c, "gpu1", PEER, 10**9, parts=2, qps=4) as ql:
                eng.connect(PEER, 2)
                t = threading.Thread(target=lambda: eng.connect(PEER, 2))  # an engine's own thread
                t.start(); t.join()
                parts = [[le.reserved, le.path, le.src_port] for le in ql.parts]
                held = {{"ports": ql.held.ports, "flows": ql.held.flow_ids()}}
                qps = [[q.port, q.lane, q.steered] for q in ql.qps()]
            eng.connect(PEER, 1)   # after the block: the kernel's port again
            gone = []
            for f in held["flows"]:
                try:
                    c.renew(tuple(f)); gone.append(False)
                except ArkClientError:
                    gone.append(True)
        print(json.dumps({{"parts": parts, "held": held, "qps": qps, "gone": gone,
                          "rtr": [r.flow_label for r in eng.rtrs()]}}))
    """)
    (r0, p0, s0), (r1, p1, s1) = out["parts"]
    assert r0 and r1 and p0 != p1  # two parts, two paths
    ports = out["held"]["ports"]
    assert [len(p) for p in ports] == [2, 2] and ports[0][0] == s0 and ports[1][0] == s1
    assert [q[1] for q in out["qps"]] == [0, 1, 0, 1]  # QP i on part i mod 2, whichever thread connected it
    assert all(q[2] and q[0] in ports[q[1]] for q in out["qps"])
    assert len({q[0] for q in out["qps"]}) == 4  # each QP its own port of its part's path
    assert out["rtr"] == [flow_label_for_sport(q[0]) for q in out["qps"]] + [0]
    assert out["gone"] == [True, True]  # released at the end of the block


def test_a_re_pathed_part_gives_later_qps_its_new_port_and_says_which_live_qps_keep_their_path(built) -> None:
    """The agent's renewal answer moves part 1 (a race lost): later QPs of lane 1 take the
    new port; live ones move only through mlx5dv (the stand-in's), else stay and say why."""
    out = run(built, """
        import ctypes
        from ark.agent.client import HeldSplit
        from ark.core.node import Lease
        from ark.core.roce import flow_label_for_sport as fl
        a = Lease((0, 1), 8, 0, 49153, fl(49153), 1e12, True, "")
        b = Lease((0, 2), 8, 1, 50000, fl(50000), 1e12, True, "")
        held = HeldSplit([a, b])
        held.ports = [[49153], [50000]]
        res = {}
        for mlx5 in (False, True):
            if mlx5:
                ctypes.CDLL(str(S / "libmlx5.so.1"))
            held.parts = [a, b]
            rule = QpRule(PEER)
            ql = verbs.QpLease(held, rule, _now=[(True, 0), (True, 1)], _given=[(True, 0), (True, 1)])
            laned = ql.lanes()
            rule.add_ports(laned.ports, laned.lanes)
            with rule:
                live = eng.connect(PEER, 2, keep=True)
                held.parts = [a, b._replace(path=2, src_port=60001, flow_label=fl(60001))]
                ql.follow(held)
                later = eng.connect(PEER, 2, keep=True)
                held.parts = [a, b._replace(reserved=False, fallback="path map changed")]
                ql.follow(held)
            res[mlx5] = {"qps": [[q.qp_num, q.port, q.lane] for q in rule.qps()], "live": live, "later": later,
                         "moved": [[r.qp_num, r.port] for r in ql.moved],
                         "kept": [[r.qp_num, r.why] for r in ql.kept]}
            rule.close()
        print(json.dumps(res))
    """)
    for mlx5, r in ((False, out["false"]), (True, out["true"])):
        lane1_live, lane1_later = r["live"][1], r["later"][1]
        by_qp = {q[0]: q for q in r["qps"]}
        assert by_qp[r["later"][0]][1] == 49153 and by_qp[lane1_later][1] == 60001  # later QPs: the new port
        lost = "part 1: holds no path now (path map changed)"  # then: no path to follow at all
        if mlx5:
            assert r["moved"] == [[lane1_live, 60001]]
            assert r["kept"] == [[lane1_live, lost], [lane1_later, lost]]
        else:
            assert r["moved"] == []
            (q0, why0), *rest = r["kept"]
            assert q0 == lane1_live and why0.startswith("mlx5dv_modify_qp_udp_sport: not available")
            assert rest == [[lane1_live, lost], [lane1_later, lost]]  # part 0's QPs never in either list


def test_ports_handed_for_a_path_are_not_used_once_the_part_has_left_it(built) -> None:
    """Part 1 moves, then part 0: QPs connected after both take each part's new port, never
    the ports the lease first handed for the paths the parts have left."""
    out = run(built, """
        from ark.agent.client import HeldSplit
        from ark.core.node import Lease
        from ark.core.roce import flow_label_for_sport as fl
        a = Lease((0, 1), 8, 0, 49153, fl(49153), 1e12, True, "")
        b = Lease((0, 2), 8, 1, 50000, fl(50000), 1e12, True, "")
        held = HeldSplit([a, b])
        held.ports = [[49153, 49157], [50000, 50004]]
        rule = QpRule(PEER)
        ql = verbs.QpLease(held, rule, _now=[(True, 0), (True, 1)], _given=[(True, 0), (True, 1)])
        laned = ql.lanes()
        rule.add_ports(laned.ports, laned.lanes)
        b2 = b._replace(path=2, src_port=60001, flow_label=fl(60001))
        held.parts = [a, b2]
        ql.follow(held)
        held.parts = [a._replace(path=3, src_port=61000, flow_label=fl(61000)), b2]
        ql.follow(held)
        with rule:
            eng.connect(PEER, 4)
        print(json.dumps([[q.port, q.lane] for q in rule.qps()]))
        rule.close()
    """)
    assert out == [[61000, 0], [60001, 1], [61000, 0], [60001, 1]]
