"""The testbed experiment: real KV flows over the namespace fabric, ECMP vs ARK.

One run (scheme, QPS, seed):

1. the flow plan comes from the same workload and placement as the simulator (embedded
   default config), KV bytes multiplied by the testbed's scale;
2. every prefill host probes its decode peers (``python -m ark probe`` inside its
   namespace) and writes its path maps; the maps are checked against the kernel's own
   choice (``RTM_GETROUTE`` with ports, in the leaf);
3. receivers start in the decode hosts, agents (ARK schemes) in every host, AF_PACKET
   counters in every spine, then one sender per prefill host runs its flows;
4. per flow: FCT, and for ARK flows the spine its payload bytes actually crossed against
   the spine its lease reserved.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ark.agent.client import wait_ready
from ark.core.pathmap import PathMap
from ark.testbed.fabric import KernelRoutes, State, TestbedError, counting, set_link, spawn_in_host

TESTBED_SCHEMES = ("ecmp", "ark", "ark-balance")
PROBE_CHECK_S = 0.5  # agents re-probe a few ports this often and refresh on a re-hash
DETECT_TIMEOUT_S = 10.0
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class RunParams:
    scheme: str = "ark"
    requests: int = 200
    qps: float = 20.0
    seed: int = 0
    sample: int = 128  # probed source ports per peer (0: the whole port range)
    lease_min_s: float = 2.0
    # (leaf, spine, seconds after the first flow): take that link down mid-run; hosts then
    # re-probe and agents reload their maps. The link comes back at the end of the run.
    fail_link: tuple[int, int, float] | None = None

    def check(self) -> None:
        if self.scheme not in TESTBED_SCHEMES:
            raise TestbedError(f"scheme: must be one of {', '.join(TESTBED_SCHEMES)}; got {self.scheme!r}")
        if self.requests < 1:
            raise TestbedError(f"requests: must be >= 1; got {self.requests}")
        if not self.qps > 0:
            raise TestbedError(f"qps: must be > 0; got {self.qps}")
        if self.sample < 0:
            raise TestbedError(f"sample: must be >= 0; got {self.sample}")
        if self.fail_link is not None and not self.fail_link[2] >= 0:
            raise TestbedError(f"fail_link: the time must be >= 0 s; got {self.fail_link[2]}")


def plan_flows(st: State, requests: int, qps: float, seed: int) -> tuple[list[dict[str, Any]], float]:
    """KV flows of the simulator's workload, scaled; and the nominal offered load."""
    from ark.sim.config import default
    from ark.sim.experiment import offered_load, place

    cfg = default().with_overrides(requests=requests)
    spec = st.spec
    fab = spec.fabric()
    placed = place(cfg, fab, qps, seed)
    t_first = min(p.kv_start_s for p in placed)
    flows = []
    for i, p in enumerate(placed):
        flows.append({
            "id": i, "src": fab.hosts[p.prefill_gpu].name, "dst": fab.hosts[p.decode_gpu].name,
            "src_index": p.prefill_gpu, "dst_index": p.decode_gpu, "dst_ip": fab.hosts[p.decode_gpu].ip,
            "dport": spec.dport, "bytes": max(1, round(p.kv_bytes * spec.scale)),
            "start_s": round(p.kv_start_s - t_first, 6),
        })
    return flows, offered_load(fab, placed, qps)


def cluster_file(st: State, policy: str, lease_min_s: float, sample: int = 128) -> Path:
    """Keys (once) and a cluster file whose agents talk over the management network."""
    import zmq.auth

    spec, lay = st.spec, st.layout
    keys = st.dir / "keys"
    (st.dir / "maps").mkdir(parents=True, exist_ok=True)
    (st.dir / "api").mkdir(parents=True, exist_ok=True)
    n = spec.leaves * spec.gpus_per_leaf
    lines = [
        "[cluster]", f'policy = "{policy}"', f"dport = {spec.dport}",
        f'port_range = "{spec.port_range[0]}-{spec.port_range[1]}"', f"lease_min_s = {lease_min_s}",
        "heartbeat_s = 0.5", "peer_timeout_s = 2.0", "sync_timeout_s = 1.0", 'pathmap_dir = "maps"',
        'routers_file = "routers.json"', 'probe_proto = "tcp"', f"probe_sample = {sample}",
        f"probe_check_s = {PROBE_CHECK_S}", "",
        "[fabric]", f"leaves = {spec.leaves}", f"spines = {spec.spines}", f"gpus_per_leaf = {spec.gpus_per_leaf}",
        f"link_gbps = {spec.link_gbps * spec.scale!r}", f"nic_gbps = {spec.nic_gbps * spec.scale!r}",
        'transport = "tcp-1500"', "",
    ]
    for i in range(n):
        name = f"gpu{i}"
        if not (keys / f"{name}.key_secret").exists():
            keys.mkdir(parents=True, exist_ok=True)
            zmq.auth.create_certificates(str(keys), name)
        pub, _ = zmq.auth.load_certificate(str(keys / f"{name}.key"))
        lines += ["[[hosts]]", f'name = "{name}"', f'control = "{lay.control(i)}"',
                  f'api = "ipc://{st.dir}/api/{name}.sock"', f'public_key = "{pub.decode()}"',
                  f'secret_key_file = "keys/{name}.key_secret"', ""]
    (st.dir / "routers.json").write_text(json.dumps(lay.routers()))
    path = st.dir / f"cluster-{policy}.toml"
    path.write_text("\n".join(lines))
    return path


def probe(st: State, pairs: dict[int, set[int]], sample: int, cluster: Path | None = None,
          progress: Progress = _quiet) -> dict[str, Any]:
    """Each source host probes its peers from inside its namespace; maps land in ``maps/``.

    Returns the probe cost and the agreement of every probed port with the kernel.
    """
    cluster = cluster or cluster_file(st, "ark", 2.0)
    t0 = time.perf_counter()
    procs = {}
    for src, dsts in sorted(pairs.items()):
        argv = [sys.executable, "-m", "ark", "probe", "--cluster", str(cluster), "--host", f"gpu{src}",
                "--peers", ",".join(f"gpu{d}" for d in sorted(dsts)), "--sample", str(sample), "--json"]
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
    agree, total = check_maps(st, pairs)
    sent = sum(v["probes_sent"] for s in stats.values() for v in s.values())
    return {"probes_sent": sent, "probe_wall_s": round(wall, 3),
            "probe_host_s": round(sum(v["seconds"] for s in stats.values() for v in s.values()), 3),
            "probe_agreement_fraction": agree / total if total else math.nan, "probed_ports": total,
            "per_host": stats}


def check_maps(st: State, pairs: dict[int, set[int]]) -> tuple[int, int]:
    """(ports whose map path equals the kernel's choice, ports checked)."""
    lay = st.layout
    agree = total = 0
    routes: dict[int, KernelRoutes] = {}
    try:
        for src, dsts in pairs.items():
            leaf = lay.leaf_of(src)
            kr = routes.get(leaf) or routes.setdefault(leaf, KernelRoutes(st, leaf))
            for dst in dsts:
                pm = PathMap.load(st.dir / "maps" / f"gpu{src}__gpu{dst}__{st.spec.dport}.json")
                for k, ports in enumerate(pm.buckets):
                    for port in ports.tolist():
                        total += 1
                        agree += kr.spine(src, lay.host_ip(dst), port, st.spec.dport, pm.proto) == k
    finally:
        for kr in routes.values():
            kr.close()
    return agree, total


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(st: State, params: RunParams, progress: Progress = _quiet, reprobe: bool = True) -> dict[str, Any]:
    """One (scheme, QPS, seed) on the live testbed; the record of the run."""
    params.check()
    if not st.complete:
        raise TestbedError("testbed: build incomplete; run `ark testbed down` and `up` again")
    spec, lay = st.spec, st.layout
    if params.fail_link is not None and not (0 <= params.fail_link[0] < spec.leaves
                                             and 0 <= params.fail_link[1] < spec.spines):
        raise TestbedError(f"fail_link: leaf must be 0..{spec.leaves - 1} and spine 0..{spec.spines - 1}; "
                           f"got {params.fail_link[0]}:{params.fail_link[1]}")
    flows, load = plan_flows(st, params.requests, params.qps, params.seed)
    pairs: dict[int, set[int]] = {}
    for f in flows:
        if lay.leaf_of(f["src_index"]) != lay.leaf_of(f["dst_index"]):
            pairs.setdefault(f["src_index"], set()).add(f["dst_index"])
    policy = params.scheme if params.scheme != "ecmp" else "ark"
    cluster = cluster_file(st, policy, params.lease_min_s, params.sample)
    probe_info: dict[str, Any] = {"probes_sent": 0, "probe_agreement_fraction": math.nan}
    if pairs and (reprobe or not _maps_present(st, pairs)):
        probe_info = probe(st, pairs, params.sample, cluster, progress)
    elif pairs:
        agree, total = check_maps(st, pairs)
        probe_info = {"probes_sent": 0, "probe_agreement_fraction": agree / total if total else math.nan,
                      "probed_ports": total}
    work = st.dir / f"run-{params.scheme}-{params.seed}"
    shutil.rmtree(work, ignore_errors=True)  # logs and results of this run only
    work.mkdir(parents=True)
    n_hosts = spec.leaves * spec.gpus_per_leaf
    procs: list[subprocess.Popen[bytes]] = []
    change: dict[str, Any] = {}
    changer: threading.Thread | None = None
    try:
        receivers = sorted({f["dst_index"] for f in flows})
        for d in receivers:
            ready = work / f"ready-gpu{d}"
            ready.unlink(missing_ok=True)
            procs.append(spawn_in_host(st, d, [sys.executable, "-m", "ark.testbed.transfer", "serve", "--bind",
                                               lay.host_ip(d), "--port", str(spec.dport), "--ready", str(ready)],
                                       work / f"recv-gpu{d}.log"))
        apis = {}
        if params.scheme != "ecmp":
            for i in range(n_hosts):
                procs.append(spawn_in_host(st, i, [sys.executable, "-m", "ark", "agent", "--cluster", str(cluster),
                                                   "--host", f"gpu{i}", "--log-level", "warning"],
                                           work / f"agent-gpu{i}.log"))
                apis[i] = f"ipc://{st.dir}/api/gpu{i}.sock"
            wait_ready(list(apis.values()), 60.0)
            progress(f"{len(apis)} agents ready")
        deadline = time.monotonic() + 30
        while not all((work / f"ready-gpu{d}").exists() for d in receivers):
            if time.monotonic() > deadline:
                raise TestbedError(f"receivers did not start; see {work}")
            time.sleep(0.05)
        senders = sorted({f["src_index"] for f in flows})
        t0 = time.time() + 1.5  # every sender imported and waiting
        with counting(st) as counters:
            sprocs = []
            for s in senders:
                mine = [f for f in flows if f["src_index"] == s]
                (work / f"plan-gpu{s}.json").write_text(json.dumps(mine))
                argv = [sys.executable, "-m", "ark.testbed.transfer", "send", "--plan", str(work / f"plan-gpu{s}.json"),
                        "--src-ip", lay.host_ip(s), "--t0", repr(t0), "--out", str(work / f"out-gpu{s}.json")]
                if s in apis:
                    argv += ["--api", apis[s]]
                p = spawn_in_host(st, s, argv, work / f"send-gpu{s}.log")
                procs.append(p)
                sprocs.append(p)
            progress(f"{len(flows)} flows from {len(senders)} senders")
            if params.fail_link is not None:
                changer = threading.Thread(target=_fabric_change, daemon=True,
                                           args=(st, params, pairs, cluster, t0, apis, change, progress))
                changer.start()
            limit = max(f["start_s"] for f in flows) + 120
            for p in sprocs:
                try:
                    p.wait(max(1.0, t0 + limit - time.time()))
                except subprocess.TimeoutExpired:
                    raise TestbedError(f"senders still running {limit:.0f} s after the start; see {work}") from None
            time.sleep(0.2)  # the last packets reach the spine counters
            if changer is not None:
                changer.join(60)
    finally:
        _stop(procs)
        if params.fail_link is not None:
            set_link(st, params.fail_link[0], params.fail_link[1], True)
    results = []
    for s in senders:
        out = work / f"out-gpu{s}.json"
        if not out.exists():
            raise TestbedError(f"sender gpu{s} wrote no results; see {work}/send-gpu{s}.log")
        results += json.loads(out.read_text())
    return _record(st, params, flows, results, counters, probe_info, load, change)


def _fabric_change(st: State, params: RunParams, pairs: dict[int, set[int]], cluster: Path, t0: float,
                   apis: dict[int, str], change: dict[str, Any], progress: Progress) -> None:
    """Fail a link at its time; every source host re-probes and re-paths (agents: API ``refresh``)."""
    try:
        _change(st, params, pairs, cluster, t0, apis, change, progress)
    except Exception as e:  # reported in the record; the run itself goes on
        change["error"] = f"{type(e).__name__}: {e}"


def _change(st: State, params: RunParams, pairs: dict[int, set[int]], cluster: Path, t0: float,
            apis: dict[int, str], change: dict[str, Any], progress: Progress) -> None:
    from ark.agent.client import ArkClient

    assert params.fail_link is not None
    leaf, spine, at = params.fail_link
    clients = {src: ArkClient(apis[src]) for src in pairs if src in apis}
    try:
        time.sleep(max(0.0, t0 + at - time.time()))
        # Agents' counters are cumulative (a refresh may have run at start-up): report the change's share.
        before = {src: c.status()["paths"] for src, c in clients.items()}
        change["failing_at_s"] = time.time() - t0
        set_link(st, leaf, spine, False)
        change["failed_at_s"] = time.time() - t0  # link down and routes converged
        if clients:
            _await_agents(st, pairs, clients, before, t0, change)
        else:  # ECMP: no agents, the hosts re-probe
            info = probe(st, pairs, params.sample, cluster)
            change.update(refreshed_at_s=time.time() - t0, probes_sent=info["probes_sent"],
                          probe_agreement_fraction=info["probe_agreement_fraction"], repathed_live_flows=0)
    finally:
        for c in clients.values():
            c.close()
    progress(f"link leaf{leaf}-spine{spine} down at {change['failed_at_s']:.2f} s; maps refreshed at "
             f"{change['refreshed_at_s']:.2f} s; {change['repathed_live_flows']} live reservations re-pathed")


def _await_agents(st: State, pairs: dict[int, set[int]], clients: dict[int, Any], before: dict[int, Any],
                  t0: float, change: dict[str, Any]) -> None:
    """Wait until every source agent refreshed by itself and the maps agree with the kernel.

    Agents notice the re-hash by their periodic checks (probe_check_s). A refresh whose
    probes straddled the change leaves stale ports, which the next check repairs, so
    "refreshed" means the maps agree again. An agent that has not refreshed within
    DETECT_TIMEOUT_S is told to (API op refresh).
    """
    detected: dict[int, float] = {}
    deadline = time.time() + DETECT_TIMEOUT_S
    agree, total = 0, 1
    while time.time() < deadline:
        for src, c in clients.items():
            last = c.status()["paths"]["last_refresh"] if src not in detected else None
            if last is not None and last > t0 + change["failing_at_s"]:
                detected[src] = last - t0
        if len(detected) == len(clients):
            agree, total = check_maps(st, pairs)
            if agree == total:
                break
        time.sleep(0.05)
    told = [src for src in clients if src not in detected]
    for src in told:
        clients[src].refresh([f"gpu{d}" for d in sorted(pairs[src])])
    if told or agree != total:
        agree, total = check_maps(st, pairs)
    after = {src: c.status()["paths"] for src, c in clients.items()}

    def delta(key: str) -> int:
        return sum(after[s][key] - before[s][key] for s in clients)

    change.update(
        refreshed_at_s=time.time() - t0, probes_sent=delta("refresh_probes"), check_probes=delta("check_probes"),
        probe_agreement_fraction=agree / total if total else math.nan, repathed_live_flows=delta("repathed"),
        detected_at_s={f"gpu{k}": round(v, 3) for k, v in sorted(detected.items())},
        told_to_refresh=[f"gpu{k}" for k in told],
    )


def _maps_present(st: State, pairs: dict[int, set[int]]) -> bool:
    return all((st.dir / "maps" / f"gpu{s}__gpu{d}__{st.spec.dport}.json").exists()
               for s, ds in pairs.items() for d in ds)


def _record(st: State, params: RunParams, flows: list[dict[str, Any]], results: list[dict[str, Any]],
            counters: Any, probe_info: dict[str, Any], load: float, change: dict[str, Any]) -> dict[str, Any]:
    lay = st.layout
    by_id = {f["id"]: f for f in flows}
    per_flow = []
    matched = checked = 0
    per_spine = [0] * st.spec.spines
    for r in sorted(results, key=lambda r: r["id"]):
        f = by_id[r["id"]]
        src_ip = lay.host_ip(f["src_index"])
        segs = []
        for sg in r.get("segments") or []:
            crossed = counters.spines_of((src_ip, sg["sport"], f["dst_ip"], f["dport"]), sg["t0"], sg["t1"])
            segs.append({**sg, "spine_bytes": {str(k): v for k, v in sorted(crossed.items())},
                         "spine": max(crossed, key=lambda k: crossed[k]) if crossed else None})
        actual = segs[0]["spine"] if segs else None
        if actual is not None:
            per_spine[actual] += 1
        fr: dict[str, Any] = {"id": r["id"], "src": f["src"], "dst": f["dst"], "bytes": f["bytes"],
                              "start_s": f["start_s"], "sport": r["sport"], "fct_s": r.get("fct_s"),
                              "error": r["error"], "spine": actual, "segments": segs}
        if params.scheme != "ecmp" and r["path"] is not None and lay.leaf_of(f["src_index"]) != lay.leaf_of(f["dst_index"]):
            fr.update(reserved_spine=r["path"], reserved=r["reserved"], reserve_s=r.get("reserve_s"))
            # Matched: on every connection of the flow, every payload byte crossed the spine
            # reserved for it, and some bytes were seen.
            ok = bool(segs) and all(
                not sg["bytes"] or set(sg["spine_bytes"]) == {str(sg["path"])} for sg in segs
            ) and any(sg["spine_bytes"] for sg in segs)
            fr["path_match"] = ok
            checked += 1
            matched += ok
        per_flow.append(fr)
    fct = np.asarray([r["fct_s"] for r in per_flow if r["fct_s"] is not None])
    rec: dict[str, Any] = {
        "scheme": params.scheme, "qps": params.qps, "seed": params.seed, "requests": params.requests,
        "scale": st.spec.scale, "link_mbps": st.spec.link_gbps * st.spec.scale * 1e3,
        "offered_load": round(load, 4), "hash_policy": st.spec.hash_policy,
        "fct_mean_s": float(fct.mean()) if len(fct) else math.nan,
        "fct_p50_s": float(np.percentile(fct, 50)) if len(fct) else math.nan,
        "fct_p95_s": float(np.percentile(fct, 95)) if len(fct) else math.nan,
        "errors": sum(1 for r in per_flow if r["error"]),
        "path_match_fraction": matched / checked if checked else (None if params.scheme == "ecmp" else math.nan),
        "path_checked": checked,
        # Packets the spine capture rings had no room for (0: every byte was seen).
        "capture_drops": counters.drops,
        "repathed_flows": sum(1 for r in per_flow if len(r["segments"]) > 1),
        "flows_per_spine": per_spine,
        "probes_sent": probe_info["probes_sent"],
        "probe_agreement_fraction": probe_info["probe_agreement_fraction"],
        "probe": {k: v for k, v in probe_info.items() if k != "per_host"},
        "flows": per_flow,
    }
    if params.fail_link is not None:
        # Flows that started after every agent had the new maps must all match again.
        after = [r for r in per_flow if "path_match" in r and r["start_s"] > change.get("refreshed_at_s", math.inf)]
        rec["fabric_change"] = {
            **change, "link": list(params.fail_link[:2]),
            "flows_after_refresh": len(after),
            "path_match_after_refresh": sum(r["path_match"] for r in after) / len(after) if after else math.nan,
        }
    return rec
