"""A small in-memory cluster of ArkCore replicas for protocol tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ark.core.messages import FlowId, Message, decode, encode
from ark.core.pathmap import PathMapCache
from ark.core.protocol import ArkCore
from ark.core.topology import Fabric


@dataclass
class Cluster:
    fabric: Fabric
    policy: str = "ark"
    cores: list[ArkCore] = field(default_factory=list)
    pending: dict[int, list[Message]] = field(default_factory=dict)
    sent: list[Message] = field(default_factory=list)
    flows: dict[int, list[FlowId]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        maps = PathMapCache(self.fabric)
        self.cores = [
            ArkCore(h, self.fabric, maps, policy=self.policy, seed=h) for h in range(self.fabric.n_hosts)
        ]
        self.pending = {h: [] for h in range(self.fabric.n_hosts)}
        self.flows = {h: [] for h in range(self.fabric.n_hosts)}

    def broadcast(self, src: int, msgs: tuple[Message, ...]) -> None:
        for m in msgs:
            m = decode(encode(m))  # every message crosses the wire format
            self.sent.append(m)
            for h in self.pending:
                if h != src:
                    self.pending[h].append(m)

    def request(self, src: int, dst: int, nbytes: int, now: float):
        dec = self.cores[src].request(dst, nbytes, now)
        self.flows[src].append(dec.flow)
        self.broadcast(src, dec.messages)
        return dec

    def release(self, src: int, flow: FlowId, now: float) -> None:
        self.flows[src].remove(flow)
        self.broadcast(src, self.cores[src].release(flow, now).messages)

    def deliver_one(self, host: int, index: int, now: float) -> None:
        m = self.pending[host].pop(index)
        self.cores[host].receive(m, now, sender=m.flow[0])

    def deliver_all(self, rng: random.Random, now: float) -> None:
        for h in self.pending:
            rng.shuffle(self.pending[h])
            while self.pending[h]:
                self.deliver_one(h, len(self.pending[h]) - 1, now)

    def digests(self) -> set[str]:
        return {c.digest() for c in self.cores}
