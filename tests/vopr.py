"""A deterministic fault harness (VOPR-style) over ``ark.core.node.Node``.

One seed fixes everything: the fault mix (loss, duplication, delay and reordering,
partitions, crashes and restarts, clock skew), the workload, and whether dissemination is
scoped: about half the seeds declare which hosts send to which (some hosts send to none),
and every node then hears only the senders of its component and reserves only within its
links (``ark.core.scope``), as agents with ``scope = "declared"`` do. About a quarter of the
unscoped seeds make one host *Byzantine*: a listed peer that runs a correct node but lies
in what it sends (frozen-assignment claims about others' flows in its snapshots, captured
signed messages of other hosts relayed again, a clock that reads differently to different
peers); it starts no flows, and the invariants below are checked on the honest hosts only.
A third of the requests are multi-path leases (:meth:`Node.reserve_split`, 2-5 parts held
and released together); each part must then keep every invariant a single flow keeps.
Invariants are checked after every step; a violation raises :class:`Violation` naming the
seed, and ``python -m tests.vopr SEED`` reruns it.

Invariants:

* after every event, on the replica it touched: no link is held by two flows one of which
  claims it alone (``exclusive_conflicts`` at the replica's own clock), and the
  incrementally maintained table equals a full recomputation;
* at quiet points (partitions healed, crashed hosts restarted, no message in flight,
  syncs done): every replica of a component holds the same table at the same instant
  (scoped runs: a component's senders; otherwise every host); every flow whose
  owner released it, or whose lease has run out, is gone everywhere; every local flow
  that is reserved sits on the path the tables give it.
"""

from __future__ import annotations

import heapq
import random
import sys
from collections import deque
from dataclasses import dataclass, field

from ark.core.envelope import K_DATA, K_SYNC_REP
from ark.core.lease import LeasePolicy
from ark.core.messages import FlowId
from ark.core.node import K_HELLO, Node, NodeLimits, NotReady, Output, Publish, decode_envelope
from ark.core.pathmap import PathMapCache
from ark.core.scope import Scope, scope_of
from ark.core.topology import spine_leaf
from tests.liars import add_to_sync_reply, shift_clock, sign, verify

FABRIC = spine_leaf(leaves=3, spines=3, gpus_per_leaf=2, hash="crc32")
MAPS = PathMapCache(FABRIC)
N = FABRIC.n_hosts
LEASE = LeasePolicy(min_s=0.4, slack=2.0)
GRACE = 0.05
TICK = 0.02
CLOCK_BOUND = 0.1  # max_clock_offset_s: a host further off stops reserving


class Violation(AssertionError):
    pass


class Liar:
    """What a Byzantine host does to the envelopes it sends (its node stays correct)."""

    def __init__(self, host: int, rng: random.Random) -> None:
        self.host, self.rng = host, rng
        # The clock it shows each peer: its own, or one off by up to a few seconds.
        self.shift = {d: rng.choice([0.0, 0.0, 0.5, -0.5, 3.0]) for d in range(N) if d != host}
        self.captured: deque[list[bytes]] = deque(maxlen=64)  # others' signed messages it saw

    def overhear(self, data: bytes) -> None:
        env = decode_envelope(data)
        if env.kind == K_DATA:
            self.captured.append(list(env.payload))

    def rewrite(self, node: Node, dst: int, data: bytes) -> bytes:
        kind = decode_envelope(data).kind
        if kind == K_HELLO:
            return shift_clock(data, self.shift[dst])
        if kind == K_SYNC_REP:
            return add_to_sync_reply(data, self._replays(), self._claims(node))
        return data

    def _replays(self) -> list[list[bytes]]:
        k = min(len(self.captured), self.rng.randint(0, 3))
        return self.rng.sample(list(self.captured), k)

    def _claims(self, node: Node) -> list[list[int | bool]]:
        others = sorted(f for f in node.core.table() if f[0] != self.host)
        picked = self.rng.sample(others, min(len(others), self.rng.randint(1, 3)))
        return [[f[0], f[1], self.rng.randrange(-1, 3), self.rng.random() < 0.2] for f in picked]


@dataclass
class Faults:
    loss: float
    dup: float
    delay: float
    jitter: float
    skew: float
    partitions: bool
    crashes: bool
    # One host's clock off by this much (signed): within CLOCK_BOUND it must keep
    # reserving safely; beyond it, it must stop reserving instead of double-booking.
    outlier: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random) -> Faults:
        return cls(
            loss=rng.choice([0.0, 0.01, 0.05, 0.2]),
            dup=rng.choice([0.0, 0.02, 0.1]),
            delay=rng.choice([20e-6, 1e-3, 5e-3]),
            jitter=rng.choice([0.0, 1e-3, 10e-3]),
            skew=rng.choice([0.0, 1e-4, 2e-3]),
            partitions=rng.random() < 0.5,
            crashes=rng.random() < 0.5,
            outlier=rng.choice([0.0, 0.0, 0.04, -0.04, 0.3, -0.3]),
        )

    @property
    def max_offset(self) -> float:
        return 2 * self.skew + abs(self.outlier)


@dataclass
class Client:
    flow: FlowId
    owner: int
    incarnation: int
    ends_at: float  # true time the transfer finishes
    alive: bool = True


@dataclass
class Sim:
    seed: int
    rng: random.Random = field(init=False)
    faults: Faults = field(init=False)
    t: float = 1.0  # wire timestamps are >= 0; start clear of 0 whatever the skew

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.faults = Faults.draw(self.rng)
        # Drawn from a generator of its own, so an unscoped seed runs as it always has.
        self.scope, self.sends_to = _draw_scope(random.Random(f"scope-{self.seed}"))
        brng = random.Random(f"byzantine-{self.seed}")
        self.liar = Liar(brng.randrange(N), brng) if self.scope is None and brng.random() < 0.25 else None
        self.split_rng = random.Random(f"split-{self.seed}")
        self.splits = 0  # multi-path leases taken
        self.skew = [self.rng.uniform(-self.faults.skew, self.faults.skew) for _ in range(N)]
        self.skew[self.rng.randrange(N)] += self.faults.outlier
        self.incarnation = [1] * N
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.seq = 0
        self.blocked: set[tuple[int, int]] = set()
        self.nodes: list[Node | None] = [self._new_node(i) for i in range(N)]
        self.clients: dict[FlowId, Client] = {}
        self.gone_by: dict[FlowId, float] = {}  # flow -> true time by which it must be gone
        self.steps = 0
        self.checks = 0
        for i in range(N):
            self._push(self.t + TICK * (i + 1) / N, "tick", (i, 1))
            node = self.nodes[i]
            assert node is not None
            self._emit(i, node.start(self.local(i)))

    # ------------------------------------------------------------------ plumbing
    def local(self, i: int) -> float:
        return self.t + self.skew[i]

    def peers(self, i: int) -> list[int]:
        if self.scope is None:
            return [p for p in range(N) if p != i]
        return sorted(self.scope.peers(i))

    def _new_node(self, i: int) -> Node:
        return Node(
            i, FABRIC, MAPS, self.peers(i),
            incarnation=self.incarnation[i], seed=self.seed * 31 + i, lease=LEASE,
            heartbeat_s=0.1, peer_timeout_s=0.5, sync_timeout_s=0.3, retention_s=5.0,
            expiry_grace_s=GRACE, limits=NodeLimits(max_clock_offset_s=CLOCK_BOUND),
            scope_links=None if self.scope is None else self.scope.links(i),
            signer=lambda raw: sign(i, raw), verifier=verify,
        )

    def honest(self, i: int) -> bool:
        return self.liar is None or i != self.liar.host

    def _push(self, at: float, kind: str, data: tuple) -> None:
        heapq.heappush(self.heap, (at, self.seq, kind, data))
        self.seq += 1

    def _emit(self, src: int, outs: list[Output]) -> None:
        f = self.faults
        for o in outs:
            chan = "pub" if isinstance(o, Publish) else "p2p"
            dests = self.peers(src) if isinstance(o, Publish) else [o.peer]
            for d in dests:
                if (src, d) in self.blocked or self.rng.random() < f.loss:
                    continue
                data = o.data
                if not self.honest(src):
                    node = self.nodes[src]
                    assert self.liar is not None and node is not None
                    data = self.liar.rewrite(node, d, data)
                for _ in range(2 if self.rng.random() < f.dup else 1):
                    at = self.t + f.delay + self.rng.random() * f.jitter
                    self._push(at, "msg", (src, d, chan, data))

    def fail(self, what: str) -> None:
        raise Violation(f"seed {self.seed}, step {self.steps}, t={self.t:.4f}: {what}  "
                        f"(rerun: python -m tests.vopr {self.seed})")

    # ------------------------------------------------------------------ events
    def run_until(self, target: float) -> None:
        while self.heap and self.heap[0][0] <= target:
            at, _, kind, data = heapq.heappop(self.heap)
            self.t = max(self.t, at)
            if kind == "msg":
                src, d, chan, raw = data
                node = self.nodes[d]
                if node is None or (src, d) in self.blocked:
                    continue
                now = self.local(d)
                if not self.honest(d) and chan == "pub":
                    assert self.liar is not None
                    self.liar.overhear(raw)
                outs = node.on_publish(src, raw, now) if chan == "pub" else node.on_request(src, raw, now)
                self._emit(d, outs)
                if self.rng.random() < 0.5:  # the agent flushes after a batch of messages
                    node.flush()
                self.check_host(d)
            elif kind == "tick":
                i, inc = data
                node = self.nodes[i]
                if node is not None and inc == self.incarnation[i]:
                    self._emit(i, node.tick(self.local(i)))
                    self._push(self.t + TICK, "tick", data)
                    self.check_host(i)
            elif kind == "renew":
                self._renew(data[0])
            elif kind == "finish":
                self._finish(data[0])
            elif kind == "restart":
                self._restart(data[0])
            elif kind == "heal":
                self.blocked.clear()
        self.t = max(self.t, target)

    def _client_node(self, c: Client) -> Node | None:
        node = self.nodes[c.owner]
        if node is None or self.incarnation[c.owner] != c.incarnation:
            return None
        return node

    def _renew(self, flow: FlowId) -> None:
        c = self.clients.get(flow)
        if c is None or not c.alive:
            return
        node = self._client_node(c)
        if node is None or flow not in node.local_flows():
            return
        _lease, outs = node.renew(flow, self.local(c.owner))
        self._emit(c.owner, outs)
        self._push(self.t + LEASE.min_s / 3, "renew", (flow,))

    def _finish(self, flow: FlowId) -> None:
        c = self.clients.pop(flow, None)
        if c is None or not c.alive:
            return
        node = self._client_node(c)
        if node is None or flow not in node.local_flows():
            return
        self._emit(c.owner, node.release(flow, self.local(c.owner)))
        self.check_host(c.owner)
        self.gone_by[flow] = self.t

    def _restart(self, i: int) -> None:
        self.incarnation[i] += 1
        node = self.nodes[i] = self._new_node(i)
        self._emit(i, node.start(self.local(i)))
        self._push(self.t + TICK, "tick", (i, self.incarnation[i]))

    # ------------------------------------------------------------------ actions
    def reserve(self) -> None:
        if self.scope is None:
            src = self.rng.randrange(N)
            dsts = [h for h in range(N) if FABRIC.hosts[h].leaf != FABRIC.hosts[src].leaf]
        else:
            src = self.rng.choice(sorted(self.sends_to))
            dsts = self.sends_to[src]
        node = self.nodes[src]
        if node is None or not self.honest(src):
            return
        dst = self.rng.choice(dsts)
        nbytes = self.rng.choice([10**6, 10**8, 10**9])
        # A third of the requests are multi-path leases (2-5 parts, more than the paths at
        # times), drawn apart so that the main stream of draws stays as it was.
        parts = self.split_rng.randint(2, 5) if self.split_rng.random() < 1 / 3 else 1
        try:
            if parts == 1:
                leases, outs = node.reserve(dst, nbytes, self.local(src))
                leases = [leases]
            else:
                leases, outs = node.reserve_split(dst, nbytes, self.local(src), parts)
                self.splits += 1
        except NotReady:
            return
        self._emit(src, outs)
        self.check_host(src)
        dur = self.rng.uniform(0.01, 1.5)
        for lease in leases:  # the parts of a split are held, renewed and released together
            self.clients[lease.flow_id] = Client(lease.flow_id, src, self.incarnation[src], self.t + dur)
            self._push(self.t + dur, "finish", (lease.flow_id,))
            self._push(self.t + LEASE.min_s / 3, "renew", (lease.flow_id,))

    def client_dies(self) -> None:
        live = [c for c in self.clients.values() if c.alive]
        if not live:
            return
        c = self.rng.choice(live)
        c.alive = False
        node = self._client_node(c)
        if node is not None and c.flow in node.local_flows():
            self.gone_by[c.flow] = self.t + node.lease_of(c.flow).expires - self.local(c.owner) + 0.2

    def crash(self) -> None:
        up = [i for i in range(N) if self.nodes[i] is not None]
        if len(up) <= 1:
            return
        i = self.rng.choice(up)
        node = self.nodes[i]
        assert node is not None
        for f in node.local_flows():
            c = self.clients.get(f)
            if c is not None:
                c.alive = False
            # Its reservations must vanish everywhere within one lease (plus skew, grace).
            self.gone_by[f] = self.t + node.lease_of(f).expires - self.local(i) + self.faults.max_offset + 0.2
        self.nodes[i] = None
        self._push(self.t + self.rng.uniform(0.05, 1.0), "restart", (i,))

    def partition(self) -> None:
        side = set(self.rng.sample(range(N), self.rng.randint(1, N // 2)))
        for a in range(N):
            for b in range(N):
                if (a in side) != (b in side):
                    self.blocked.add((a, b))
        self._push(self.t + self.rng.uniform(0.05, 1.5), "heal", ())

    def step(self) -> None:
        self.steps += 1
        r = self.rng.random()
        if r < 0.45:
            self.reserve()
        elif r < 0.5:
            self.client_dies()
        elif r < 0.54 and self.faults.crashes:
            self.crash()
        elif r < 0.58 and self.faults.partitions:
            self.partition()
        self.run_until(self.t + self.rng.choice([0.0, 1e-4, 1e-3, 0.02, 0.1]))

    # ------------------------------------------------------------------ invariants
    def check_host(self, i: int) -> None:
        """After every event, on the replica it changed."""
        node = self.nodes[i]
        if node is not None and self.honest(i):
            bad = node.core.exclusive_conflicts(at=self.local(i))
            if bad:
                self.fail(f"host {i} has links held by two winners: {bad}")
            # The incremental paths must agree with a full recomputation (checked on
            # every 8th event: a recomputation costs as much as the event itself).
            self.checks += 1
            if self.checks % 8:
                return
            core = node.core
            before = ({f: (e[2], e[3]) for f, e in core.entries().items()}, core.link_holders())
            core._recompute()
            after = ({f: (e[2], e[3]) for f, e in core.entries().items()}, core.link_holders())
            if before != after:
                diff = {f: (before[0][f], after[0].get(f)) for f in before[0] if before[0][f] != after[0].get(f)}
                self.fail(f"host {i}: incremental state differs from a recomputation: {diff} "
                          f"holders equal: {before[1] == after[1]}")

    def quiesce(self, period: float = 1.0) -> None:
        """Heal, restart everyone, hold the workload, and let syncs and expiry finish.

        Transfers that would finish meanwhile are postponed by the quiet period (their
        clients keep renewing), so that no RESERVE or RELEASE is in flight at the check.
        """
        self.blocked.clear()
        for i in range(N):
            if self.nodes[i] is None:
                self._restart(i)
        held = []
        for e in self.heap:
            if e[2] == "finish":
                held.append((e[0] + period, e[1], e[2], e[3]))
            elif e[2] not in ("restart", "heal"):
                held.append(e)
        self.heap = held
        heapq.heapify(self.heap)
        saved = self.faults
        self.faults = Faults(0.0, 0.0, saved.delay, saved.jitter, saved.skew, False, False, saved.outlier)
        self.run_until(self.t + period)
        for _ in range(1000):  # drain whatever protocol traffic is still in flight
            busy = [e[0] for e in self.heap if e[2] == "msg" and decode_envelope(e[3][3]).kind != K_HELLO]
            if not busy:
                break
            self.run_until(min(busy))
        self.faults = saved

    def check_quiet(self) -> None:
        nodes = [n for n in self.nodes if n is not None and self.honest(n.host)]
        at = self.t
        for group in self.components():
            members = [n for n in nodes if n.host in group]
            digests = {n.host: n.core.digest(at=at) for n in members}
            if len(set(digests.values())) > 1:
                tables = {n.host: n.core.table(at=at) for n in members}
                self.fail(f"tables differ once quiet: {tables}")
        for f, by in self.gone_by.items():
            if by <= self.t:
                for n in nodes:
                    if f in n.core.table():
                        self.fail(f"flow {f} released/expired by t={by:.3f} still held at host {n.host}")
        for n in nodes:
            table = n.core.table(at=self.local(n.host))
            for f, (_dst, path, _port, reserved) in n.core.local_flows().items():
                if reserved and f in table and table[f][0] != path:
                    self.fail(f"host {n.host} flow {f} on path {path} but the table says {table[f][0]}")
        self.check_no_double_booking(nodes)

    def components(self) -> list[frozenset[int]]:
        """Groups of hosts that must hold the same table (all hosts unless scoped)."""
        return [frozenset(range(N))] if self.scope is None else self.scope.components()

    def check_no_double_booking(self, nodes: list[Node]) -> None:
        """What owners believe they hold, every replica holds: no link has two exclusive holders.

        A reserved local flow missing from a replica's table (its lease already over on
        that replica's clock) would let that replica's host take the same links. A host
        that stopped reserving (skewed clock) takes no links, so its table is not judged.
        """
        for n in nodes:
            for f, (_dst, path, _port, reserved) in n.core.local_flows().items():
                if not reserved:
                    continue
                if n.skewed:
                    self.fail(f"host {n.host} stopped reserving ({n.skewed}) but flow {f} still claims a path")
                for m in nodes:
                    if m.skewed or (m.host != n.host and m.host not in self.peers(n.host)):
                        continue  # a host outside the component never hears of the flow
                    held = m.core.table(at=self.local(m.host)).get(f)
                    if held is None or held[0] != path:
                        self.fail(f"host {n.host} flow {f} holds path {path}; host {m.host} (clock "
                                  f"{self.skew[m.host]:+.3f}) has {held}")
        offset = max(abs(x) for x in self.skew)
        skewed = [n.host for n in nodes if n.skewed]
        if offset < CLOCK_BOUND / 2 and skewed:
            self.fail(f"hosts {skewed} stopped reserving with clocks within {offset:.3f} s")


def _draw_scope(rng: random.Random) -> tuple[Scope | None, dict[int, list[int]]]:
    """Half the seeds: each host sends to zero, one or two hosts on other leaves."""
    if rng.random() < 0.5:
        return None, {}
    sends_to: dict[int, list[int]] = {}
    for h in range(N):
        others = [d for d in range(N) if FABRIC.hosts[d].leaf != FABRIC.hosts[h].leaf]
        k = rng.choice([0, 1, 1, 2])
        if k:
            sends_to[h] = sorted(rng.sample(others, k))
    if not sends_to:
        sends_to[0] = [N - 1]
    return scope_of(FABRIC, [(s, d) for s, ds in sends_to.items() for d in ds]), sends_to


def run(seed: int, steps: int = 120, quiet_every: int = 40) -> Sim:
    sim = Sim(seed)
    for k in range(1, steps + 1):
        sim.step()
        if k % quiet_every == 0:
            sim.quiesce()
            sim.check_quiet()
    return sim


def main(argv: list[str]) -> int:
    seeds = [int(a) for a in argv] or [0]
    for s in seeds:
        sim = run(s)
        scope = "full" if sim.scope is None else f"scoped {sim.sends_to}"
        scope += "" if sim.liar is None else f", host {sim.liar.host} Byzantine"
        print(f"seed {s}: ok ({sim.steps} steps, faults {sim.faults}, {scope})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
