"""ARK: host-side path reservation for KV-cache flows across ECMP fabrics.

One pure core and three shells that drive it (``docs/architecture.md``):

* :mod:`ark.core`     the sans-IO reservation protocol and what it stands on: fabric
  descriptions, switch hash models, path maps, wire messages, replication, config schema
* :mod:`ark.sim`      the fluid fabric simulator, the LLM-serving model, sweeps, benchmarks
* :mod:`ark.agent`    the real control plane: agent daemon, client, cluster files, probing
* :mod:`ark.testbed`  a real fabric in Linux network namespaces with kernel ECMP
* :mod:`ark.cli`      the ``ark`` command, the only layer that prints or plots

The core imports no shell; the simulator and the agent import neither each other nor
the testbed (import-linter contracts in ``pyproject.toml``).
"""

__version__ = "0.1.0"
