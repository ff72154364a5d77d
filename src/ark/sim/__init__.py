"""The simulator shell: it drives one :class:`ark.core.protocol.ArkCore` per host.

* :mod:`ark.sim.engine`     the discrete-event fluid simulator and its schemes
* :mod:`ark.sim.maxmin`     max-min fair rates by progressive filling
* :mod:`ark.sim.workload`   model shapes, Vidur's Zipf lengths, Poisson and trace arrivals
* :mod:`ark.sim.serving`    compute latency, placement, TTFT / TPOT
* :mod:`ark.sim.config`     experiment files and the embedded default
* :mod:`ark.sim.experiment` sweeps, records and result files
* :mod:`ark.sim.bench`      controller and reproduction benchmarks
"""
