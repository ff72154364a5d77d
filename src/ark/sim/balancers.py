"""The load balancers an operator could deploy instead of ARK, as fluid-model mechanisms.

Each baseline is a :class:`Balancer`: the simulator (:class:`ark.sim.engine.FluidSim`)
asks it for paths at the moments its published mechanism decides, and moves the flows it
says. What each model keeps of the mechanism, and what a fluid model cannot capture of
it, is written in ``docs/baselines.md``; the parameters are the ``[params.*]`` tables of
an experiment file (:class:`SchemeParams`), with the published defaults.

* :class:`Plb`: host-side Protective Load Balancing as Linux's ``tcp_plb.c`` does it:
  per round trip a round is congested when the ECN-marked fraction is at least
  ``cong_thresh``/256; consecutive congested rounds are counted and reset by an
  uncongested one; at ``rehash_rounds`` the flow takes a new random source port, at
  ``idle_rehash_rounds`` it does so only when nothing is in flight (between two chunks);
  after a retransmission timeout re-hashing is suspended. The marked fraction of a
  round comes from DCTCP's steady state at the flow's standing queues (see
  :meth:`Plb.marked_fraction`).
* :class:`LetFlow`: a uniformly random path per flowlet (a gap of at least the flowlet
  timeout starts one).
* :class:`Conga`: per flowlet, the uplink minimising max(local, remote) link
  utilisation as the leaves' DREs measure it (``T_dre``, ``alpha``, quantised to
  ``quant_bits``); ties keep the previous flowlet's uplink, else are broken at random.
* :class:`Hedera`: a central scheduler that every ``period_s`` estimates the natural
  demand of the elephants (flows above ``elephant_fraction`` of the NIC rate) and places
  them by Global First Fit; flows it moves change path at that poll.
* :class:`OraclePath` (``oracle-path``): not a deployable scheme but a bound: each flow on
  one path, chosen with every flow's bytes left known.

A KV transfer is gapless unless the serving engine sends it in chunks (``[serving]
kv_transfer = "per-layer"``), so flowlets exist only between chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Protocol

import msgspec
import numpy as np

from ark.core.schema import NonNegative, Positive
from ark.core.topology import PACKET_BYTES, Fabric
from ark.sim.maxmin import FairShares
from ark.sim.transfer import MAX_PARTS, Transfer

Unit = Annotated[float, msgspec.Meta(gt=0, le=1)]
BALANCED = ("plb", "letflow", "conga", "hedera")
TWO_TIER_ONLY = ("conga",)  # leaf-local schemes: their model knows one tier of uplinks


class PlbParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.plb]`` table: ``net.ipv4.tcp_plb_*`` (defaults as Linux), plus the round trip of the fluid model.

    Keys:
        cong_thresh: A round is congested when at least this many of 256 packets are ECN-marked.
        rehash_rounds: Congested rounds in a row before a forced re-hash.
        idle_rehash_rounds: Congested rounds before a re-hash while nothing is in flight (0: off).
        forced: Whether the forced re-hash is on (false: idle re-hashes only).
        suspend_rto_s: After a retransmission timeout, no re-hash for a random 1-2x this, s.
        rtt_us: The base round trip: DCTCP's RTT and the length of one round, us.
        ecn_threshold_kb: DCTCP's marking threshold K, kB.
        resolution_us: Re-hashes that come due apply together at the next multiple of this (0:
            each at its own round's end), us; see docs/baselines.md.
    """

    cong_thresh: Annotated[int, msgspec.Meta(ge=0, le=256)] = 128  # of 256: congested round
    rehash_rounds: Annotated[int, msgspec.Meta(ge=1, le=255)] = 12
    idle_rehash_rounds: Annotated[int, msgspec.Meta(ge=0, le=255)] = 3  # 0: off
    forced: bool = True  # false: idle-only re-hash (the forced re-hash off)
    suspend_rto_s: NonNegative = 60.0  # after an RTO no re-hash for a random 1-2x this
    rtt_us: Positive = 20.0  # the base round-trip time: DCTCP's RTT in W, and one round's length
    ecn_threshold_kb: Positive = 100.0  # DCTCP's marking threshold K
    # Re-hashes that come due are applied together at the next multiple of this (0: each at
    # its own round end). A fluid model cannot resolve a flow that moves every 12 rounds
    # (its congestion control would not settle in between); see docs/baselines.md.
    resolution_us: NonNegative = 5000.0


class LetFlowParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.letflow]`` table: LetFlow, a random path per flowlet.

    Keys:
        flowlet_timeout_us: A gap longer than this starts a new flowlet, us.
    """

    flowlet_timeout_us: Positive = 100.0


class CongaParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.conga]`` table: CONGA, the least congested path per flowlet.

    Keys:
        flowlet_timeout_us: A gap longer than this starts a new flowlet, us.
        t_dre_us: The period of the discounting rate estimator, us.
        alpha: The estimator's decay factor per period.
        quant_bits: Bits a congestion metric is quantised to.
    """

    flowlet_timeout_us: Positive = 100.0
    t_dre_us: Positive = 50.0
    alpha: Unit = 0.2
    quant_bits: Annotated[int, msgspec.Meta(ge=1, le=8)] = 3


class HederaParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.hedera]`` table: Hedera, a central scheduler that moves elephant flows.

    Keys:
        period_s: How often the scheduler places the elephants, s.
        elephant_fraction: A flow is an elephant above this share of its NIC's rate.
    """

    period_s: Positive = 5.0
    elephant_fraction: Unit = 0.1


class SplitParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.split]`` table: ``ark-split`` and ``ecmp-split``: sub-flows (connections, QPs) per transfer.

    Keys:
        parts: Sub-flows per transfer.
    """

    parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTS)] = 3


class ConnParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params.conn]`` table: ``ark-conn`` and ``ecmp-conn``: connections kept per peer pair.

    Keys:
        connections: Connections (or QPs) an engine opens to each peer and stripes every transfer over.
        idle_s: A pair's connections that carried nothing this long are closed (their paths counted free).
    """

    connections: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTS)] = 2
    idle_s: Positive = 1.0


class SchemeParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[params]`` table: one sub-table per scheme with parameters.

    Keys:
        plb: PLB's parameters.
        letflow: LetFlow's parameters.
        conga: CONGA's parameters.
        hedera: Hedera's parameters.
        split: The split schemes' parameters.
        conn: The connection schemes' parameters.
    """

    plb: PlbParams = msgspec.field(default_factory=PlbParams)
    letflow: LetFlowParams = msgspec.field(default_factory=LetFlowParams)
    conga: CongaParams = msgspec.field(default_factory=CongaParams)
    hedera: HederaParams = msgspec.field(default_factory=HederaParams)
    split: SplitParams = msgspec.field(default_factory=SplitParams)
    conn: ConnParams = msgspec.field(default_factory=ConnParams)


class Fluid(Protocol):
    """What a balancer sees of the running simulation."""

    fabric: Fabric
    lb_rng: np.random.Generator

    @property
    def now(self) -> float: ...

    @property
    def shares(self) -> FairShares: ...

    @property
    def pending(self) -> int: ...

    def group(self, src: int, dst: int) -> tuple[int, ...]: ...

    def hashed(self, src: int, dst: int, port: int) -> int: ...

    def random_port(self, rng: np.random.Generator) -> int: ...

    def move(self, t: Transfer, path: int, port: int) -> None: ...

    def at(self, t: float, data: object) -> None: ...

    def transfers(self) -> Iterable[Transfer]: ...

    def sending(self, flow: int) -> Transfer | None: ...


class Balancer:
    """A baseline's decisions; the defaults are plain ECMP's (decide nothing)."""

    flowlet_s = math.inf  # an idle gap at least this long starts a new flowlet
    wants_rates = False  # call rates() after every change of the allocation

    def __init__(self, sim: Fluid) -> None:
        self.sim = sim
        self.moves = 0
        self.rehashes = 0  # PLB's; 0 for every other scheme

    def first(self, src: int, dst: int, nbytes: int) -> int | None:
        """A new flow's first path (None: the switch hash of its random port)."""
        return None

    def started(self, t: Transfer) -> None: ...

    def flowlet(self, t: Transfer) -> None:
        """A chunk starts after a gap of at least ``flowlet_s``."""

    def idle(self, t: Transfer) -> None:
        """A chunk ended: nothing of the flow is in flight until the next."""

    def resumed(self, t: Transfer) -> None:
        """The next chunk starts (after ``flowlet`` when that ran)."""

    def rates(self) -> None: ...

    def event(self, data: object) -> None: ...

    def events(self, batch: list[object]) -> None:
        """Its events due at the same instant, in the order they were scheduled."""
        for data in batch:
            self.event(data)

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        """A link failed (``crossed``: on this flow's path); True when this balancer chose
        the flow's new path, False to leave it to the switches' re-hash of its port."""
        return False

    def done(self, t: Transfer) -> None: ...

    def _move(self, t: Transfer, path: int, port: int) -> None:
        if path != t.subs[0].path or port != t.subs[0].port:
            self.moves += 1
            self.sim.move(t, path, port)


# ---------------------------------------------------------------------------------------
# PLB
# ---------------------------------------------------------------------------------------
class _PlbFlow:
    __slots__ = ("armed", "base", "carry", "cong", "k0", "suspended_until", "uncong_at", "version")

    def __init__(self, now: float) -> None:
        self.base = now  # rounds end at base + k x round, k >= 1
        self.cong = False
        self.k0: int | None = None  # first congested round of the current streak
        self.uncong_at = -math.inf
        self.carry = 0
        self.armed = False
        self.version = 0
        self.suspended_until = -math.inf


class Plb(Balancer):
    """Linux PLB over DCTCP (see the module docstring)."""

    wants_rates = True

    def __init__(self, sim: Fluid, p: PlbParams) -> None:
        super().__init__(sim)
        self.p = p
        self.round_s = p.rtt_us * 1e-6
        self.step_s = p.resolution_us * 1e-6
        self.pkt = PACKET_BYTES[sim.fabric.transport][0]  # DCTCP's steady-state window counts packets
        self.tx_links = frozenset(sim.fabric.tx_link(h) for h in range(sim.fabric.n_hosts))

    def started(self, t: Transfer) -> None:
        t.lb = _PlbFlow(self.sim.now)

    def marked(self) -> dict[int, float]:
        """DCTCP's steady state at the standing queues: a switch egress link on which ``N``
        flows are bottlenecked holds a queue at the marking threshold ``K`` and marks
        ``sqrt(2 N / W)`` of the packets, ``W = (C x RTT + K) / packet`` (Alizadeh et al.,
        "Analysis of DCTCP"). A link where no flow is bottlenecked holds no queue and marks
        nothing; host transmit links are the sender's own (no switch queue)."""
        shares = self.sim.shares
        out: dict[int, float] = {}
        for lk, flows in enumerate(shares.beta_of):
            if flows and lk not in self.tx_links:
                w = (shares.capacity[lk] * self.round_s + self.p.ecn_threshold_kb * 1e3) / self.pkt
                out[lk] = min(1.0, math.sqrt(2.0 * len(flows) / w))
        return out

    def rates(self) -> None:
        now = self.sim.now
        marked = self.marked()
        for t in self.sim.transfers():
            s: _PlbFlow = t.lb
            # A round's marked fraction: the largest of the queues the flow crosses.
            frac = max([marked.get(lk, 0.0) for lk in t.subs[0].links])
            cong = frac * 256 >= self.p.cong_thresh
            if cong:
                if not s.cong:
                    if s.k0 is None or self._round_end_in(s, s.uncong_at, now):
                        s.k0 = self._next_round(s, now)
                    s.cong = True
                if not s.armed:
                    self._arm(t, now)
            elif s.cong:
                s.cong, s.uncong_at = False, now
                self._disarm(s)

    def _next_round(self, s: _PlbFlow, t: float) -> int:
        """The first round that ends at or after ``t``."""
        return max(1, math.ceil((t - s.base) / self.round_s - 1e-9))

    def _round_end_in(self, s: _PlbFlow, a: float, b: float) -> bool:
        return s.base + self._next_round(s, a) * self.round_s < b

    def _count(self, s: _PlbFlow, now: float) -> int:
        """Congested rounds of the current streak that have ended by ``now``."""
        if not s.cong or s.k0 is None:
            return 0
        return max(0, math.floor((now - s.base) / self.round_s + 1e-9) - s.k0 + 1)

    def _arm(self, t: Transfer, now: float) -> None:
        s: _PlbFlow = t.lb
        if not self.p.forced or s.k0 is None:
            return
        at = s.base + (s.k0 + self.p.rehash_rounds - 1) * self.round_s
        at = max(at, s.base + self._next_round(s, max(now, s.suspended_until)) * self.round_s)
        if self.step_s:
            at = math.ceil(at / self.step_s - 1e-9) * self.step_s
        s.armed = True
        self.sim.at(at, (t.id, s.version))

    def _disarm(self, s: _PlbFlow) -> None:
        s.version += 1
        s.armed = False

    def event(self, data: object) -> None:
        assert isinstance(data, tuple)
        fid, version = data
        t = self.sim.sending(fid)
        if t is None or t.lb.version != version or not t.lb.cong:
            return
        t.lb.armed = False
        if self.sim.now < t.lb.suspended_until:
            self._arm(t, self.sim.now)
            return
        self._rehash(t)

    def _rehash(self, t: Transfer) -> None:
        """A new random source port (``sk_rethink_txhash``); the streak starts over."""
        s: _PlbFlow = t.lb
        self.rehashes += 1
        port = self.sim.random_port(self.sim.lb_rng)
        self._disarm(s)
        s.cong, s.k0, s.uncong_at = False, None, -math.inf
        self._move(t, self.sim.hashed(t.res.src, t.res.dst, port), port)

    def idle(self, t: Transfer) -> None:
        s: _PlbFlow = t.lb
        now = self.sim.now
        count = self._count(s, now)
        self._disarm(s)
        if self.p.idle_rehash_rounds and count >= self.p.idle_rehash_rounds and now >= s.suspended_until:
            self._rehash(t)
            count = 0
        s.carry = count

    def resumed(self, t: Transfer) -> None:
        s: _PlbFlow = t.lb
        s.base = self.sim.now  # rounds restart with the data; the streak carries over
        s.k0 = 1 - s.carry if s.cong and s.carry else None
        if s.k0 is None:
            s.cong = False

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        if not crossed:
            return False
        # Its packets are lost until it moves: a retransmission timeout re-hashes the
        # flow (Linux re-hashes on RTO) and suspends PLB for a random 1-2x suspend_rto_s.
        s: _PlbFlow = t.lb
        s.suspended_until = self.sim.now + float(self.sim.lb_rng.uniform(1.0, 2.0)) * self.p.suspend_rto_s
        self._rehash(t)
        return True


# ---------------------------------------------------------------------------------------
# Flowlet switching: LetFlow and CONGA
# ---------------------------------------------------------------------------------------
class LetFlow(Balancer):
    """A uniformly random path of the ECMP group for every new flowlet."""

    def __init__(self, sim: Fluid, p: LetFlowParams) -> None:
        super().__init__(sim)
        self.flowlet_s = p.flowlet_timeout_us * 1e-6

    def _random(self, t: Transfer) -> int:
        group = self.sim.group(t.res.src, t.res.dst)
        return group[int(self.sim.lb_rng.integers(len(group)))]

    def flowlet(self, t: Transfer) -> None:
        self._move(t, self._random(t), t.subs[0].port)

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        if crossed:  # its flowlet's next hop is gone: the switch picks again
            self._move(t, self._random(t), t.subs[0].port)
        return True


class Conga(Balancer):
    """Leaf-local congestion-aware flowlets (2-tier fabrics)."""

    wants_rates = True

    def __init__(self, sim: Fluid, p: CongaParams) -> None:
        super().__init__(sim)
        fab = sim.fabric
        if fab.tiers != 2:
            raise ValueError("conga: needs a 2-tier spine-leaf fabric")
        self.flowlet_s = p.flowlet_timeout_us * 1e-6
        self.tau = p.t_dre_us * 1e-6 / p.alpha  # the DRE's time constant
        self.levels = 1 << p.quant_bits
        self.tracked = range(2 * fab.n_hosts, fab.n_links)
        n = fab.n_links
        self._t0 = [0.0] * n
        self._u0 = [0.0] * n
        self._target = [0.0] * n

    def util(self, lk: int) -> float:
        """The DRE's utilisation estimate of ``lk`` now: its load over capacity, low-pass
        filtered with time constant T_dre / alpha."""
        dt = self.sim.now - self._t0[lk]
        return self._target[lk] + (self._u0[lk] - self._target[lk]) * math.exp(-dt / self.tau)

    def rates(self) -> None:
        shares, now = self.sim.shares, self.sim.now
        for lk in self.tracked:
            cap = shares.capacity[lk]
            load = sum(shares.rate[g] for g in shares.users[lk])
            target = load / cap if cap > 0 else 1.0
            if target != self._target[lk]:
                self._u0[lk], self._t0[lk] = self.util(lk), now
                self._target[lk] = target

    def _metric(self, lk: int) -> int:
        return min(self.levels - 1, int(self.util(lk) * self.levels))

    def choose(self, src: int, dst: int, prev: int | None) -> int:
        """The uplink minimising max(local, remote) quantised utilisation."""
        fab = self.sim.fabric
        a, b = fab.leaf_of(src), fab.leaf_of(dst)
        best, cands = self.levels, []
        for k in self.sim.group(src, dst):
            m = max(self._metric(fab.uplink(a, k)), self._metric(fab.downlink(k, b)))
            if m < best:
                best, cands = m, [k]
            elif m == best:
                cands.append(k)
        if prev in cands:
            return prev
        return cands[int(self.sim.lb_rng.integers(len(cands)))]

    def first(self, src: int, dst: int, nbytes: int) -> int | None:
        if self.sim.fabric.n_paths(src, dst) == 1:
            return 0
        return self.choose(src, dst, None)

    def flowlet(self, t: Transfer) -> None:
        self._move(t, self.choose(t.res.src, t.res.dst, t.subs[0].path), t.subs[0].port)

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        if crossed:
            self._move(t, self.choose(t.res.src, t.res.dst, None), t.subs[0].port)
        return True


# ---------------------------------------------------------------------------------------
# Hedera
# ---------------------------------------------------------------------------------------
def estimate_demands(pairs: Sequence[tuple[int, int]], tx: Sequence[float], rx: Sequence[float]) -> list[float]:
    """Hedera's demand estimation: each flow's max-min natural demand when only the hosts'
    NICs limit it (``tx[src]``, ``rx[dst]``): senders split their rate equally among
    their unconverged flows, receivers over their limit cap the largest ones to an equal
    share, until nothing changes."""
    n = len(pairs)
    d, conv = [0.0] * n, [False] * n
    by_src: dict[int, list[int]] = {}
    by_dst: dict[int, list[int]] = {}
    for i, (s, r) in enumerate(pairs):
        by_src.setdefault(s, []).append(i)
        by_dst.setdefault(r, []).append(i)
    for _ in range(4 * n + 4):
        changed = False
        for s, fs in by_src.items():
            free = [i for i in fs if not conv[i]]
            if free:
                es = max(0.0, tx[s] - sum(d[i] for i in fs if conv[i])) / len(free)
                for i in free:
                    changed |= d[i] != es
                    d[i] = es
        for r, fs in by_dst.items():
            changed |= _receiver_limit(fs, d, conv, rx[r])
        if not changed:
            break
    return d


def _receiver_limit(fs: list[int], d: list[float], conv: list[bool], cap: float) -> bool:
    if sum(d[i] for i in fs) <= cap * (1 + 1e-12):
        return False
    limited, small = set(fs), 0.0
    es = cap / len(limited)
    while True:
        below = [i for i in limited if d[i] < es]
        if not below:
            break
        for i in below:
            small += d[i]
            limited.discard(i)
        if not limited:
            return False
        es = (cap - small) / len(limited)
    changed = False
    for i in sorted(limited):
        changed |= d[i] != es or not conv[i]
        d[i], conv[i] = es, True
    return changed


class Hedera(Balancer):
    """A central scheduler polling every ``period_s``: Global First Fit of the elephants."""

    def __init__(self, sim: Fluid, p: HederaParams) -> None:
        super().__init__(sim)
        self.p = p
        self.placed: dict[int, int] = {}  # flow -> the path the scheduler gave it
        self._armed = False
        self.polls = 0

    def started(self, t: Transfer) -> None:
        if not self._armed:
            self._armed = True
            self.sim.at(math.ceil(self.sim.now / self.p.period_s + 1e-12) * self.p.period_s, None)

    def event(self, data: object) -> None:
        self.polls += 1
        self.poll()
        if self.sim.pending:
            self.sim.at(self.sim.now + self.p.period_s, None)
        else:
            self._armed = False

    def poll(self) -> None:
        sim, fab = self.sim, self.sim.fabric
        nic = [h.nic_bps * fab.efficiency / 8 for h in fab.hosts]
        flows = sorted((t for t in sim.transfers() if fab.n_paths(t.res.src, t.res.dst) > 1), key=lambda t: t.id)
        big = [t for t in flows if t.id in self.placed or t.rate > self.p.elephant_fraction * nic[t.res.src]]
        demand = estimate_demands([(t.res.src, t.res.dst) for t in big], nic, nic)
        left = list(sim.shares.capacity)
        order = sorted(range(len(big)), key=lambda i: (big[i].id not in self.placed, big[i].id))
        for i in order:
            t = big[i]
            stages = fab.stages(t.res.src, t.res.dst)
            path = self.placed.get(t.id)
            if path is None:
                path = next((k for k in sim.group(t.res.src, t.res.dst)
                             if all(left[st[k]] >= demand[i] for st in stages)), None)
                if path is None:
                    continue  # nothing fits: it stays on its hashed path
                self.placed[t.id] = path
                self._move(t, path, t.subs[0].port)
            for st in stages:
                left[st[path]] -= demand[i]

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        if t.id not in self.placed:
            return False
        if crossed:  # its entries are gone: back to the hash until the next poll
            del self.placed[t.id]
            return False
        return True

    def done(self, t: Transfer) -> None:
        self.placed.pop(t.id, None)


# ---------------------------------------------------------------------------------------
# The single-path bound
# ---------------------------------------------------------------------------------------
class OraclePath(Balancer):
    """Not deployable: a controller that knows every flow's bytes left puts each new flow on
    the path where it would finish first under processor sharing (its bytes plus, of each
    flow already there, as many bytes as it has or as the new flow has, whichever is less).
    What a single-path placement with perfect information reaches."""

    def first(self, src: int, dst: int, nbytes: int) -> int:
        sim = self.sim
        group = sim.group(src, dst)
        if len(group) == 1:
            return group[0]
        now, ahead = sim.now, dict.fromkeys(group, 0.0)
        stages = sim.fabric.stages(src, dst)
        mine = {st[k]: k for st in stages for k in group}
        for t in sim.transfers():
            left = t.left(now)
            # Charge a flow once per path of ours it shares a reservable link with.
            for k in {mine[lk] for lk in t.subs[0].links if lk in mine}:
                ahead[k] += min(left, float(nbytes))
        return min(group, key=lambda k: (ahead[k], k))

    def link_down(self, t: Transfer, crossed: bool) -> bool:
        if crossed:  # placed again by the same rule, for the bytes it has left
            self._move(t, self.first(t.res.src, t.res.dst, int(t.left(self.sim.now))), t.subs[0].port)
        return True


def make_balancer(scheme: str, params: SchemeParams, sim: Fluid) -> Balancer | None:
    """The balancer of a baseline scheme (None for the others)."""
    if scheme == "plb":
        return Plb(sim, params.plb)
    if scheme == "letflow":
        return LetFlow(sim, params.letflow)
    if scheme == "conga":
        return Conga(sim, params.conga)
    if scheme == "hedera":
        return Hedera(sim, params.hedera)
    if scheme == "oracle-path":
        return OraclePath(sim)
    return None
