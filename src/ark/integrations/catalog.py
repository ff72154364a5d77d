"""What each KV-transfer engine lets a caller choose about its source ports, today.

ARK steers a flow by its source port (RoCEv2: the UDP source port, which a GRH flow label
or ``mlx5dv_modify_qp_udp_sport`` sets; TCP: the port bound before ``connect()``). Per-transfer
steering needs the engine to take a port (or flow label) per connection or QP, per transfer;
without that, ARK's interposers set it from outside (``connect()`` for TCP, ``ibv_modify_qp``
for RoCEv2). This table says what each engine takes and which route reaches it, and how far
that was checked (``verified``), and at which grain a decision applies (``grain``: per
transfer, per connection, per QP); ``ark ports --engines`` prints it and the docs pages under
``docs/engines/`` (RoCEv2: ``roce.md``) explain it.
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
    verified: str = ""  # how far ark_today was checked: real wire, stand-in, or only the engine's source
    conditions: str = ""  # the kernel and driver ark_today needs (RoCEv2 routes)
    grain: str = "none"  # what one steering decision applies to: per transfer, per connection, per QP, none


# Where the verbs interposer's flow label becomes the packet's UDP source port (read in the
# kernel's sources; docs/engines/roce.md): and where a live QP can be moved.
ROCE_CONDITIONS = (
    "the flow label sets the port on mlx5 (ConnectX) since Linux 5.8, on rxe (Soft-RoCE), irdma (E810) and hns "
    "since the rdma_get_udp_sport() patches (Linux 5.17 by the usual account, the merging release not checked); "
    "other drivers not checked; the NIC's firmware decides what "
    "goes on the wire (ark testbed roce-check settles it for a machine). Live re-path: mlx5 with "
    "rts2rts_qp_udp_sport, rdma-core 33+"
)


ENGINES: tuple[EngineKnob, ...] = (
    EngineKnob(
        "Mooncake Transfer Engine", "TCP",
        "none (connects without binding); MC_TCP_ENABLE_CONNECTION_POOL=0: one connection per request, "
        "opened by the submitting thread",
        "each connection",
        "per-transfer steering: SteeredTransferEngine (ark.integrations.mooncake) + the connect() interposer "
        "(ark preload); pooled connections (0.3.12 with the variable at 1, 0.3.13's default) are refused",
        "nothing more (the interposer binds each one-shot connection)",
        "the mooncake-transfer-engine wheel over real TCP (tests/integrations/test_mooncake.py, the testbed)",
        grain="per transfer (each one-shot connection on a port of the transfer's lease)",
    ),
    EngineKnob(
        "Mooncake Transfer Engine", "RDMA (RoCEv2)",
        "MC_MLX5_QP_UDP_SPORTS=p0,p1,...",
        "the whole process: QP i of every endpoint (every peer) gets list[i % n] through "
        "mlx5dv_modify_qp_udp_sport after RTS; read only by source builds with USE_MLX5DV=ON "
        "(the published wheels log that they ignore it)",
        "the verbs interposer (LD_PRELOAD, ark.integrations.verbs) with a rule installed per peer: its "
        "transfer worker threads connect an endpoint's QPs on the first transfer to a peer and reuse them, so "
        "they keep the path of the lease in force then (live re-path: mlx5 only); leave "
        "MC_MLX5_QP_UDP_SPORTS unset, it overrides the flow label after RTS. Without the interposer: a "
        "static spread, `ark ports --peer P` lists one port per path towards ONE peer",
        "a source port (or flow label) per QP chosen at transfer time, e.g. an argument of "
        "transfer_sync_write / batch_transfer_sync_write, or a per-endpoint list",
        "stand-in libibverbs (linked calls, process rules); Mooncake's RTR and threads read in its source; "
        "no real wire yet",
        ROCE_CONDITIONS,
        grain="per QP (at connect time; the QPs of an endpoint are kept)",
    ),
    EngineKnob(
        "NCCL (net_ib)", "RDMA (RoCEv2)",
        "NCCL_IBVERBS_LIB (the verbs library it dlopen()s)",
        "every QP of the process: NCCL resolves each verbs function with dlvsym(handle, ..., \"IBVERBS_1.1\")",
        "NCCL_IBVERBS_LIB naming libarkverbs.so (it depends on libibverbs.so.1, so the rest resolves there) "
        "and a rule installed per peer: NCCL connects on its proxy thread, once per communicator and "
        "channel, so QPs keep the path of the lease in force at connect time. LD_PRELOAD alone reaches only "
        "builds with NCCL_BUILD_RDMA_CORE (linked verbs)",
        "a flow label or source port per QP from the caller (per transfer, not per communicator)",
        "stand-in libibverbs loaded through dlopen + dlvsym with NCCL's symbol list; no real wire yet",
        ROCE_CONDITIONS,
        grain="per QP (at connect time, once per communicator and channel)",
    ),
    EngineKnob(
        "UCX (and NIXL over UCX)", "RDMA (RoCEv2)",
        "UCX_IB_ROCE_PATH_FACTOR, UCX_IB_NUM_PATHS",
        "every QP between two hosts on one port: DEVX QPs (rc_mlx5, the default on mlx5) write "
        "udp_sport = 0xC000 | (path factor x path index), 49152 for path 0; verbs QPs (rc_verbs, or "
        "rc_mlx5 without DEVX QPs) set the flow label ~(path factor x path index), which maps to 65472",
        "rc_verbs, and rc_mlx5 with UCX_IB_MLX5_DEVX_OBJECTS lacking rcqp (or UCX_IB_MLX5_DEVX=n), connect "
        "through ibv_modify_qp: the verbs interposer (LD_PRELOAD, a rule installed per peer) sets their "
        "label. rc_mlx5 with DEVX QPs writes udp_sport into the QP context itself and dc_mlx5 addresses "
        "per operation: not reached",
        "a flow label or source port per endpoint / QP from the caller (NIXL has no such setting)",
        "UCX's connect paths read in its source; nothing run",
        ROCE_CONDITIONS,
        grain="per QP (verbs QPs only, at connect time)",
    ),
    EngineKnob(
        "UCX (and NIXL over UCX)", "TCP",
        "UCX_TCP_EP_BIND_SRC_ADDR (default try: bind ifaddr:0 before connect(); n: no bind); "
        "UCX_TCP_PORT_RANGE=P-P fixes the listener port",
        "each connection, opened once per peer and UCX worker and kept",
        "per-connection steering, no code in the engine: the connect() interposer (LD_PRELOAD) with "
        "ARK_STEER_RULES naming the peers' addresses and listener port and one port group per path, or a "
        "connection lease per connection (lease:/PATH, python -m ark.integrations.connlease: held while the "
        "kernel lists the connection, given back when it closes or idles); "
        "UCX's bind to ifaddr:0 is deferred to connect(). Steer the process that opened the connection the "
        "KV bytes ride: a NIXL READ whose target never loaded the reader's metadata (vLLM's NixlConnector) "
        "sends the bytes back on the reader's connection (steer the decode side, ports from a map of the "
        "reverse direction); with metadata loaded both ways, on the target's own connection (steer the "
        "prefill side)",
        "a source port per connection from the caller, chosen when the endpoint is created",
        "nixl-cu12 1.5.1 (bundled UCX 1.23.0) DRAM-to-DRAM over UCX_TLS=tcp between namespace hosts, KV "
        "bytes counted at the spines, port lists and connection leases from real agents "
        "(tests/testbed/test_nixl_testbed.py); vLLM's NixlConnector (CPU KV cache) one request, "
        "the decode side steered (tests/testbed/test_vllm_nixl_testbed.py)",
        grain="per connection (one path per connection; a peer pair's connections take the paths in turn)",
    ),
    EngineKnob(
        "MoRI", "RDMA (RoCEv2)",
        "MORI_MLX5_ENABLE_UDP_SPORT",
        "the process: rotates the UDP source port per QP",
        "nothing (ports are the engine's, not the caller's)",
        "a caller-chosen port per QP",
        "not checked against its source",
    ),
    EngineKnob(
        "UCCL", "RDMA (RoCEv2)",
        "UCCL_UDP_SPORT_BASE",
        "the process: a base for its QPs' UDP source ports",
        "a static choice of the base only",
        "a caller-chosen port per QP",
        "not checked against its source",
    ),
    EngineKnob(
        "NVSHMEM", "RDMA (RoCEv2)",
        "none",
        "every QP: 0xC000",
        "nothing: whether its QPs connect through the host's ibv_modify_qp was not checked (GPU-initiated "
        "IBGDA QPs bypass the host library)",
        "a caller-chosen port or flow label per QP",
        "not checked against its source",
    ),
    EngineKnob(
        "plain verbs programs (perftest, ibv_rc_pingpong, librdmacm users)", "RDMA (RoCEv2)",
        "none",
        "each QP, at INIT -> RTR",
        "the verbs interposer (LD_PRELOAD): a rule entered by the connecting thread, installed for the "
        "process, or given in ARK_VERBS_RULES",
        "nothing more",
        "stand-in libibverbs; ark testbed roce-check runs ib_write_bw over Soft-RoCE on the testbed "
        "(needs rdma_rxe: not run on the machine this was written on)",
        ROCE_CONDITIONS,
        grain="per QP (at INIT -> RTR)",
    ),
)
