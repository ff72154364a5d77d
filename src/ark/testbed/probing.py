"""Path discovery on the testbed: every source host probes from inside its namespace, and
each probed port is checked against the kernel's own route choice."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ark.core.pathmap import PathMap
from ark.testbed.fabric import State, TestbedError, spawn_in_host
from ark.testbed.kernel import KernelRoutes
from ark.testbed.plan import Pairs, cluster_file, map_file

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def probe(st: State, pairs: Pairs, sample: int, cluster: Path | None = None,
          progress: Progress = _quiet, dport: int | None = None) -> dict[str, Any]:
    """Each source host probes its peers (``python -m ark probe`` in its namespace) towards
    ``dport`` (default: the testbed's); maps land in ``maps/``. Returns the probe cost and the
    agreement of every probed port with the kernel."""
    cluster = cluster or cluster_file(st, "ark", 2.0)
    dport = st.spec.dport if dport is None else dport
    t0 = time.perf_counter()
    procs = {}
    for src, dsts in sorted(pairs.items()):
        argv = [sys.executable, "-m", "ark", "probe", "--cluster", str(cluster), "--host", f"gpu{src}",
                "--peers", ",".join(f"gpu{d}" for d in sorted(dsts)), "--sample", str(sample), "--dport", str(dport),
                "--json"]
        procs[src] = spawn_in_host(st, src, argv, st.dir / f"probe-gpu{src}.log")
    stats: dict[str, Any] = {}
    for src, p in procs.items():
        if p.wait(120) != 0:
            raise TestbedError(f"probe on gpu{src} failed; see {st.dir}/probe-gpu{src}.log")
    wall = time.perf_counter() - t0
    for src in procs:
        lines = (st.dir / f"probe-gpu{src}.log").read_text().strip().splitlines()
        stats[f"gpu{src}"] = json.loads(lines[-1])
    progress(f"probed {len(pairs)} hosts in {wall:.2f} s")
    sent = sum(v["probes_sent"] for s in stats.values() for v in s.values())
    return {"probes_sent": sent, "probe_wall_s": round(wall, 3),
            "probe_host_s": round(sum(v["seconds"] for s in stats.values() for v in s.values()), 3),
            **_agreement(st, pairs, dport), "per_host": stats}


def _agreement(st: State, pairs: Pairs, dport: int | None = None) -> dict[str, Any]:
    hops = check_hops(st, pairs, dport)
    total = hops["ports"]
    return {"probe_agreement_fraction": hops["agree_all"] / total if total else math.nan, "probed_ports": total,
            "probe_agreement_by_hop": hops["by_hop"], "probe_checked_by_hop": hops["checked_by_hop"]}


def check_maps(st: State, pairs: Pairs, dport: int | None = None) -> tuple[int, int]:
    """(ports whose map path equals the kernel's choice at every hop, ports checked)."""
    hops = check_hops(st, pairs, dport)
    return hops["agree_all"], hops["ports"]


def _pod_of_leaf(st: State, leaf: int) -> int:
    return leaf // (st.spec.leaves // st.spec.pods) if st.spec.three_tier else 0


def check_hops(st: State, pairs: Pairs, dport: int | None = None) -> dict[str, Any]:
    """How the probed maps agree with the kernel, at each upward hop.

    The leaf's choice is asked of the leaf (``RTM_GETROUTE`` as from the host); on a 3-tier
    testbed, for ports towards another pod, the aggregation switch's choice is asked of
    the switch the leaf picked, as for a packet that came up from that leaf. A port agrees
    at a hop when the kernel's next hop there is the one its mapped path says.
    """
    lay, spec = st.layout, st.spec
    dport = spec.dport if dport is None else dport
    agree, checked = [0, 0], [0, 0]
    agree_all = ports_total = 0
    routes: dict[tuple[int, int | None], KernelRoutes] = {}

    def kernel(leaf: int, agg: int | None = None) -> KernelRoutes:
        kr = routes.get((leaf, agg))
        if kr is None:
            kr = routes[(leaf, agg)] = KernelRoutes(st, leaf, agg)
        return kr

    try:
        for src, dsts in pairs.items():
            leaf, pod = lay.leaf_of(src), _pod_of_leaf(st, lay.leaf_of(src))
            for dst in dsts:
                pm = PathMap.load(map_file(st, src, dst, dport))
                cross = spec.three_tier and pod != _pod_of_leaf(st, lay.leaf_of(dst))
                radix = spec.cores_per_plane if cross else 1
                for k, ports in enumerate(pm.buckets):
                    for port in ports.tolist():
                        ports_total += 1
                        j = kernel(leaf).spine(src, lay.host_ip(dst), port, dport, pm.proto)
                        ok = j == k // radix
                        agree[0] += ok
                        checked[0] += 1
                        if cross:
                            agg = pod * spec.aggs_per_pod + j
                            up = kernel(leaf, agg).spine(src, lay.host_ip(dst), port, dport, pm.proto) == k
                            agree[1] += up
                            checked[1] += 1
                            ok = ok and up
                        agree_all += ok
    finally:
        for kr in routes.values():
            kr.close()
    n_hops = 2 if spec.three_tier else 1
    return {"ports": ports_total, "agree_all": agree_all,
            "by_hop": [agree[h] / checked[h] if checked[h] else math.nan for h in range(n_hops)],
            "checked_by_hop": checked[:n_hops]}


def maps_present(st: State, pairs: Pairs, dport: int | None = None) -> bool:
    return all(map_file(st, s, d, dport).exists() for s, ds in pairs.items() for d in ds)


def probe_or_check(st: State, pairs: Pairs, sample: int, cluster: Path, reprobe: bool,
                   progress: Progress = _quiet, dports: Sequence[int] | None = None) -> dict[str, Any]:
    """Probe (or, with maps already there and ``reprobe`` off, only check them), towards
    each of ``dports`` (default: the testbed's destination port)."""
    if not pairs:
        return {"probes_sent": 0, "probe_agreement_fraction": math.nan}
    res: dict[str, Any] = {"probes_sent": 0, "probed_ports": 0, "agree": 0}
    for dport in dports or [st.spec.dport]:
        if reprobe or not maps_present(st, pairs, dport):
            one = probe(st, pairs, sample, cluster, progress, dport)
            for k, v in one.items():
                if k in ("probe_wall_s", "probe_host_s", "probes_sent"):
                    res[k] = round(res.get(k, 0) + v, 3)
            res["per_host"] = one["per_host"]
        else:
            one = _agreement(st, pairs, dport)
        res["agree"] += round(one["probe_agreement_fraction"] * one["probed_ports"]) if one["probed_ports"] else 0
        res["probed_ports"] += one["probed_ports"]
        res["probe_agreement_by_hop"] = one["probe_agreement_by_hop"]  # the last destination port's
        res["probe_checked_by_hop"] = one["probe_checked_by_hop"]
    res["probe_agreement_fraction"] = res.pop("agree") / res["probed_ports"] if res["probed_ports"] else math.nan
    return res
