"""What each KV-transfer engine lets a caller choose about its source ports, today.

ARK steers a flow by its source port (RoCEv2: the UDP source port, which a GRH flow label
or ``mlx5dv_modify_qp_udp_sport`` sets; TCP: the port bound before ``connect()``). Per-transfer
steering needs the engine to take a port (or flow label) per connection or QP, per transfer.
This table says what each engine takes; ``ark ports --engines`` prints it and the docs pages
under ``docs/engines/`` explain it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKnob:
    engine: str
    transport: str
    knob: str  # the setting, or "none"
    scope: str  # what one value of it applies to
    ark_today: str  # what ARK can do with it now
    per_transfer_needs: str  # what the engine would need for per-transfer steering


ENGINES: tuple[EngineKnob, ...] = (
    EngineKnob(
        "Mooncake Transfer Engine", "TCP",
        "none (connects without binding); MC_TCP_ENABLE_CONNECTION_POOL=0: one connection per request, "
        "opened by the submitting thread",
        "each connection",
        "per-transfer steering: ark.integrations.mooncake.SteeredTransferEngine + the connect() interposer "
        "(ark preload); pooled lanes (the default) are refused",
        "nothing more (the interposer binds each one-shot connection)",
    ),
    EngineKnob(
        "Mooncake Transfer Engine", "RDMA (RoCEv2)",
        "MC_MLX5_QP_UDP_SPORTS=p0,p1,...",
        "the whole process: QP i of every endpoint (every peer) gets list[i % n] through "
        "mlx5dv_modify_qp_udp_sport after RTS; read only by source builds with USE_MLX5DV=ON "
        "(the published wheels log that they ignore it)",
        "a static spread: `ark ports --peer P` lists one port per path towards ONE peer; "
        "the same list lands on every other peer's QPs, where its ports hash elsewhere",
        "a source port (or flow label) per QP chosen at transfer time, e.g. an argument of "
        "transfer_sync_write / batch_transfer_sync_write, or a per-endpoint list",
    ),
    EngineKnob(
        "UCX (and NIXL over UCX)", "RDMA (RoCEv2)",
        "UCX_IB_ROCE_PATH_FACTOR, UCX_IB_NUM_PATHS",
        "every QP: source port 0xC000 | (path factor x path index), one port (65472) in practice",
        "nothing",
        "a flow label or source port per endpoint / QP from the caller (NIXL has no such setting)",
    ),
    EngineKnob(
        "UCX (and NIXL over UCX)", "TCP",
        "none (binds the client socket to port 0: the kernel's choice)",
        "each connection",
        "nothing",
        "a local port per connection from the caller",
    ),
    EngineKnob(
        "MoRI", "RDMA (RoCEv2)",
        "MORI_MLX5_ENABLE_UDP_SPORT",
        "the process: rotates the UDP source port per QP",
        "nothing (ports are the engine's, not the caller's)",
        "a caller-chosen port per QP",
    ),
    EngineKnob(
        "UCCL", "RDMA (RoCEv2)",
        "UCCL_UDP_SPORT_BASE",
        "the process: a base for its QPs' UDP source ports",
        "a static choice of the base only",
        "a caller-chosen port per QP",
    ),
    EngineKnob(
        "NVSHMEM", "RDMA (RoCEv2)",
        "none",
        "every QP: 0xC000",
        "nothing",
        "a caller-chosen port or flow label per QP",
    ),
)
