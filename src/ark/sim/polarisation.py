"""Hash polarisation on a 3-tier Clos: which paths a hash lets packets reach, and what ARK
can still do about it.

When the leaf and the aggregation switch above it compute the same hash of the same key
(same model, seed and selection), the aggregation switch's choice is a function of the
leaf's: with ``A`` aggregation switches and ``R`` cores per plane, only ``A`` of the
``A x R`` paths between two pods ever carry a packet, whatever the source port. Operators
give every switch its own seed. That helps a hash that mixes its seed in (MurmurHash,
SipHash); a CRC or XOR hash is affine in its key, and a seed fed in as key data only adds a
constant, so the two switches' choices stay tied. A different hash model per tier unties
them.

:func:`reachability` measures the share of paths a fabric lets packets reach (from the
path maps, which invert every hop). :func:`ark_under_polarisation` runs ECMP and ARK on a
polarised and on a per-switch-seeded fabric: ARK's maps know which paths are reachable,
so it never reserves an unreachable one, but it cannot reach them either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ark.core.clos import ClosFabric, clos3
from ark.core.pathmap import ROCE_PORT_RANGE, fabric_pathmap
from ark.sim.config import ExperimentConfig, from_dict
from ark.sim.experiment import RunSpec, run_sweep

HASHES = ("murmur3-hpcc", "crc32", "crc32-lo", "crc16-ccitt", "xor16")
# (name, fabric keys): how the tiers are seeded.
SEEDINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("one hash, one seed on every switch", {"seed": 0}),
    ("one hash, a seed per switch", {}),
    ("another hash at the aggregation tier, a seed per switch", {"agg_hash": "other"}),
)
# The fabric of the FCT comparison: 4 pods x 2 leaves x 8 GPUs, 4 aggregation switches
# and 4 cores per plane (16 paths between pods), 2:1 at the leaves, 1:1 above.
SIM_FABRIC: dict[str, Any] = {"pods": 4, "leaves_per_pod": 2, "aggs_per_pod": 4, "cores_per_plane": 4,
                              "gpus_per_leaf": 8, "oversubscription": [2.0, 1.0]}
SIM_QPS = (20.0, 40.0, 60.0, 80.0)


def _other(name: str) -> str:
    return "crc16-ccitt" if name != "crc16-ccitt" else "crc32"


def reachability(fabric: ClosFabric, pairs: int = 32, seed: int = 0,
                 port_range: tuple[int, int] = ROCE_PORT_RANGE) -> dict[str, float]:
    """Share of the paths between pods that some source port reaches (``pairs`` random
    cross-pod host pairs; mean and minimum over them)."""
    rng = np.random.default_rng(seed)
    shares: list[float] = []
    while len(shares) < pairs:
        s, d = (int(x) for x in rng.integers(0, fabric.n_hosts, 2))
        if fabric.pod_of(s) == fabric.pod_of(d):
            continue
        counts = fabric_pathmap(fabric, s, d, 4791, port_range).counts()
        shares.append(sum(c > 0 for c in counts) / len(counts))
    return {"mean": float(np.mean(shares)), "min": float(np.min(shares)), "paths": fabric.n_paths(s, d)}


def reachability_table(preset: dict[str, Any], pairs: int = 32) -> list[dict[str, Any]]:
    """:func:`reachability` for every hash model under every seeding of :data:`SEEDINGS`."""
    rows = []
    for h in HASHES:
        for label, keys in SEEDINGS:
            kw = dict(keys)
            if kw.get("agg_hash") == "other":
                kw["agg_hash"] = _other(h)
            fab = clos3(**preset, hash=h, **kw)
            rows.append({"hash": h, "agg_hash": kw.get("agg_hash", h), "seeding": label,
                         **reachability(fab, pairs)})
    return rows


def sim_config(polarised: bool, requests: int, seeds: int, qps: tuple[float, ...]) -> ExperimentConfig:
    fabric = {**SIM_FABRIC, "hash": "murmur3-hpcc", **({"seed": 0} if polarised else {})}
    return from_dict({"fabric": fabric, "workload": {"requests": requests, "qps": list(qps)},
                      "serving": {"placement": "random"},
                      "experiment": {"schemes": ["ecmp", "ark"], "seeds": seeds}})


def ark_under_polarisation(requests: int = 1000, seeds: int = 2, qps: tuple[float, ...] = SIM_QPS, jobs: int = 1,
                           progress: Callable[[RunSpec], None] | None = None) -> list[dict[str, Any]]:
    """Mean and P95 FCT of ECMP and ARK, polarised and per-switch-seeded, per QPS (mean over seeds)."""
    rows = []
    for polarised in (True, False):
        sw = run_sweep(sim_config(polarised, requests, seeds, qps), jobs=jobs, progress=progress)
        for q in qps:
            for scheme in ("ecmp", "ark"):
                rs = [r for r in sw.records if r["qps"] == q and r["scheme"] == scheme]
                rows.append({"fabric": "polarised" if polarised else "seed per switch", "scheme": scheme, "qps": q,
                             "offered_load": float(np.mean([r["offered_load"] for r in rs])),
                             "fct_mean_s": float(np.mean([r["fct_mean_s"] for r in rs])),
                             "fct_p95_s": float(np.mean([r["fct_p95_s"] for r in rs])),
                             "path_mismatches": int(sum(r["path_mismatches"] for r in rs)),
                             "max_concurrent_per_core": [max(r["max_concurrent_per_spine"][k] for r in rs)
                                                         for k in range(len(rs[0]["max_concurrent_per_spine"]))]})
    return rows
