"""A deterministic fault harness (VOPR-style) over ``ark.core.node.Node``.

One seed fixes everything: the fault mix (loss, duplication, delay and reordering,
partitions, crashes and restarts, clock skew) and the workload. Invariants are checked
after every step; a violation raises :class:`Violation` naming the seed, and
``python -m tests.vopr SEED`` reruns it.

Invariants:

* after every event, on the replica it touched: no link is held by two flows one of which
  claims it alone (``exclusive_conflicts`` at the replica's own clock), and the
  incrementally maintained table equals a full recomputation;
* at quiet points (partitions healed, crashed hosts restarted, no message in flight,
  syncs done): every replica holds the same table at the same instant; every flow whose
  owner released it, or whose lease has run out, is gone everywhere; every local flow
  that is reserved sits on the path the tables give it.
"""

from __future__ import annotations

import heapq
import random
import sys
from dataclasses import dataclass, field

from ark.core.lease import LeasePolicy
from ark.core.messages import FlowId
from ark.core.node import K_HELLO, Node, NotReady, Output, Publish, decode_envelope
from ark.core.pathmap import PathMapCache
from ark.core.topology import spine_leaf

FABRIC = spine_leaf(leaves=3, spines=3, gpus_per_leaf=2, hash="crc32")
MAPS = PathMapCache(FABRIC)
N = FABRIC.n_hosts
LEASE = LeasePolicy(min_s=0.4, slack=2.0)
GRACE = 0.05
TICK = 0.02


class Violation(AssertionError):
    pass


@dataclass
class Faults:
    loss: float
    dup: float
    delay: float
    jitter: float
    skew: float
    partitions: bool
    crashes: bool

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
        )


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
        self.skew = [self.rng.uniform(-self.faults.skew, self.faults.skew) for _ in range(N)]
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

    def _new_node(self, i: int) -> Node:
        return Node(
            i, FABRIC, MAPS, [p for p in range(N) if p != i],
            incarnation=self.incarnation[i], seed=self.seed * 31 + i, lease=LEASE,
            heartbeat_s=0.1, peer_timeout_s=0.5, sync_timeout_s=0.3, retention_s=5.0,
            expiry_grace_s=GRACE,
        )

    def _push(self, at: float, kind: str, data: tuple) -> None:
        heapq.heappush(self.heap, (at, self.seq, kind, data))
        self.seq += 1

    def _emit(self, src: int, outs: list[Output]) -> None:
        f = self.faults
        for o in outs:
            chan = "pub" if isinstance(o, Publish) else "p2p"
            dests = [d for d in range(N) if d != src] if isinstance(o, Publish) else [o.peer]
            for d in dests:
                if (src, d) in self.blocked or self.rng.random() < f.loss:
                    continue
                for _ in range(2 if self.rng.random() < f.dup else 1):
                    at = self.t + f.delay + self.rng.random() * f.jitter
                    self._push(at, "msg", (src, d, chan, o.data))

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
                outs = node.on_publish(src, raw, now) if chan == "pub" else node.on_request(src, raw, now)
                self._emit(d, outs)
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
        src = self.rng.randrange(N)
        node = self.nodes[src]
        if node is None:
            return
        dst = self.rng.choice([h for h in range(N) if FABRIC.hosts[h].leaf != FABRIC.hosts[src].leaf])
        nbytes = self.rng.choice([10**6, 10**8, 10**9])
        try:
            lease, outs = node.reserve(dst, nbytes, self.local(src))
        except NotReady:
            return
        self._emit(src, outs)
        self.check_host(src)
        dur = self.rng.uniform(0.01, 1.5)
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
            self.gone_by[f] = self.t + node.lease_of(f).expires - self.local(i) + 2 * self.faults.skew + 0.2
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
        if node is not None:
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
        self.faults = Faults(0.0, 0.0, saved.delay, saved.jitter, saved.skew, False, False)
        self.run_until(self.t + period)
        for _ in range(1000):  # drain whatever protocol traffic is still in flight
            busy = [e[0] for e in self.heap if e[2] == "msg" and decode_envelope(e[3][3]).kind != K_HELLO]
            if not busy:
                break
            self.run_until(min(busy))
        self.faults = saved

    def check_quiet(self) -> None:
        nodes = [n for n in self.nodes if n is not None]
        at = self.t
        digests = {n.host: n.core.digest(at=at) for n in nodes}
        if len(set(digests.values())) != 1:
            tables = {n.host: n.core.table(at=at) for n in nodes}
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
        print(f"seed {s}: ok ({sim.steps} steps, faults {sim.faults})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
