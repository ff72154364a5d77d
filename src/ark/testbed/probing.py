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
    agree, total = check_maps(st, pairs, dport)
    sent = sum(v["probes_sent"] for s in stats.values() for v in s.values())
    return {"probes_sent": sent, "probe_wall_s": round(wall, 3),
            "probe_host_s": round(sum(v["seconds"] for s in stats.values() for v in s.values()), 3),
            "probe_agreement_fraction": agree / total if total else math.nan, "probed_ports": total,
            "per_host": stats}


def check_maps(st: State, pairs: Pairs, dport: int | None = None) -> tuple[int, int]:
    """(ports whose map path equals the kernel's choice, ports checked)."""
    dport = st.spec.dport if dport is None else dport
    lay = st.layout
    agree = total = 0
    routes: dict[int, KernelRoutes] = {}
    try:
        for src, dsts in pairs.items():
            leaf = lay.leaf_of(src)
            kr = routes.get(leaf) or routes.setdefault(leaf, KernelRoutes(st, leaf))
            for dst in dsts:
                pm = PathMap.load(map_file(st, src, dst, dport))
                for k, ports in enumerate(pm.buckets):
                    for port in ports.tolist():
                        total += 1
                        agree += kr.spine(src, lay.host_ip(dst), port, dport, pm.proto) == k
    finally:
        for kr in routes.values():
            kr.close()
    return agree, total


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
            agree, total = round(one["probe_agreement_fraction"] * one["probed_ports"]), one["probed_ports"]
        else:
            agree, total = check_maps(st, pairs, dport)
        res["agree"] += agree
        res["probed_ports"] += total
    res["probe_agreement_fraction"] = res.pop("agree") / res["probed_ports"] if res["probed_ports"] else math.nan
    return res
