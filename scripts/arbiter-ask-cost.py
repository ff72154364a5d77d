"""Arbiter CPU per multi-part ask as the table grows: one host asks ``--asks`` leases of
``--parts`` parts to one destination (every path taken, so later parts share), on a 2-leaf
fabric of ``--spines`` spines, the sans-IO core only (no sockets). Prints the mean CPU ms per
ask over the first and the last tenth of the asks, and optionally a cProfile of the run.
``--churn N``: then N rounds of releasing ``--parts`` random flows and asking again (the
table stays as full); the mean CPU ms per ask of those.

    python scripts/arbiter-ask-cost.py --policy ark-balance --asks 250 --parts 16 [--churn 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from ark.core import arbiter_wire as w
from ark.core.arbiter import Arbiter, ArbiterLimits, ArbiterOut
from ark.core.fabric_config import FabricConfig
from ark.core.lease import LeasePolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="ark-balance")
    ap.add_argument("--asks", type=int, default=250)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--spines", type=int, default=4)
    ap.add_argument("--churn", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    fabric = FabricConfig(leaves=2, spines=a.spines, gpus_per_leaf=2).build()
    lim = ArbiterLimits(rate_per_host=1e9, burst_per_host=1 << 20)
    arb = Arbiter(fabric, policy=a.policy, lease=LeasePolicy(30.0), limits=lim)
    t = 1000.0
    arb.start(t)
    times = []
    live: list[tuple[int, int]] = []
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    for rid in range(1, a.asks + 1):
        data = w.encode(w.Ask(rid, 0, 2, 10**9, 4791, a.parts))  # host 0 -> host 2: the other leaf
        t0 = time.process_time()
        out = arb.on_host(0, data, t)
        arb.flush()
        times.append(time.process_time() - t0)
        t += 0.0001
        live += _reserved(out)
    churn = []
    rng = random.Random(1)
    for rid in range(a.asks + 1, a.asks + 1 + a.churn):
        gone = [live.pop(rng.randrange(len(live))) for _ in range(min(a.parts, len(live)))]
        if gone:
            arb.on_host(0, w.encode(w.Drop(rid, 0, gone)), t)
        t0 = time.process_time()
        out = arb.on_host(0, w.encode(w.Ask(rid + (1 << 20), 0, 2, 10**9, 4791, a.parts)), t)
        arb.flush()
        churn.append(time.process_time() - t0)
        t += 0.0001
        live += _reserved(out)
    if prof:
        prof.disable()
    k = max(1, a.asks // 10)
    first, last = sum(times[:k]) / k * 1e3, sum(times[-k:]) / k * 1e3
    print(f"policy={a.policy} asks={a.asks} parts={a.parts} spines={a.spines}: "
          f"ms per ask first {k}: {first:.3f}, last {k}: {last:.3f}, mean: {sum(times) / len(times) * 1e3:.3f}, "
          f"table: {len(arb.table.table())} flows")
    if churn:
        print(f"churn: {len(churn)} rounds of {a.parts} releases then an ask: ms per ask {sum(churn) / len(churn) * 1e3:.3f}, "
              f"table: {len(arb.table.table())} flows")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


def _reserved(out: list[ArbiterOut]) -> list[tuple[int, int]]:
    g = w.decode_to_host(out[0].data) if out else None
    return [p.flow for p in g.parts if p.reserved] if isinstance(g, w.Grant) else []


if __name__ == "__main__":
    main()
