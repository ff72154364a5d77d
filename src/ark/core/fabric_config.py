"""The ``[fabric]`` table shared by experiment and cluster files.

It describes a fabric (a preset, or its dimensions), its switches' hash and the
transport whose goodput its links carry; :meth:`FabricConfig.build` turns it into a
:class:`~ark.core.topology.Fabric`. Ranges and registry names are checked by the
builder (:func:`~ark.core.topology.spine_leaf`), so they have one home.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ark.core.schema import Positive, one_of
from ark.core.topology import PRESETS, Fabric, TopologyError, spine_leaf

_DIMENSIONS = ("leaves", "spines", "gpus_per_leaf", "link_gbps", "nic_gbps")
_DEFAULT_DIMENSIONS: dict[str, Any] = dict(leaves=2, spines=4, gpus_per_leaf=8, link_gbps=100.0, nic_gbps=100.0)


class FabricConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A preset, or dimensions (those not given default to the paper's); not both.

    With neither, the fabric is the ``paper`` preset.
    """

    preset: str | None = None
    leaves: int | None = None
    spines: int | None = None
    gpus_per_leaf: int | None = None
    link_gbps: Positive | None = None
    nic_gbps: Positive | None = None
    hash: str = "murmur3-hpcc"
    seed: int | None = None
    selection: str = "modulo"
    transport: str = "rocev2-4096"
    prefill_leaves: tuple[int, ...] | None = None
    decode_leaves: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.preset is not None:
            one_of("preset", self.preset, PRESETS)
            if self._dimensions():
                raise ValueError("preset: give either a preset or leaves/spines/... , not both")
        try:
            self.build()
        except TopologyError as e:  # "fabric.spines: ..." -> "spines: ..." under the table's path
            raise ValueError(str(e).removeprefix("fabric.")) from None

    def _dimensions(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _DIMENSIONS if getattr(self, k) is not None}

    def build(self) -> Fabric:
        dims = self._dimensions()
        kw: dict[str, Any] = {**_DEFAULT_DIMENSIONS, **dims} if dims else dict(PRESETS[self.preset or "paper"])
        return spine_leaf(
            **kw, hash=self.hash, seed=self.seed, selection=self.selection, transport=self.transport,
            prefill_leaves=self.prefill_leaves, decode_leaves=self.decode_leaves,
        )
