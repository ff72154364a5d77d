"""What a testbed run sends and how its agents are configured.

The flows are the simulator's (same workload generator, placement and seeds, embedded
default config) with KV bytes multiplied by the testbed's scale; the cluster file puts
every host's agent on the management network.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ark.agent.cluster import ArbiterTable, ClusterFile, ClusterSettings, HostTable
from ark.agent.keys import create_keypair, public_keys
from ark.core.clos import ClosFabric
from ark.core.fabric_config import FabricConfig
from ark.core.flows import FlowSpec
from ark.core.pathmap import pathmap_filename
from ark.testbed.fabric import State, TestbedSpec

PROBE_CHECK_S = 0.5  # agents re-probe a few ports this often and refresh on a re-hash
ARBITER_PORT = 7200  # the arbiters' control port on the management network
Pairs = dict[int, set[int]]  # source host -> destination hosts behind other leaves


def plan_flows(st: State, requests: int, qps: float, seed: int) -> tuple[list[FlowSpec], float]:
    """KV flows of the simulator's workload, scaled; and the nominal offered load."""
    return spec_flows(st.spec, requests, qps, seed)


def spec_flows(spec: TestbedSpec, requests: int, qps: float, seed: int) -> tuple[list[FlowSpec], float]:
    """:func:`plan_flows` from the spec alone (no live testbed needed).

    The placement is the simulator's default: on a 3-tier testbed each request's GPUs are
    drawn at random from the whole pools (a P/D router's any-to-any pairing), so that about
    half of the flows cross pods; on two tiers the i-th prefill GPU sends to the i-th
    decode GPU.
    """
    from ark.sim.config import default
    from ark.sim.experiment import offered_load, place

    cfg = default().with_overrides(requests=requests)
    fab = spec.fabric()
    placed = place(cfg, fab, qps, seed)
    t_first = min(p.kv_start_s for p in placed)
    flows = [FlowSpec(i, p.prefill_gpu, p.decode_gpu, max(1, round(p.kv_bytes * spec.scale)),
                      round(p.kv_start_s - t_first, 6)) for i, p in enumerate(placed)]
    return flows, offered_load(fab, placed, qps)


EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range: where ECMP's ports come from


def ecmp_ports(flows: list[FlowSpec], seed: int) -> dict[int, int]:
    """A source port per flow, as the kernel would pick one (uniform over the ephemeral
    range, no two alike on one host), but drawn from ``seed``: with the switches' hash keys
    also fixed by the seed, an ECMP run's paths are the same every time."""
    out: dict[int, int] = {}
    by_src: dict[int, list[FlowSpec]] = {}
    for f in flows:
        by_src.setdefault(f.src, []).append(f)
    lo, hi = EPHEMERAL
    for src, fs in sorted(by_src.items()):
        ports = random.Random(f"ark-ecmp-ports-{seed}-{src}").sample(range(lo, hi + 1), len(fs))
        out.update({f.id: p for f, p in zip(sorted(fs, key=lambda f: f.id), ports, strict=True)})
    return out


def cross_leaf_pairs(st: State, flows: list[FlowSpec]) -> Pairs:
    lay = st.layout
    pairs: Pairs = {}
    for f in flows:
        if lay.leaf_of(f.src) != lay.leaf_of(f.dst):
            pairs.setdefault(f.src, set()).add(f.dst)
    return pairs


def map_file(st: State, src: int, dst: int, dport: int | None = None) -> Path:
    """Where host ``src``'s probed map towards ``dst`` (``dport``: default the testbed's) lives."""
    return st.dir / "maps" / pathmap_filename(f"gpu{src}", f"gpu{dst}", st.spec.dport if dport is None else dport)


def cluster_file(st: State, policy: str, lease_min_s: float, sample: int = 128,
                 probe_check_s: float = PROBE_CHECK_S, control: str = "broadcast") -> Path:
    """Keys (once) and a cluster file whose agents talk over the management network;
    ``control = "arbiter"``: they ask two arbiters (:func:`arbiter_tables`) instead."""
    spec, lay = st.spec, st.layout
    keys = st.dir / "keys"
    (st.dir / "maps").mkdir(parents=True, exist_ok=True)
    (st.dir / "api").mkdir(parents=True, exist_ok=True)
    hosts = []
    for i in range(spec.leaves * spec.gpus_per_leaf):
        name = f"gpu{i}"
        secret = keys / f"{name}.key_secret"
        kp = public_keys(secret) if secret.exists() else create_keypair(keys, name)
        hosts.append(HostTable(name=name, control=lay.control(i), api=f"ipc://{st.dir}/api/{name}.sock",
                               public_key=kp.public_key, sign_key=kp.sign_key, secret_key_file=f"keys/{name}.key_secret"))
    settings = ClusterSettings(
        policy=policy, dport=spec.dport, port_range=f"{spec.port_range[0]}-{spec.port_range[1]}",
        lease_min_s=lease_min_s, heartbeat_s=0.5, peer_timeout_s=2.0, sync_timeout_s=1.0, pathmap_dir="maps",
        state_dir="state",
        routers_file="routers.json", probe_proto="tcp", probe_sample=sample, probe_check_s=probe_check_s,
        # Flows are scaled like the rates: so is the size a multi-path lease's part stands for.
        split_part_bytes=max(1, round(ClusterSettings().split_part_bytes * spec.scale)),
        control="arbiter" if control == "arbiter" else "broadcast",  # (a Literal for the type checker)
    )
    (st.dir / "routers.json").write_text(json.dumps(lay.routers_file()))
    arbiters = arbiter_tables(st) if control == "arbiter" else []
    name = f"cluster-{policy}{'-arbiter' if arbiters else ''}.toml"
    return ClusterFile(cluster=settings, fabric=fabric_config(st), hosts=hosts, arbiters=arbiters).save(st.dir / name)


def arbiter_hosts(st: State) -> list[int]:
    """Where the primary and the standby arbiter run: the first and the last host's
    namespace (on the management network, beside those hosts' agents)."""
    return [0, st.spec.leaves * st.spec.gpus_per_leaf - 1]


def arbiter_tables(st: State) -> list[ArbiterTable]:
    keys = st.dir / "keys"
    out = []
    for rank, host in enumerate(arbiter_hosts(st)):
        name = f"arb{rank}"
        secret = keys / f"{name}.key_secret"
        kp = public_keys(secret) if secret.exists() else create_keypair(keys, name)
        out.append(ArbiterTable(name=name, control=f"tcp://{st.layout.mgmt_ip(host)}:{ARBITER_PORT}",
                                public_key=kp.public_key, secret_key_file=f"keys/{name}.key_secret"))
    return out


def fabric_config(st: State) -> FabricConfig:
    """The ``[fabric]`` table of the testbed as built (rates scaled)."""
    spec = st.spec
    if not spec.three_tier:
        return FabricConfig(leaves=spec.leaves, spines=spec.spines, gpus_per_leaf=spec.gpus_per_leaf,
                            link_gbps=spec.link_gbps * spec.scale, nic_gbps=spec.nic_gbps * spec.scale,
                            transport="tcp-1500")
    f = spec.scaled_fabric()
    assert isinstance(f, ClosFabric)
    over = f.oversubscription()
    return FabricConfig(pods=f.pods, leaves_per_pod=f.leaves_per_pod, aggs_per_pod=f.aggs_per_pod,
                        cores_per_plane=f.cores_per_plane, gpus_per_leaf=spec.gpus_per_leaf,
                        nic_gbps=spec.nic_gbps * spec.scale, oversubscription=(over[0], over[1]),
                        transport="tcp-1500")
