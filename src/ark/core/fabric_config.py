"""The ``[fabric]`` table shared by experiment and cluster files.

It describes a fabric (a preset, or its dimensions), its switches' hash and the
transport whose goodput its links carry; :meth:`FabricConfig.build` turns it into a
:class:`~ark.core.topology.Fabric`. Ranges and registry names are checked by the
builders (:func:`~ark.core.topology.spine_leaf`, :func:`~ark.core.clos.clos3`), so they
have one home.

Two shapes:

* 2-tier spine-leaf: ``leaves``, ``spines``, ``gpus_per_leaf``, ``link_gbps``, ``nic_gbps``;
* 3-tier Clos: ``pods``, ``leaves_per_pod``, ``aggs_per_pod``, ``cores_per_plane``,
  ``gpus_per_leaf``, ``nic_gbps`` and ``oversubscription = [leaf tier, aggregation tier]``
  (link rates follow from it); ``agg_hash``, ``agg_seed``, ``agg_selection`` give the
  aggregation tier another hash than the leaves.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ark.core.clos import CLOS_PRESETS, clos3
from ark.core.schema import Positive, accepted, one_of
from ark.core.topology import PRESETS, Fabric, TopologyError, preset_names, spine_leaf

_DIMENSIONS = ("leaves", "spines", "gpus_per_leaf", "link_gbps", "nic_gbps")
_CLOS_DIMENSIONS = ("pods", "leaves_per_pod", "aggs_per_pod", "cores_per_plane", "oversubscription")
_AGG_HASHING = ("agg_hash", "agg_seed", "agg_selection")
_DEFAULT_DIMENSIONS: dict[str, Any] = dict(leaves=2, spines=4, gpus_per_leaf=8, link_gbps=100.0, nic_gbps=100.0)


class FabricConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A preset, or dimensions (those not given default to the paper's); not both.

    With neither, the fabric is the ``paper`` preset.
    """

    preset: Annotated[str, accepted(preset_names())] | None = None
    leaves: int | None = None
    spines: int | None = None
    gpus_per_leaf: int | None = None
    link_gbps: Positive | None = None
    nic_gbps: Positive | None = None
    pods: int | None = None
    leaves_per_pod: int | None = None
    aggs_per_pod: int | None = None
    cores_per_plane: int | None = None
    oversubscription: tuple[Positive, Positive] | None = None
    hash: str = "murmur3-hpcc"
    seed: int | None = None
    selection: str = "modulo"
    agg_hash: str | None = None
    agg_seed: int | None = None
    agg_selection: str | None = None
    transport: str = "rocev2-4096"
    prefill_leaves: tuple[int, ...] | None = None
    decode_leaves: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.preset is not None:
            one_of("preset", self.preset, preset_names())
            if self._dimensions() or self._clos_dimensions():
                raise ValueError("preset: give either a preset or leaves/spines/... , not both")
        if self._clos_dimensions() and (self.leaves is not None or self.spines is not None or self.link_gbps is not None):
            raise ValueError("pods: a 3-tier fabric takes pods/leaves_per_pod/aggs_per_pod/cores_per_plane/"
                             "oversubscription, not leaves/spines/link_gbps")
        if not self.three_tier and any(getattr(self, k) is not None for k in _AGG_HASHING):
            raise ValueError("agg_hash: only a 3-tier fabric (pods = ...) has an aggregation tier")
        try:
            self.build()
        except TopologyError as e:  # "fabric.spines: ..." -> "spines: ..." under the table's path
            raise ValueError(str(e).removeprefix("fabric.")) from None

    def _dimensions(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _DIMENSIONS if getattr(self, k) is not None}

    def _clos_dimensions(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _CLOS_DIMENSIONS if getattr(self, k) is not None}

    @property
    def three_tier(self) -> bool:
        return bool(self._clos_dimensions()) or self.preset in CLOS_PRESETS

    def build(self) -> Fabric:
        hashing: dict[str, Any] = dict(hash=self.hash, seed=self.seed, selection=self.selection,
                                       transport=self.transport, prefill_leaves=self.prefill_leaves,
                                       decode_leaves=self.decode_leaves)
        if self.three_tier:
            kw: dict[str, Any] = dict(CLOS_PRESETS[self.preset]) if self.preset else self._clos_dimensions()
            for k in ("gpus_per_leaf", "nic_gbps"):
                if getattr(self, k) is not None:
                    kw[k] = getattr(self, k)
            return clos3(**kw, **hashing, agg_hash=self.agg_hash, agg_seed=self.agg_seed,
                         agg_selection=self.agg_selection)
        dims = self._dimensions()
        kw = {**_DEFAULT_DIMENSIONS, **dims} if dims else dict(PRESETS[self.preset or "paper"])
        return spine_leaf(**kw, **hashing)
