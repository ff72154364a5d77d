"""ARK: host-side path reservation for KV-cache flows across ECMP fabrics.

Modules:

* :mod:`ark.core.topology`   fabric descriptions (hosts, switches, links, paths)
* :mod:`ark.core.hashing`    switch ECMP hash models, scalar and vectorised
* :mod:`ark.core.pathmap`    boot-time path maps M(p_k) and source-port buckets
* :mod:`ark.core.roce`       RoCEv2 flow-label / UDP source-port facts
* :mod:`ark.core.messages`   RESERVE / RELEASE and their msgpack wire format
* :mod:`ark.core.protocol`   the sans-IO reservation core (one per host)
* :mod:`ark.sim.workload`   model shapes, Vidur's Zipf lengths, Poisson and trace arrivals
* :mod:`ark.sim.serving`    compute latency, placement, TTFT / TPOT
* :mod:`ark.sim.engine`  the fluid fabric simulator
* :mod:`ark.sim.experiment` sweeps, records and result files
* :mod:`ark.sim.config`     TOML configuration and the embedded default
* :mod:`ark.sim.bench`      controller and reproduction benchmarks
* :mod:`ark.core.node`       sans-IO replication: envelopes, sequence numbers, sync, leases
* :mod:`ark.agent.daemon`      the agent daemon (ZeroMQ, CURVE, local API, logs, metrics)
* :mod:`ark.agent.client`     the serving engine's client
* :mod:`ark.agent.cluster`    cluster files
* :mod:`ark.agent.loopback`   real agent processes on loopback (``ark cluster``)
"""

__version__ = "0.1.0"
