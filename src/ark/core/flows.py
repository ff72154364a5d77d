"""The description of one KV flow, shared by the simulator and the testbed."""

from __future__ import annotations

import msgspec


class FlowSpec(msgspec.Struct, frozen=True):
    """KV cache of ``nbytes`` from host ``src`` to host ``dst`` (fabric indices), starting at
    ``start_s`` (seconds from the run's origin)."""

    id: int
    src: int
    dst: int
    nbytes: int
    start_s: float
