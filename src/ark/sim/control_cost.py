"""What the reservation control plane costs as a cluster grows: full broadcast, scoped
dissemination, and one arbiter.

One simulated run per cluster size and placement gives the messages every host sends
(RESERVE, RELEASE, RENEW) and the races; who receives them follows from the
dissemination:

* **full**: every host runs an agent and hears every other host's messages and
  heartbeats;
* **scoped** (``ark.core.scope``): a host hears only the senders of its component (the
  hosts whose declared pairs share links with its own, transitively); a host that never
  sends needs no table. Decisions are the same as under full broadcast, so one run
  serves both;
* **arbiter**: no agent keeps a replica. Each sending host's agent forwards each of its
  own operations to one arbiter and gets one reply (RESERVE -> grant, RENEW -> reply,
  RELEASE -> acknowledgement), and sends a keepalive (answered) only when it has sent the
  arbiter nothing for ``keepalive_s``. The arbiter receives every request and keepalive
  of the cluster, answers each, and copies each table change once to a standby. One
  decider: no races. The same run gives the requests (what a host sends under
  broadcast).

Per-agent CPU comes from a cost model whose terms are measured on a real agent
(``ark bench agent`` and ``ark bench idle``): microseconds per received data message, per
copy of a message it publishes (one per subscribed peer), per peer heartbeat (one HELLO
received and one sent every ``heartbeat_s``), and a fixed base. Propagation adds the
queueing of an agent loaded to utilisation ``rho`` (M/D/1 mean wait ``rho / (2 (1 -
rho))`` service times) to the one-way delay; at ``rho >= 1`` the agent falls behind for
good. In arbiter mode the arbiter's CPU comes from :class:`ArbiterCost`, and propagation
is one request's round trip: twice the one-way delay plus the arbiter's service time and
its M/D/1 wait at the arbiter's utilisation.

Placements (prefill GPUs start KV flows to decode GPUs; leaves hold one role each):

* ``paired``: the published one: each prefill GPU sends to one fixed decode GPU, the one
  with its index on the next leaf (in a 3-tier Clos, in the same pod);
* ``cross-pod``: as ``paired`` but the decode leaf sits in the next pod (3-tier only);
* ``any``: each flow goes to a decode GPU drawn at random.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import msgpack
import numpy as np

from ark.core.clock import ECHOES_PER_HELLO
from ark.core.clos import clos3
from ark.core.envelope import K_DATA, K_HELLO, encode_envelope
from ark.core.flows import FlowSpec
from ark.core.messages import Release, Reserve, encode
from ark.core.pathmap import PathMapCache
from ark.core.scope import Scope, scope_of
from ark.core.topology import Fabric, preset
from ark.sim.engine import FluidSim
from ark.sim.workload import VidurZipf, model_spec, split_tokens

SIZES = (16, 256, 1024, 4096)
PLACEMENTS = ("paired", "cross-pod", "any")
# The published experiment's load per prefill GPU: 25 requests/s over its 8 prefill GPUs.
PAPER_RATE_PER_GPU = 25.0 / 8


class ControlPlaneError(ValueError):
    """A size or placement the model cannot build."""


@dataclass(frozen=True)
class AgentCost:
    """What an agent spends, in microseconds of CPU (measured, see the module docstring)."""

    per_message_us: float = 40.0  # one data message received and applied
    per_copy_us: float = 10.0  # one copy of a published message, per subscribed peer
    per_peer_heartbeat_us: float = 60.0  # one HELLO received and one sent, per peer
    base_percent: float = 0.2  # an idle agent with no peer (timers, API), % of one core

    def percent(self, received_per_s: float, sent_per_s: float, peers: int, heartbeat_s: float) -> float:
        """Per-agent CPU, % of one core."""
        us = (received_per_s * self.per_message_us + sent_per_s * peers * self.per_copy_us
              + peers / heartbeat_s * self.per_peer_heartbeat_us)
        return self.base_percent + us / 1e4

    def arbiter_percent(self, requests_per_s: float, keepalives_per_s: float) -> float:
        """Per-agent CPU in arbiter mode, % of one core: each request or keepalive is one
        copy sent (one peer: the arbiter) and one reply received; no peer heartbeats."""
        exchanges = requests_per_s + keepalives_per_s
        return self.base_percent + exchanges * (self.per_copy_us + self.per_message_us) / 1e4


@dataclass(frozen=True)
class ArbiterCost:
    """What the arbiter spends, in microseconds of CPU of one core.

    From ``ark bench arbiter`` (one real arbiter process under an open-loop load over
    ZeroMQ with CURVE, this project's 2-core machine): 51 us of arbiter CPU per decision
    at 10,000 decisions/s, a decision being two requests (an ask and a release) with their
    answers. A keepalive and a copy to the standby are not measured on their own: each is
    charged a whole request, an upper bound (a keepalive decides nothing; a copy is one
    encoded table message in a batch). ``--arbiter-cost FILE`` gives other figures.
    """

    per_request_us: float = 26.0  # one request end to end: decode, decide/renew/release, reply
    per_keepalive_us: float = 26.0  # one keepalive received and answered (bounded by a request)
    per_replica_copy_us: float = 26.0  # one table change sent to the standby (bounded by a request)
    base_percent: float = 0.5  # an idle arbiter (timers, standby heartbeats), % of one core

    def percent(self, requests_per_s: float, keepalives_per_s: float, copies_per_s: float) -> float:
        """The arbiter's CPU, % of one core."""
        us = (requests_per_s * self.per_request_us + keepalives_per_s * self.per_keepalive_us
              + copies_per_s * self.per_replica_copy_us)
        return self.base_percent + us / 1e4


def fabric_for(hosts: int) -> Fabric:
    """16: the published fabric; a multiple of 128: the 3-tier ``scale`` fabric's pods
    (4 leaves of 32 GPUs, 16 aggregation switches, 2:1 at the leaves) times hosts / 128."""
    if hosts == 16:
        return preset("paper")
    if hosts < 128 or hosts % 128:
        raise ControlPlaneError(f"hosts: must be 16 or a multiple of 128; got {hosts}")
    return clos3(pods=hosts // 128, leaves_per_pod=4, aggs_per_pod=16, cores_per_plane=4, gpus_per_leaf=32,
                 nic_gbps=100.0, oversubscription=(2.0, 1.0))


def _leaf_hosts(fab: Fabric) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for h in fab.hosts:
        out.setdefault(h.leaf, []).append(h.index)
    return out


@dataclass(frozen=True)
class Plan:
    """Who sends to whom: the prefill GPUs, the decode GPUs, and each prefill GPU's fixed
    decode GPU (None under ``any``)."""

    senders: list[int]
    decode: list[int]
    fixed: dict[int, int] | None

    def leaf_pairs(self, fab: Fabric) -> list[tuple[int, int]]:
        """One host pair per (source leaf, destination leaf) the placement can use: a
        pair's links depend on its leaves only, so components come out the same."""
        if self.fixed is not None:
            pairs = list(self.fixed.items())
        else:
            first_of: dict[int, int] = {}
            for d in self.decode:
                first_of.setdefault(fab.hosts[d].leaf, d)
            pairs = [(s, d) for s in self.senders for d in first_of.values()]
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        for s, d in pairs:
            seen.setdefault((fab.hosts[s].leaf, fab.hosts[d].leaf), (s, d))
        return list(seen.values())


def plan_for(fab: Fabric, placement: str) -> Plan:
    """The (prefill, decode) pairs a placement can use."""
    by_leaf = _leaf_hosts(fab)
    prefill = sorted({h.leaf for h in fab.hosts if h.role == "prefill"})
    decode = sorted({h.leaf for h in fab.hosts if h.role == "decode"})
    senders = [h for leaf in prefill for h in by_leaf[leaf]]
    receivers = [h for leaf in decode for h in by_leaf[leaf]]
    if placement == "any":
        return Plan(senders, receivers, None)
    pods = int(getattr(fab, "pods", 1))
    per_pod = len(by_leaf) // pods
    if placement == "cross-pod" and pods < 2:
        raise ControlPlaneError("placement: cross-pod needs a 3-tier fabric (256 hosts or more)")
    fixed: dict[int, int] = {}
    for i, leaf in enumerate(prefill):
        pod, k = divmod(leaf, per_pod)
        if placement == "cross-pod":
            pod = (pod + 1) % pods
        # The decode leaves of a pod follow its prefill leaves (see ark.core.clos).
        target = decode[(pod * len(decode) // pods + k) % len(decode)] if pods > 1 else decode[i % len(decode)]
        fixed.update(zip(by_leaf[leaf], by_leaf[target], strict=False))
    return Plan(senders, receivers, fixed)


def flows_for(fab: Fabric, plan: Plan, rate_per_gpu: float, seconds: float,
              rng: np.random.Generator) -> list[FlowSpec]:
    """Poisson KV flows from every prefill GPU for ``seconds``, sized as the published
    workload (LLaMA-3-8B, Vidur's Zipf prompt lengths, 20:1 prefill to decode tokens)."""
    zipf, kv = VidurZipf(1024, 55_000, 0.7), model_spec("llama-3-8b").kv_bytes_per_token
    out: list[FlowSpec] = []
    for s in plan.senders:
        if plan.fixed is not None and s not in plan.fixed:
            continue  # a prefill leaf with no decode leaf to pair with
        t = float(rng.exponential(1 / rate_per_gpu))
        while t < seconds:
            prefill_tokens, _ = split_tokens(zipf.sample(1, rng), 20.0)
            d = plan.fixed[s] if plan.fixed is not None else plan.decode[int(rng.integers(len(plan.decode)))]
            out.append(FlowSpec(len(out), s, d, int(prefill_tokens[0]) * kv, t))
            t += float(rng.exponential(1 / rate_per_gpu))
    out.sort(key=lambda f: (f.start_s, f.src))
    return [FlowSpec(i, f.src, f.dst, f.nbytes, f.start_s) for i, f in enumerate(out)]


def message_bytes() -> dict[str, int]:
    """Envelope bytes of a signed RESERVE, a signed RELEASE and a HELLO with its full
    share of round-trip echoes (ZMTP and CURVE framing not included); and, for arbiter
    mode, an estimate of the arbiter's wire format: msgpack arrays of plain values for a
    request (kind, host, request id, destination, bytes, dport, parts, timestamp), a
    grant (kind, flow id, path, shared, expires, epoch) and a keepalive (kind, host,
    timestamp; its answer counted the same)."""
    r = Reserve((1023, (7 << 32) + 99_999), 1.0e9, 1023, 4000, 4791, 12, 60_000, 6_700_000_000, 1e11, False, 1.0e9 + 2)
    sig = bytes(64)
    return {
        "reserve": len(encode_envelope(K_DATA, 1023, 7, 10**6, [encode(r), sig])),
        "release": len(encode_envelope(K_DATA, 1023, 7, 10**6, [encode(Release(r.flow, 1.0e9 + 1)), sig])),
        "hello": len(encode_envelope(K_HELLO, 1023, 7, 10**6, [bytes(8), 1.0e9, 1.0e9, 1.0e9,
                                                             [[1023, 1.0e9, 1.0e9]] * ECHOES_PER_HELLO])),
        "request": len(msgpack.packb([1, 1023, (7 << 32) + 99_999, 4000, 6_700_000_000, 4791, 1, 1.0e9])),
        "grant": len(msgpack.packb([2, [1023, (7 << 32) + 99_999], 12, False, 1.0e9 + 2, 7])),
        "keepalive": len(msgpack.packb([5, 1023, 1.0e9])),
    }


@dataclass(frozen=True)
class Row:
    hosts: int
    placement: str
    mode: str  # "full", "scoped" or "arbiter"
    flows: int
    races_per_1000: float
    agents: int
    peers_max: int
    received_per_s: float  # per agent, data messages: mean over agents
    received_per_s_max: float
    heartbeats_per_s_max: float
    bytes_per_s_max: float
    cpu_percent_mean: float
    cpu_percent_max: float
    propagation_ms: float | None  # one-way delay + service + queueing at the busiest agent (None: saturated);
    # arbiter: one request's round trip, 2 x delay + service + queueing at the arbiter
    # Arbiter mode only (None otherwise): the busiest agent's messages both ways, the
    # arbiter's messages both ways (standby copies included) and its CPU (% of one core).
    agent_msgs_per_s_max: float | None = None
    arbiter_msgs_per_s: float | None = None
    arbiter_cpu_percent: float | None = None


def _rows(fab: Fabric, placement: str, sent: Sequence[int], seconds: float, flows: int, races: int,
          cost: AgentCost, heartbeat_s: float, delay_s: float, arbiter: ArbiterCost | None = None,
          keepalive_s: float = 1.0, started: Sequence[int] | None = None) -> list[Row]:
    n = fab.n_hosts
    sent_s = np.asarray(sent, dtype=float) / seconds
    # Under an arbiter every flow asks, reserved or not (a flow that finds no free path
    # sends nothing under broadcast); its RESERVE is already among ``sent``, so asks plus
    # sent counts a reserved flow's ask twice: an upper bound on the requests.
    asks_s = sent_s + (np.asarray(started, dtype=float) / seconds if started is not None else 0.0)
    total = float(sent_s.sum())
    plan = plan_for(fab, placement)
    senders = sorted(plan.fixed) if plan.fixed is not None else plan.senders
    comp = _components(fab, scope_of(fab, plan.leaf_pairs(fab)), senders)
    sizes = message_bytes()
    per_msg_bytes = (sizes["reserve"] + sizes["release"]) / 2
    out = []
    for mode in ("full", "scoped"):
        if mode == "full":
            agents = list(range(n))
            peers = {h: n - 1 for h in agents}
            recv = {h: total - sent_s[h] for h in agents}
        else:
            agents = senders
            peers = {h: len(comp[h]) - 1 for h in agents}
            recv = {h: float(sum(sent_s[p] for p in comp[h])) - sent_s[h] for h in agents}
        cpu = {h: cost.percent(recv[h], float(sent_s[h]), peers[h], heartbeat_s) for h in agents}
        busiest = max(agents, key=lambda h: cpu[h])
        hb = max(peers.values()) / heartbeat_s
        out.append(Row(
            n, placement, mode, flows, round(1000 * races / max(1, flows), 2), len(agents), max(peers.values()),
            round(float(np.mean([recv[h] for h in agents])), 1), round(float(max(recv.values())), 1), round(hb, 1),
            round(float(max(recv[h] * per_msg_bytes + peers[h] / heartbeat_s * sizes["hello"] for h in agents))),
            round(float(np.mean(list(cpu.values()))), 3), round(float(cpu[busiest]), 3),
            _propagation_ms(float(cpu[busiest]), cost.per_message_us, delay_s),
        ))
    out.append(_arbiter_row(n, placement, flows, senders, asks_s, sent_s, cost, arbiter or ArbiterCost(), keepalive_s,
                            delay_s))
    return out


def _arbiter_row(n: int, placement: str, flows: int, senders: list[int], asks_s: np.ndarray, sent_s: np.ndarray,
                 cost: AgentCost, arbiter: ArbiterCost, keepalive_s: float, delay_s: float) -> Row:
    """Arbiter mode: each sender's operations become requests, each answered; keepalives
    fill the seconds in which a sender asked nothing; the arbiter copies each change to a
    standby. Every host's operations reach the arbiter, senders or not. ``asks_s``: the
    requests per host per second; ``sent_s``: the table changes (what broadcast sends)."""
    requests = float(asks_s.sum())
    changes = float(sent_s.sum())
    req = {h: float(asks_s[h]) for h in senders}
    keep = {h: max(0.0, 1 / keepalive_s - req[h]) for h in senders}
    cpu = {h: cost.arbiter_percent(req[h], keep[h]) for h in senders}
    keepalives = sum(keep.values())
    arbiter_cpu = arbiter.percent(requests, keepalives, changes)
    sizes = message_bytes()
    return Row(
        n, placement, "arbiter", flows, 0.0, len(senders), 1,
        round(float(np.mean(list(req.values()))), 1), round(max(req.values()), 1), round(max(keep.values()), 1),
        round(max(req[h] * sizes["grant"] + keep[h] * sizes["keepalive"] for h in senders)),
        round(float(np.mean(list(cpu.values()))), 3), round(max(cpu.values()), 3),
        _propagation_ms(arbiter_cpu, arbiter.per_request_us, 2 * delay_s),
        agent_msgs_per_s_max=round(max(2 * (req[h] + keep[h]) for h in senders), 1),
        # requests in, replies out, keepalives in and answered, one copy of each change out
        arbiter_msgs_per_s=round(2 * requests + changes + 2 * keepalives, 1),
        arbiter_cpu_percent=round(arbiter_cpu, 3),
    )


def _components(fab: Fabric, rep_scope: Scope, senders: list[int]) -> dict[int, list[int]]:
    """Each sender's component (itself included), from the leaf-level scope."""
    leaf_group: dict[int, int] = {}
    for g, members in enumerate(rep_scope.components()):
        for h in members:
            leaf_group[fab.hosts[h].leaf] = g
    groups: dict[int, list[int]] = {}
    for s in senders:
        groups.setdefault(leaf_group[fab.hosts[s].leaf], []).append(s)
    return {s: groups[leaf_group[fab.hosts[s].leaf]] for s in senders}


def _propagation_ms(cpu_percent: float, service_us: float, delay_s: float) -> float | None:
    rho = cpu_percent / 100
    if rho >= 1:
        return None
    wait_us = rho / (2 * (1 - rho)) * service_us
    return round((delay_s * 1e6 + service_us + wait_us) / 1e3, 3)


def measure(hosts: int, placement: str, *, flows: int = 2000, seed: int = 1,
            rate_per_gpu: float = PAPER_RATE_PER_GPU, cost: AgentCost | None = None, heartbeat_s: float = 0.25,
            control_delay_s: float = 20e-6, arbiter_cost: ArbiterCost | None = None,
            keepalive_s: float = 1.0) -> list[Row]:
    """Simulate about ``flows`` arrivals (as many seconds as that takes at the placement's
    rate) at ``hosts`` and report full, scoped and arbiter costs."""
    if placement not in PLACEMENTS:
        raise ControlPlaneError(f"placement: must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if not 1 <= flows <= 10**7:
        raise ControlPlaneError(f"flows: must be 1 .. 10000000; got {flows}")
    if not (rate_per_gpu > 0 and math.isfinite(rate_per_gpu)):
        raise ControlPlaneError(f"rate_per_gpu: must be a finite number > 0; got {rate_per_gpu}")
    if not (keepalive_s > 0 and math.isfinite(keepalive_s)):
        raise ControlPlaneError(f"keepalive_s: must be a finite number > 0; got {keepalive_s}")
    fab = fabric_for(hosts)
    plan = plan_for(fab, placement)
    senders = len(plan.fixed) if plan.fixed is not None else len(plan.senders)
    seconds = flows / (senders * rate_per_gpu)
    rng = np.random.default_rng(seed)
    specs = flows_for(fab, plan, rate_per_gpu, seconds, rng)
    sim = FluidSim(fab, "ark", seed=seed, control_delay_s=control_delay_s,
                   pathmaps=PathMapCache(fab, capacity=4096, lazy=True))
    res = sim.run(specs)
    started = np.bincount([f.src for f in specs], minlength=fab.n_hosts).tolist()
    return _rows(fab, placement, res.messages_by_host, seconds, len(specs), res.races, cost or AgentCost(),
                 heartbeat_s, control_delay_s, arbiter_cost or ArbiterCost(), keepalive_s, started)


def table(rows: Sequence[Row]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
