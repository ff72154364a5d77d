"""The testbed experiment: real KV flows over the namespace fabric, ECMP vs ARK.

One run (scheme, QPS, seed):

1. the flow plan comes from the same workload and placement as the simulator (embedded
   default config), KV bytes multiplied by the testbed's scale (:mod:`ark.testbed.plan`);
2. every prefill host probes its decode peers (``python -m ark probe`` inside its
   namespace) and writes its path maps; the maps are checked against the kernel's own
   choice (``RTM_GETROUTE`` with ports, in the leaf) (:mod:`ark.testbed.probing`);
3. receivers start in the decode hosts, agents (ARK schemes) in every host, AF_PACKET
   counters in every spine, then one sender per prefill host runs its flows;
4. per flow: FCT, and for ARK flows the spine its payload bytes actually crossed against
   the spine its lease reserved.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ark.agent.client import ArkClient, wait_ready
from ark.core.flows import FlowSpec
from ark.core.node import MAX_SPLIT_PARTS
from ark.sim.experiment import path_kind_keys, path_kinds
from ark.testbed import engines
from ark.testbed.capture import SpineCounters, counting
from ark.testbed.change import fabric_change
from ark.testbed.fabric import State, TestbedError, rekey, set_link, spawn_in_host
from ark.testbed.plan import (
    PROBE_CHECK_S,
    Pairs,
    arbiter_hosts,
    cluster_file,
    cross_leaf_pairs,
    ecmp_ports,
    plan_flows,
)
from ark.testbed.predict import predict
from ark.testbed.probing import Progress, _quiet, probe_or_check
from ark.testbed.summary import PARTS, finite_mean
from ark.testbed.transfer import SendPlan

TESTBED_SCHEMES = ("ecmp", "ark", "ark-balance", "ark-split")
# The testbed's own TCP senders, Mooncake Transfer Engines, or vLLM P/D (ark.testbed.vllm:
# its requests' KV pushes, with the builtin senders' flows as background).
ENGINES = ("builtin", "mooncake", "vllm")
CONTROLS = ("broadcast", "arbiter")


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
    engine: str = "builtin"
    buffers: int = 1  # mooncake: requests (one connection each) per KV flow
    # ark-split: parts of each flow's multi-path lease; 0: the agent's size-aware choice
    # (one part per split_part_bytes, scaled with the rates, at most one per path).
    parts: int = 0
    # Every host shares this machine's few cores: ECMP runs start the agents too (and ask
    # them nothing), so every scheme pays their CPU and the comparison is fair.
    ecmp_agents: bool = True
    # "arbiter": agents keep no replica and ask a primary and a standby arbiter, which run
    # in the first and the last host's namespace (ark.testbed.plan.arbiter_hosts).
    control: str = "broadcast"

    @property
    def split_parts(self) -> int | None:
        """What a sender asks each flow's lease for: parts under ark-split, else None (one path)."""
        return self.parts if self.scheme == "ark-split" else None

    def check(self, st: State) -> None:
        if self.scheme not in TESTBED_SCHEMES:
            raise TestbedError(f"scheme: must be one of {', '.join(TESTBED_SCHEMES)}; got {self.scheme!r}")
        if self.control not in CONTROLS:
            raise TestbedError(f"control: must be one of {', '.join(CONTROLS)}; got {self.control!r}")
        if self.engine not in ENGINES:
            raise TestbedError(f"engine: must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        if not 1 <= self.buffers <= 256:
            raise TestbedError(f"buffers: must be 1..256; got {self.buffers}")
        if not 0 <= self.parts <= MAX_SPLIT_PARTS:
            raise TestbedError(f"parts: must be 0..{MAX_SPLIT_PARTS} (0: the agent's choice); got {self.parts}")
        if self.scheme == "ark-split" and self.fail_link is not None:
            raise TestbedError("fail_link: not with ark-split (a split flow's connections do not follow re-paths)")
        if self.engine != "builtin" and self.fail_link is not None:
            raise TestbedError("fail_link: only with the builtin engine (steered Mooncake transfers do not follow re-paths)")
        if self.requests < 1:
            raise TestbedError(f"requests: must be >= 1; got {self.requests}")
        if not self.qps > 0:
            raise TestbedError(f"qps: must be > 0; got {self.qps}")
        if self.sample < 0:
            raise TestbedError(f"sample: must be >= 0; got {self.sample}")
        if self.fail_link is None:
            return
        leaf, spine, at = self.fail_link
        if not at >= 0:
            raise TestbedError(f"fail_link: the time must be >= 0 s; got {at}")
        if not (0 <= leaf < st.spec.leaves and 0 <= spine < st.spec.spines):
            raise TestbedError(f"fail_link: leaf must be 0..{st.spec.leaves - 1} and spine 0..{st.spec.spines - 1}; "
                               f"got {leaf}:{spine}")


def interleaved(seeds: Sequence[int], schemes: Sequence[str]) -> list[tuple[int, str]]:
    """(seed, scheme) in run order: every scheme once per seed, the order rotated from one
    seed to the next, so that a machine that drifts (thermal, background load) slows each
    scheme's runs alike rather than always the one that runs last."""
    out = []
    for k, seed in enumerate(seeds):
        r = k % len(schemes)
        out += [(seed, sc) for sc in [*schemes[r:], *schemes[:r]]]
    return out


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


class TestbedRun:
    """The processes of one run: receivers, agents, senders; and what they report."""

    __test__ = False  # not a pytest class

    def __init__(self, st: State, params: RunParams, flows: list[FlowSpec], progress: Progress) -> None:
        self.st, self.params, self.flows, self.progress = st, params, flows, progress
        self.work = st.dir / f"run-{params.engine}-{params.scheme}-{params.seed}"
        shutil.rmtree(self.work, ignore_errors=True)  # logs and results of this run only
        self.work.mkdir(parents=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.apis: dict[int, str] = {}
        self.dports = [st.spec.dport]  # the receivers' ports (mooncake: handshake and data, both probed)
        self.senders = sorted({f.src for f in flows})

    def _spawn(self, host: int, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        p = spawn_in_host(self.st, host, argv, self.work / log, env)
        self.procs.append(p)
        return p

    def start_receivers(self) -> list[int]:
        lay, port = self.st.layout, self.st.spec.dport
        receivers = sorted({f.dst for f in self.flows})
        if self.params.engine == "mooncake":
            return engines.start_receivers(self, receivers)
        for d in receivers:
            self._spawn(d, [sys.executable, "-m", "ark.testbed.transfer", "serve", "--bind", lay.host_ip(d),
                            "--port", str(port), "--ready", str(self.work / f"ready-gpu{d}")], f"recv-gpu{d}.log")
        return receivers

    def start_agents(self, cluster: Path) -> None:
        spec = self.st.spec
        arbiter = self.params.control == "arbiter"
        if arbiter:
            for rank, host in enumerate(arbiter_hosts(self.st)):
                self._spawn(host, [sys.executable, "-m", "ark", "arbiter", "--cluster", str(cluster), "--name",
                                   f"arb{rank}", "--log-level", "warning"], f"arbiter-{rank}.log")
        for i in range(spec.leaves * spec.gpus_per_leaf):
            self._spawn(i, [sys.executable, "-m", "ark", "agent", "--cluster", str(cluster), "--host", f"gpu{i}",
                            "--log-level", "warning"], f"agent-gpu{i}.log")
            self.apis[i] = f"ipc://{self.st.dir}/api/gpu{i}.sock"
        wait_ready(list(self.apis.values()), 60.0)
        if arbiter:
            self._wait_arbiter()
        self.progress(f"{len(self.apis)} agents ready" + (", an arbiter leading" if arbiter else ""))

    def _wait_arbiter(self, timeout_s: float = 30.0) -> None:
        """Until the arbiters grant (at a cold start the primary leads after takeover_s)."""
        fab = self.st.spec.fabric()
        src = next(iter(self.apis))
        dst = next(h.index for h in fab.hosts if fab.n_paths(src, h.index) > 1)
        deadline = time.monotonic() + timeout_s
        with ArkClient(self.apis[src], timeout_s=10.0) as c:
            while time.monotonic() < deadline:
                lease = c.reserve(f"gpu{dst}", 1)
                c.release(lease.flow_id)
                if lease.reserved:
                    return
                time.sleep(0.1)
        raise TestbedError(f"no arbiter granted within {timeout_s:.0f} s; see {self.work}/arbiter-*.log")

    def wait_receivers(self, receivers: list[int]) -> None:
        deadline = time.monotonic() + 30
        while not all((self.work / f"ready-gpu{d}").exists() for d in receivers):
            if time.monotonic() > deadline:
                raise TestbedError(f"receivers did not start; see {self.work}")
            time.sleep(0.05)

    def start_senders(self, t0: float) -> list[subprocess.Popen[bytes]]:
        if self.params.engine == "mooncake":
            return engines.start_senders(self, t0)
        lay, fab = self.st.layout, self.st.spec.fabric()
        names = {h.index: h.name for h in fab.hosts}
        out = []
        for s in self.senders:
            mine = [f for f in self.flows if f.src == s]
            plan = SendPlan(mine, names, {i: lay.host_ip(i) for i in names}, self.st.spec.dport,
                            ecmp_ports(mine, self.params.seed) if self.params.scheme == "ecmp" else {},
                            self.params.split_parts)
            pf = self.work / f"plan-gpu{s}.json"
            pf.write_bytes(msgspec.json.encode(plan))
            argv = [sys.executable, "-m", "ark.testbed.transfer", "send", "--plan", str(pf), "--src-ip",
                    lay.host_ip(s), "--t0", repr(t0), "--out", str(self.work / f"out-gpu{s}.json")]
            if s in self.apis and self.params.scheme != "ecmp":
                argv += ["--api", self.apis[s]]
            out.append(self._spawn(s, argv, f"send-gpu{s}.log"))
        self.progress(f"{len(self.flows)} flows from {len(self.senders)} senders")
        return out

    def wait_senders(self, sprocs: list[subprocess.Popen[bytes]], t0: float) -> None:
        limit = max(f.start_s for f in self.flows) + 120
        for p in sprocs:
            try:
                p.wait(max(1.0, t0 + limit - time.time()))
            except subprocess.TimeoutExpired:
                raise TestbedError(f"senders still running {limit:.0f} s after the start; see {self.work}") from None
        time.sleep(0.2)  # the last packets reach the spine counters

    def results(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for s in self.senders:
            f = self.work / f"out-gpu{s}.json"
            if not f.exists():
                raise TestbedError(f"sender gpu{s} wrote no results; see {self.work}/send-gpu{s}.log")
            out += json.loads(f.read_text())
        return out


def run(st: State, params: RunParams, progress: Progress = _quiet, reprobe: bool = True) -> dict[str, Any]:
    """One (scheme, QPS, seed) on the live testbed; the record of the run."""
    params.check(st)
    if not st.complete:
        raise TestbedError("testbed: build incomplete; run `ark testbed down` and `up` again")
    flows, load = plan_flows(st, params.requests, params.qps, params.seed)
    pairs = cross_leaf_pairs(st, flows)
    # Mooncake runs change no link, so their agents skip the periodic re-probe: on 2 cores
    # shared by 16 hosts its CPU would come out of the engines' share.
    check_s = 0.0 if params.engine == "mooncake" else PROBE_CHECK_S
    cluster = cluster_file(st, params.scheme if params.scheme != "ecmp" else "ark", params.lease_min_s, params.sample,
                           check_s, params.control)
    dports = engines.data_ports(st, sorted({f.dst for f in flows})) if params.engine == "mooncake" else None
    # The seed fixes the switches' hash keys (and ECMP's ports): the same seed, the same paths.
    keys, rekeyed = rekey(st, params.seed)
    probe_info = probe_or_check(st, pairs, params.sample, cluster, reprobe or rekeyed, progress, dports)
    tr = TestbedRun(st, params, flows, progress)
    tr.dports = dports or [st.spec.dport]
    change: dict[str, Any] = {}
    verified = None
    try:
        receivers = tr.start_receivers()
        if params.scheme != "ecmp" or params.ecmp_agents:
            tr.start_agents(cluster)
        tr.wait_receivers(receivers)
        cpu = CpuMeter()
        counters = _send(tr, pairs, cluster, change)
        busy = cpu.busy()
        verified = engines.verify(tr, receivers) if params.engine == "mooncake" else None
    finally:
        _stop(tr.procs)
        if params.fail_link is not None:
            set_link(st, params.fail_link[0], params.fail_link[1], True)
    rec = _record(st, params, flows, tr.results(), counters, probe_info, load, change)
    rec.update(hash_keys=keys, cpu_busy_fraction=round(busy, 4), cpu_saturated=busy >= SATURATED)
    # The simulator's answer for exactly these flows, to set beside the measurement.
    sim = predict(st.spec, flows, params.scheme, params.seed, parts=params.parts or None)
    rec["sim"] = {k: sim[k] for k in ("fct_mean_s", "fct_p50_s", "fct_p95_s", "ideal_mean_s", "fallbacks")}
    if verified is not None:
        engines.add_verdicts(rec, verified)
    return rec


SATURATED = 0.95  # a run whose cores were this busy measured the machine, not the fabric


class CpuMeter:
    """The machine's CPU busy fraction (all cores) from now to :meth:`busy`."""

    def __init__(self) -> None:
        self.start = self._times()

    @staticmethod
    def _times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle and iowait
        return sum(vals), idle

    def busy(self) -> float:
        total, idle = self._times()
        dt = total - self.start[0]
        return 1.0 - (idle - self.start[1]) / dt if dt > 0 else math.nan


def _send(tr: TestbedRun, pairs: Pairs, cluster: Path, change: dict[str, Any]) -> SpineCounters:
    """Senders under the spine counters, with the fabric change beside them if asked for."""
    # Every sender imported and waiting (a Mooncake sender also initializes its engine and
    # registers its buffers, which takes seconds on a busy 2-core machine).
    t0 = time.time() + (engines.LEAD_S if tr.params.engine == "mooncake" else 1.5)
    with counting(tr.st) as counters:
        sprocs = tr.start_senders(t0)
        changer = None
        if tr.params.fail_link is not None:
            changer = threading.Thread(target=fabric_change, daemon=True,
                                       args=(tr.st, tr.params, pairs, cluster, t0, tr.apis, change, tr.progress))
            changer.start()
        tr.wait_senders(sprocs, t0)
        if changer is not None:
            changer.join(60)
    return counters


def _expected(st: State, src: int, dst: int, path: int) -> set[int]:
    """The counted switches a flow on ``path`` crosses: its spine; 3-tier: the aggregation
    switch ``j`` of each pod it touches and, between pods, core ``path``."""
    spec, lay = st.spec, st.layout
    if not spec.three_tier:
        return {path}
    per_pod = spec.leaves // spec.pods
    p, q = lay.leaf_of(src) // per_pod, lay.leaf_of(dst) // per_pod
    n_agg = spec.aggs_per_pod
    if p == q:
        return {p * n_agg + path}
    j = path // spec.cores_per_plane
    return {p * n_agg + j, q * n_agg + j, spec.pods * n_agg + path}


def _top(st: State, crossed: dict[int, int]) -> int | None:
    """The top-tier switch that carried most of these bytes (spine; 3-tier: core), if any."""
    base = st.spec.pods * st.spec.aggs_per_pod if st.spec.three_tier else 0
    tops = {k - base: v for k, v in crossed.items() if k >= base}
    return max(tops, key=lambda k: tops[k]) if tops else None


def _flow_record(st: State, params: RunParams, f: FlowSpec, r: dict[str, Any],
                 counters: SpineCounters) -> dict[str, Any]:
    lay = st.layout
    src_ip, dst_ip, dport = lay.host_ip(f.src), lay.host_ip(f.dst), st.spec.dport
    segs = []
    for sg in r.get("segments") or []:
        crossed = counters.spines_of((src_ip, sg["sport"], dst_ip, sg.get("dport", dport)), sg["t0"], sg["t1"])
        segs.append({**sg, "spine_bytes": {str(k): v for k, v in sorted(crossed.items())},
                     "spine": _top(st, crossed)})
    fr: dict[str, Any] = {"id": r["id"], "src": f"gpu{f.src}", "dst": f"gpu{f.dst}", "bytes": f.nbytes,
                          "start_s": f.start_s, "sport": r["sport"], "fct_s": r.get("fct_s"),
                          "error": r["error"], "spine": segs[0]["spine"] if segs else None, "segments": segs}
    fr.update({k: r[k] for k in ("late_s", "connections", "steer_error", "repathed", "ecmp", "reserve_s", *PARTS)
               if k in r})
    if params.scheme != "ecmp" and r["path"] is not None and lay.leaf_of(f.src) != lay.leaf_of(f.dst):
        fr.update(reserved_spine=r["path"], reserved=r["reserved"], reserve_s=r.get("reserve_s"))
        # Matched: on every connection of the flow, every payload byte crossed the switches
        # of the path reserved for it (spine; 3-tier: aggregation switches and core), and
        # some bytes were seen.
        fr["path_match"] = bool(segs) and all(
            not sg["bytes"] or set(sg["spine_bytes"]) == {str(x) for x in _expected(st, f.src, f.dst, sg["path"])}
            for sg in segs
        ) and any(sg["spine_bytes"] for sg in segs)
    return fr


def _record(st: State, params: RunParams, flows: list[FlowSpec], results: list[dict[str, Any]],
            counters: SpineCounters, probe_info: dict[str, Any], load: float, change: dict[str, Any]) -> dict[str, Any]:
    by_id = {f.id: f for f in flows}
    per_flow = [_flow_record(st, params, by_id[r["id"]], r, counters) for r in sorted(results, key=lambda r: r["id"])]
    per_spine = [0] * st.spec.spines
    for fr in per_flow:
        if fr["spine"] is not None:
            per_spine[fr["spine"]] += 1
    checked = [fr["path_match"] for fr in per_flow if "path_match" in fr]
    fct = np.asarray([r["fct_s"] for r in per_flow if r["fct_s"] is not None])
    rec: dict[str, Any] = {
        "scheme": params.scheme, "engine": params.engine, "buffers": params.buffers, "control": params.control,
        "ecmp_agents": params.ecmp_agents and params.scheme == "ecmp", "qps": params.qps, "seed": params.seed, "requests": params.requests,
        "scale": st.spec.scale, "link_mbps": st.spec.link_gbps * st.spec.scale * 1e3,
        "offered_load": round(load, 4), "hash_policy": st.spec.hash_policy,
        **path_kind_keys(path_kinds(st.spec.fabric(), [(f.src, f.dst) for f in flows])),
        "fct_mean_s": float(fct.mean()) if len(fct) else math.nan,
        "fct_p50_s": float(np.percentile(fct, 50)) if len(fct) else math.nan,
        "fct_p95_s": float(np.percentile(fct, 95)) if len(fct) else math.nan,
        # Where the mean FCT goes (the parts add up to it for flows that recorded them).
        "fct_parts_mean_s": {k: finite_mean([r.get(k) for r in per_flow]) for k in PARTS},
        # What the seed fixed: each flow's source port and the top-tier switch its bytes crossed.
        "paths_digest": hashlib.sha256(json.dumps([[r["id"], r["sport"], r["spine"]] for r in per_flow]).encode())
        .hexdigest()[:16],
        "errors": sum(1 for r in per_flow if r["error"]),
        "path_match_fraction": sum(checked) / len(checked) if checked else (None if params.scheme == "ecmp" else math.nan),
        "path_checked": len(checked),
        # Packets the spine capture rings had no room for (0: every byte was seen).
        "capture_drops": counters.drops,
        "repathed_flows": sum(1 for r in per_flow if len(r["segments"]) > 1),
        "flows_per_spine": per_spine,
        "probes_sent": probe_info["probes_sent"],
        "probe_agreement_fraction": probe_info["probe_agreement_fraction"],
        "probe_agreement_by_hop": probe_info.get("probe_agreement_by_hop"),
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
