"""The agent shell: one process per host drives a :class:`ark.core.node.Node` over ZeroMQ.

* :mod:`ark.agent.daemon`   sockets, CURVE and ZAP, the deadline-driven loop, logs
* :mod:`ark.agent.api`      the local API serving engines call (one handler per op)
* :mod:`ark.agent.client`   the serving engine's client (``ArkClient``, ``lease()``)
* :mod:`ark.agent.cluster`  cluster files: read, checked, written
* :mod:`ark.agent.keys`     CURVE key files, created private
* :mod:`ark.agent.probe`    path discovery by TTL-limited probes (``IP_RECVERR``)
* :mod:`ark.agent.refresh`  probing off the main loop, maps reloaded, flows re-pathed
* :mod:`ark.agent.metrics`  the Prometheus collector
* :mod:`ark.agent.loopback` real agent processes on loopback (``ark cluster``, tests)
"""
