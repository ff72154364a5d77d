"""The simulator's state of one KV transfer in flight: its sub-flows and its chunks.

A :class:`Transfer` is one KV flow (one :class:`~ark.core.flows.FlowSpec`). It sends over
one or more :class:`SubFlow` s, each a fluid flow on one path with its own max-min rate;
the transfer's bytes drain at the sum of their rates, so its sub-flows all finish
together (an engine that hands each connection its next slice when that connection has
room). Single-path schemes have one sub-flow.

A transfer may be sent in chunks (one per model layer: ``[serving] kv_transfer``, :class:`ark.sim.config.ServingConfig`): after a
chunk the transfer is idle for the inter-chunk gap, holds no bandwidth, and keeps its
sub-flows, paths and reservations for the next chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ark.core.messages import FlowId
    from ark.sim.results import FlowResult

MAX_PARTS = 64  # sub-flows per transfer (their ids are spaced this far apart)


def sub_id(flow: int, k: int) -> int:
    """The fair-share id of sub-flow ``k`` of transfer ``flow``: the flow id itself for the
    first, distinct negative ids for the others."""
    return flow if k == 0 else -(flow * MAX_PARTS + k)


class SubFlow:
    """One path of a transfer: links crossed, top-tier switches counted, port, rate."""

    __slots__ = ("core_flow", "links", "path", "port", "rate", "sid", "spines")

    def __init__(self, sid: int, path: int, port: int, links: tuple[int, ...], spines: tuple[int, ...]) -> None:
        self.sid = sid
        self.path, self.port = path, port
        self.links, self.spines = links, spines
        self.rate = 0.0
        self.core_flow: FlowId | None = None


class Transfer:
    """One KV flow in flight (or idle between two chunks)."""

    __slots__ = ("chunk_bytes", "chunks_left", "lb", "rate", "remaining", "res", "spines", "subs", "t_upd", "version")

    def __init__(self, res: FlowResult, subs: list[SubFlow], chunks: int = 1) -> None:
        self.res = res
        self.subs = subs
        self.chunk_bytes = float(res.nbytes) / chunks
        self.chunks_left = chunks - 1
        self.remaining = self.chunk_bytes  # bytes of the current chunk left at t_upd
        self.t_upd = res.start_s
        self.rate = 0.0  # sum of the sub-flows' rates
        self.version = 0  # bumps at every rate change: older completion entries are stale
        self.spines = top_switches(subs)
        self.lb: Any = None  # the scheme's own per-flow state (ark.sim.balancers)

    @property
    def id(self) -> int:
        return self.res.id

    def left(self, now: float) -> float:
        """Bytes still to send at ``now``: the current chunk's and every later chunk's."""
        return max(0.0, self.remaining - self.rate * (now - self.t_upd)) + self.chunks_left * self.chunk_bytes


def top_switches(subs: list[SubFlow]) -> tuple[int, ...]:
    """The top-tier switches a transfer counts on: each once, whatever its sub-flows."""
    if len(subs) == 1:
        return subs[0].spines
    return tuple(sorted({k for s in subs for k in s.spines}))
