"""The pure core: no sockets, no clocks, no global random; ``now`` is always passed in.

* :mod:`ark.core.topology`      fabric descriptions: hosts, switches, directed links, paths
* :mod:`ark.core.fabric_config` the ``[fabric]`` table every config file shares
* :mod:`ark.core.hashing`       switch ECMP hash models, scalar and vectorised
* :mod:`ark.core.pathmap`       path maps M(p_k), their cache and files, source-port buckets
* :mod:`ark.core.roce`          RoCEv2 flow label <-> UDP source port
* :mod:`ark.core.flows`         the description of one KV flow
* :mod:`ark.core.messages`      RESERVE / RENEW / RELEASE and their wire format
* :mod:`ark.core.protocol`      ``ArkCore``: the replicated reservation table of one host
* :mod:`ark.core.node`          ``Node``: replication between hosts, leases, resync, timers
* :mod:`ark.core.schema`        typed config decoding with one-line errors
"""
