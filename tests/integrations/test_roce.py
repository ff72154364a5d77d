"""RoCEv2 source ports and GRH flow labels: the mapping against the kernel's formula, leases, `ark ports --roce`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ark.core.node import Lease
from ark.core.roce import (
    LABELS_PER_PORT,
    ROCE_PORTS,
    calc_flow_label,
    flow_label_for_sport,
    flow_labels_for_sport,
    is_roce_sport,
    udp_sport,
    udp_sport_from_flow_label,
)
from ark.integrations.preload import Laned
from ark.integrations.verbs import VerbsError, lease_ports, peer_gid, rules_env


def kernel_flow_label_to_udp_sport(fl: int) -> int:
    """Linux's rdma_flow_label_to_udp_sport() (include/rdma/ib_verbs.h), transcribed:
    fl_low = fl & 0x03fff; fl_high = fl & 0xFC000; fl_low ^= fl_high >> 14;
    return (u16)(fl_low | IB_ROCE_UDP_ENCAP_VALID_PORT_MIN)."""
    fl_low = fl & 0x03FFF
    fl_high = fl & 0xFC000
    fl_low ^= fl_high >> 14
    return (fl_low | 0xC000) & 0xFFFF


def kernel_calc_flow_label(lqpn: int, rqpn: int) -> int:
    """Linux's rdma_calc_flow_label(): v = (u64)lqpn * rqpn; v ^= v >> 20; v ^= v >> 40;
    return (u32)(v & IB_GRH_FLOWLABEL_MASK)."""
    v = (lqpn * rqpn) % (1 << 64)
    v ^= v >> 20
    v ^= v >> 40
    return v & 0xFFFFF


def test_every_roce_port_has_the_label_the_kernel_maps_back_to_it() -> None:
    # Every one of the 2**20 labels through the kernel's formula: the exact inverse image of each port.
    inverse: dict[int, list[int]] = {}
    for fl in range(1 << 20):
        inverse.setdefault(kernel_flow_label_to_udp_sport(fl), []).append(fl)
    assert sorted(inverse) == list(range(0xC000, 0x10000)) and len(inverse) == ROCE_PORTS == 16384
    for port in range(0xC000, 0x10000):
        fl = flow_label_for_sport(port)
        assert fl is not None and 0 < fl < 1 << 20, port
        assert kernel_flow_label_to_udp_sport(fl) == port and udp_sport_from_flow_label(fl) == port
        labels = [x for x in inverse[port] if x]  # label 0 means "derive from the QP numbers"
        assert flow_labels_for_sport(port) == labels and fl in labels
        assert len(labels) == (LABELS_PER_PORT - 1 if port == 0xC000 else LABELS_PER_PORT)
    # 0xC000's natural label is 0, which the kernel reads as "hash the QP numbers": another one.
    assert 0 in inverse[0xC000] and flow_label_for_sport(0xC000) == 0x4001
    for port in (0, 1234, 0xBFFF, 0x10000, -1):
        assert flow_label_for_sport(port) is None and flow_labels_for_sport(port) == [] and not is_roce_sport(port)


def test_label_zero_derives_the_port_from_the_qp_numbers() -> None:
    for lqpn, rqpn in ((0x100, 0x9000), (0xFFFFFF, 0xFFFFFF), (1, 0), (0x1234, 0x5678)):
        assert calc_flow_label(lqpn, rqpn) == kernel_calc_flow_label(lqpn, rqpn)
        assert udp_sport(0, lqpn, rqpn) == kernel_flow_label_to_udp_sport(kernel_calc_flow_label(lqpn, rqpn))
        assert udp_sport(0x345, lqpn, rqpn) == 0xC345  # a label given wins
    assert calc_flow_label(7, 9) == calc_flow_label(9, 7)  # symmetric: both ends derive the same


def lease(port: int, reserved: bool = True, path: int = 0) -> Lease:
    return Lease((0, port), 1, path, port, flow_label_for_sport(port), 10.0, reserved)


def test_a_lease_carries_its_ports_label_and_gives_one_lane_per_reserved_part() -> None:
    parts = [lease(49153, path=0), lease(50000, reserved=False, path=1), lease(60001, path=2)]
    assert [le.flow_label for le in parts] == [1, 848, 60001 & 0x3FFF]
    assert lease_ports(parts) == Laned([49153, 60001], [0, 1])
    assert lease_ports([lease(50000, reserved=False)]) == Laned([], [])
    with pytest.raises(VerbsError, match=r"^lease.src_port: 40000 is outside 49152-65535"):
        lease_ports([lease(40000)])


def test_peer_gids_and_the_rules_variable() -> None:
    assert peer_gid("10.0.1.1") == bytes(10) + b"\xff\xff" + bytes([10, 0, 1, 1])
    assert peer_gid("fe80::1") == bytes([0xFE, 0x80]) + bytes(13) + b"\x01"
    assert rules_env({"10.0.1.1": [49153, 50000], "10.0.2.1": Laned([49152, 60000], [0, 1])}) == \
        "10.0.1.1=49153,50000;10.0.2.1=49152/0,60000/1"
    for bad, field in (({"nohost": [49153]}, "peer"), ({"10.0.1.1": [1234]}, "ports"),
                       ({"10.0.1.1": Laned([49153], [0, 1])}, "lanes")):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            rules_env(bad)


def test_cli_ports_roce_lists_every_path_with_labels(tmp_path: Path) -> None:
    from ark.agent.loopback import write_cluster

    cfile, names = write_cluster(tmp_path, 2)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ark", "ports", "--cluster", str(cfile), "--host",  # noqa: E731
                                     names[0], "--peer", names[1], "--roce", *a], capture_output=True, text=True,
                                    env={**os.environ, "COLUMNS": "200"}, timeout=120, check=False)
    p = run("--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["port_range"] == [49152, 65535] and len(d["paths"]) == 4
    every = sorted(x for path in d["paths"] for x in path["ports"])
    assert every == list(range(49152, 65536))
    for path in d["paths"]:
        assert [kernel_flow_label_to_udp_sport(fl) for fl in path["flow_labels"]] == path["ports"]
    p = run("--limit", "3")
    assert p.returncode == 0 and "RoCEv2 source ports per path" in p.stdout and "(0x" in p.stdout
    assert "docs/engines/roce.md" in p.stdout


def test_the_engine_table_says_which_route_reaches_each_rdma_engine() -> None:
    from ark.integrations.catalog import ENGINES

    rdma = {e.engine: e for e in ENGINES if e.transport == "RDMA (RoCEv2)"}
    assert "NCCL_IBVERBS_LIB" in rdma["NCCL (net_ib)"].knob and "proxy thread" in rdma["NCCL (net_ib)"].ark_today
    assert "LD_PRELOAD" in rdma["Mooncake Transfer Engine"].ark_today
    assert "not reached" in rdma["UCX (and NIXL over UCX)"].ark_today
    assert "49152" in rdma["UCX (and NIXL over UCX)"].scope and "65472" in rdma["UCX (and NIXL over UCX)"].scope
    tcp = {e.engine: e for e in ENGINES if e.transport == "TCP"}
    assert "ARK_STEER_RULES" in tcp["UCX (and NIXL over UCX)"].ark_today
    assert tcp["UCX (and NIXL over UCX)"].grain.startswith("per connection")
    assert tcp["Mooncake Transfer Engine"].grain.startswith("per transfer")
    assert all(e.grain.split(" (")[0] in ("per transfer", "per connection", "per QP", "none") for e in ENGINES)
    # Every RDMA row says how far its route was checked, and none claims a real wire yet.
    assert all(e.verified for e in rdma.values())
    assert not any("real wire" in e.verified and "no real wire" not in e.verified for e in rdma.values())
