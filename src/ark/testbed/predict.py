"""The fluid simulator's prediction for the testbed's own flows.

A testbed run measures FCTs of real TCP flows; :func:`predict` runs
:class:`ark.sim.engine.FluidSim` over exactly those flows (same hosts, bytes and start
times) on the fabric the testbed builds, so the two can be put side by side. The fabric
is :meth:`TestbedSpec.scaled_fabric`: every rate is the nominal one times ``spec.scale``,
as the tbf shapers set them, while the flows' bytes are already scaled by
:func:`ark.testbed.plan.spec_flows`; times are therefore in the testbed's own seconds.
Switches hash the testbed's destination port and ARK hands out ports from its port range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ark.core.flows import FlowSpec
from ark.sim.balancers import SchemeParams, SplitParams
from ark.sim.engine import FluidSim
from ark.testbed.fabric import TestbedError, TestbedSpec

PREDICTED_SCHEMES = ("ecmp", "ark", "ark-balance", "ark-split")  # what the testbed runs
# What a fluid model is blind to; a measurement differs from the prediction by these.
MODEL = ("fluid max-min sharing at the scaled link rates x TCP/1500 goodput; leaves out TCP slow start, "
         "loss and its recovery (timeouts), per-packet timing and the tbf queues, the control plane's delay "
         "and CPU (agents and probes; reservations here take {delay_us:g} us and all ports are known), "
         "and the hosts' contention for the machine's 2 cores")


def _ideal_s(spec: TestbedSpec, flows: Sequence[FlowSpec]) -> np.ndarray:
    """Each flow alone on the fabric: bytes over the goodput of the slower NIC of its pair."""
    fab = spec.scaled_fabric()
    nic = [h.nic_bps for h in fab.hosts]
    return np.asarray([f.nbytes * 8 / (min(nic[f.src], nic[f.dst]) * fab.efficiency) for f in flows])


def predict(spec: TestbedSpec, flows: Sequence[FlowSpec], scheme: str, seed: int,
            control_delay_s: float = 20e-6, parts: int | None = None) -> dict[str, Any]:
    """Simulated FCTs (s) of ``flows`` on the testbed ``spec`` under ``scheme``.

    ``seed`` fixes the simulator's draws (ECMP's source ports; ARK's per-host choices).
    ``parts``: ``ark-split``'s parts per flow (None: one per path between two leaves, what
    the agents' size-aware choice gives the testbed's flows).
    """
    if scheme not in PREDICTED_SCHEMES:
        raise TestbedError(f"scheme: must be one of {', '.join(PREDICTED_SCHEMES)}; got {scheme!r}")
    if not flows:
        raise TestbedError("flows: nothing to predict")
    fab = spec.scaled_fabric()
    widest = max(fab.n_paths(0, b) for b in range(1, fab.n_hosts))  # host 0 to another pod or leaf
    params = SchemeParams(split=SplitParams(parts=parts or widest))
    sim = FluidSim(fab, scheme, seed=seed, control_delay_s=control_delay_s, dport=spec.dport,
                   port_range=spec.port_range, params=params)
    res = sim.run(flows)
    fct = np.asarray([f.fct_s for f in res.flows])
    ideal = _ideal_s(spec, flows)
    return {
        "scheme": scheme, "seed": seed, "flows": len(res.flows),
        "finished": int(np.isfinite(fct).sum()),
        "link_mbps": spec.link_gbps * spec.scale * 1e3,
        "fct_mean_s": float(fct.mean()), "fct_p50_s": float(np.percentile(fct, 50)),
        "fct_p95_s": float(np.percentile(fct, 95)),
        # Alone on the fabric: what the FCTs are slowed down from.
        "ideal_mean_s": float(ideal.mean()),
        "slowdown_mean": float(np.mean(fct / ideal)),
        "races": res.races, "fallbacks": res.fallbacks, "path_mismatches": res.path_mismatches,
        "model": MODEL.format(delay_us=control_delay_s * 1e6),
    }


def predict_all(spec: TestbedSpec, flows: Sequence[FlowSpec], schemes: Sequence[str] = PREDICTED_SCHEMES,
                seed: int = 0, control_delay_s: float = 20e-6) -> dict[str, dict[str, Any]]:
    """:func:`predict` for each scheme over the same flows and seed (common random numbers)."""
    return {s: predict(spec, flows, s, seed, control_delay_s) for s in schemes}


def relative_to_ecmp(preds: dict[str, dict[str, Any]], key: str = "fct_mean_s") -> dict[str, float]:
    """Each non-ECMP scheme's ``key`` relative to ECMP's: (scheme - ecmp) / ecmp, e.g. -0.14 for 14% lower."""
    if "ecmp" not in preds:
        raise TestbedError("preds: needs an ecmp prediction to compare with")
    base = preds["ecmp"][key]
    return {s: (p[key] - base) / base if base > 0 else math.nan for s, p in preds.items() if s != "ecmp"}
