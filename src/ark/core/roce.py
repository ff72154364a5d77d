"""RoCEv2 source-port facts (Linux RDMA core, include/rdma/ib_verbs.h)."""

from __future__ import annotations

ROCE_SPORT_MIN = 0xC000


def udp_sport_from_flow_label(flow_label: int) -> int:
    """``rdma_flow_label_to_udp_sport``: the UDP source port a NIC emits for a label."""
    fl_low = flow_label & 0x3FFF
    fl_high = flow_label & 0xFC000
    fl_low ^= fl_high >> 14
    return fl_low | ROCE_SPORT_MIN


def flow_label_for_sport(port: int) -> int | None:
    """A nonzero 20-bit GRH flow label that makes the NIC emit ``port``.

    Only 0xC000..0xFFFF is reachable. 0xC000 needs label 0x4001, because label 0 means
    "derive the port from the QP numbers".
    """
    if not ROCE_SPORT_MIN <= port <= 0xFFFF:
        return None
    fl = port & 0x3FFF
    return fl if fl else 0x4001
