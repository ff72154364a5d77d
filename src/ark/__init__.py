"""ARK: host-side path reservation for KV-cache flows across ECMP fabrics.

Modules:

* :mod:`ark.topology`   fabric descriptions (hosts, switches, links, paths)
* :mod:`ark.hashing`    switch ECMP hash models, scalar and vectorised
* :mod:`ark.pathmap`    boot-time path maps M(p_k) and source-port buckets
* :mod:`ark.roce`       RoCEv2 flow-label / UDP source-port facts
* :mod:`ark.messages`   RESERVE / RELEASE and their msgpack wire format
* :mod:`ark.protocol`   the sans-IO reservation core (one per host)
* :mod:`ark.workload`   model shapes, Vidur's Zipf lengths, Poisson and trace arrivals
* :mod:`ark.serving`    compute latency, placement, TTFT / TPOT
* :mod:`ark.simulator`  the fluid fabric simulator
* :mod:`ark.experiment` sweeps, records and result files
* :mod:`ark.config`     TOML configuration and the embedded default
* :mod:`ark.bench`      controller and reproduction benchmarks
* :mod:`ark.node`       sans-IO replication: envelopes, sequence numbers, sync, leases
* :mod:`ark.agent`      the agent daemon (ZeroMQ, CURVE, local API, logs, metrics)
* :mod:`ark.client`     the serving engine's client
* :mod:`ark.cluster`    cluster files
* :mod:`ark.loopback`   real agent processes on loopback (``ark cluster``)
"""

__version__ = "0.1.0"
