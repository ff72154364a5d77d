"""RoCEv2 source-port facts (Linux RDMA core, include/rdma/ib_verbs.h).

A RoCEv2 NIC puts a QP's packets in UDP datagrams to port 4791. Linux derives their UDP
source port from the 20-bit GRH flow label the QP is given when it moves INIT -> RTR
(``rdma_get_udp_sport``): a label of 0 means "none given", and the kernel then derives a
label from the two QP numbers (``rdma_calc_flow_label``). ``rdma_flow_label_to_udp_sport``
folds the label's top 6 bits into its low 14 and sets the top two bits of the port, so only
ports 0xC000..0xFFFF (16,384 of them) are reachable, each from 64 labels.
"""

from __future__ import annotations

ROCE_SPORT_MIN = 0xC000
ROCE_SPORT_MAX = 0xFFFF
ROCE_PORTS = ROCE_SPORT_MAX - ROCE_SPORT_MIN + 1  # 16,384
FLOW_LABEL_MASK = 0xFFFFF  # IB_GRH_FLOWLABEL_MASK: a GRH flow label has 20 bits
LABELS_PER_PORT = (FLOW_LABEL_MASK + 1) // ROCE_PORTS  # 64


def udp_sport_from_flow_label(flow_label: int) -> int:
    """``rdma_flow_label_to_udp_sport``: the UDP source port a NIC emits for a label."""
    fl_low = flow_label & 0x3FFF
    fl_high = flow_label & 0xFC000
    fl_low ^= fl_high >> 14
    return fl_low | ROCE_SPORT_MIN


def calc_flow_label(lqpn: int, rqpn: int) -> int:
    """``rdma_calc_flow_label``: the label the kernel derives when none was given (label 0)
    from the local and remote QP numbers (symmetric, so both ends derive the same)."""
    v = (lqpn * rqpn) & 0xFFFFFFFFFFFFFFFF
    v ^= v >> 20
    v ^= v >> 40
    return v & FLOW_LABEL_MASK


def udp_sport(flow_label: int, lqpn: int, rqpn: int) -> int:
    """``rdma_get_udp_sport``: the source port of a QP given ``flow_label`` at RTR."""
    return udp_sport_from_flow_label(flow_label or calc_flow_label(lqpn, rqpn))


def is_roce_sport(port: int) -> bool:
    """Whether a flow label can make the NIC emit ``port``."""
    return ROCE_SPORT_MIN <= port <= ROCE_SPORT_MAX


def flow_label_for_sport(port: int) -> int | None:
    """A nonzero 20-bit GRH flow label that makes the NIC emit ``port`` (None outside
    0xC000..0xFFFF).

    The label is the port's low 14 bits (its top 6 bits zero, so nothing is folded in).
    0xC000 would need label 0, which means "derive the port from the QP numbers", so it
    takes 0x4001 instead: top bits 000001 fold onto low bits 1, giving 0.
    """
    if not ROCE_SPORT_MIN <= port <= ROCE_SPORT_MAX:  # is_roce_sport, inline: once per lease
        return None
    fl = port & 0x3FFF
    return fl if fl else 0x4001


def flow_labels_for_sport(port: int) -> list[int]:
    """Every nonzero label that gives ``port`` (64, or 63 for 0xC000 without label 0), in
    increasing order; [] outside 0xC000..0xFFFF."""
    if not is_roce_sport(port):
        return []
    low = port & 0x3FFF
    labels = sorted((high << 14) | (low ^ high) for high in range(LABELS_PER_PORT))
    return [fl for fl in labels if fl]
