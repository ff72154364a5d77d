"""What a run returns: one :class:`FlowResult` per KV flow and the run's :class:`SimResult`.

Shared by the event loop (:mod:`ark.sim.engine`), the state of a transfer in flight
(:mod:`ark.sim.transfer`) and the control planes, which is why it stands alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["FlowResult", "SimResult"]


@dataclass
class FlowResult:
    id: int
    src: int
    dst: int
    nbytes: int
    start_s: float
    finish_s: float = math.nan
    path: int = -1
    port: int = -1
    reserved: bool = False
    fallback: bool = False
    repaths: int = 0

    @property
    def fct_s(self) -> float:
        return self.finish_s - self.start_s


@dataclass
class SimResult:
    scheme: str
    flows: list[FlowResult]
    races: int
    fallbacks: int
    path_mismatches: int
    max_concurrent_per_spine: list[int]
    events: int
    spine_timeline: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    control_messages: int = 0
    # Messages each host sent (RESERVE, RELEASE, RENEW): what its peers receive under full
    # broadcast, or the peers of its scope (see ark.sim.control_cost).
    messages_by_host: list[int] = field(default_factory=list)
    race_moved: int = 0  # flows whose path a lost race changed
    moves: int = 0  # path changes a baseline balancer made
    rehashes: int = 0  # PLB re-hashes
    stale: int = 0  # ARK sub-flows a link failure moved off their reserved path before the maps were rebuilt
    rebuild_repathed: int = 0  # reservations re-made when the maps were rebuilt
    mismatches_after_rebuild: int = 0
    # One-way delays the control messages met (in-band control: with the data's queues).
    control_delay_mean_s: float = 0.0
    control_delay_max_s: float = 0.0
    # The control plane that ran: "broadcast" or "arbiter" (ARK schemes), "none" (the others);
    # under "arbiter", the request round trip host -> arbiter -> host.
    control: str = "none"
    arbiter_rtt_s: float = 0.0
