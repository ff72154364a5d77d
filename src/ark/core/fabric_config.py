"""The ``[fabric]`` table shared by experiment and cluster files.

It describes a fabric (a preset, or its dimensions), its switches' hash and the
transport whose goodput its links carry; :meth:`FabricConfig.build` turns it into a
:class:`~ark.core.topology.Fabric`. Ranges and registry names are checked by the
builders (:func:`~ark.core.topology.spine_leaf`, :func:`~ark.core.clos.clos3`), so they
have one home.

Two shapes:

* 2-tier spine-leaf: ``leaves``, ``spines``, ``gpus_per_leaf``, ``link_gbps``, ``nic_gbps``,
  or ``oversubscription = 2.0`` (a leaf's hosts' NIC rate over its uplinks' rate) instead of
  ``link_gbps``, which then follows from it;
* 3-tier Clos: ``pods``, ``leaves_per_pod``, ``aggs_per_pod``, ``cores_per_plane``,
  ``gpus_per_leaf``, ``nic_gbps`` and ``oversubscription = [leaf tier, aggregation tier]``
  (link rates follow from it); ``agg_hash``, ``agg_seed``, ``agg_selection`` give the
  aggregation tier another hash than the leaves.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ark.core.clos import CLOS_PRESETS, clos3
from ark.core.hashing import HASH_MODELS
from ark.core.schema import Positive, accepted, one_of
from ark.core.topology import (
    HASH_SELECTIONS,
    PRESETS,
    TRANSPORTS,
    Fabric,
    TopologyError,
    preset_names,
    spine_leaf,
)

_DIMENSIONS = ("leaves", "spines", "gpus_per_leaf", "link_gbps", "nic_gbps")
_CLOS_SHAPE = ("pods", "leaves_per_pod", "aggs_per_pod", "cores_per_plane")
_AGG_HASHING = ("agg_hash", "agg_seed", "agg_selection")
_DEFAULT_DIMENSIONS: dict[str, Any] = dict(leaves=2, spines=4, gpus_per_leaf=8, link_gbps=100.0, nic_gbps=100.0)


class FabricConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[fabric]`` table: a preset, or dimensions (those not given default to the paper's); not both.

    With neither, the fabric is the ``paper`` preset.

    Keys:
        preset: A named fabric (``paper``: 2 leaves x 4 spines x 8 GPUs at 100 Gbit/s; ``scale``:
            1,024 GPUs on 3 tiers; ``clos3-small``); give it or dimensions, not both.
        leaves: 2-tier: leaf (top-of-rack) switches (default 2).
        spines: 2-tier: spine switches, one equal-cost path per spine between two leaves (default 4).
        gpus_per_leaf: GPUs (hosts, one NIC each) under every leaf (default 8; 3-tier: 4).
        link_gbps: 2-tier: the rate of every leaf-spine link, Gbit/s (default 100; or give
            oversubscription instead).
        nic_gbps: The rate of every host's NIC and its leaf link, Gbit/s (default 100).
        pods: 3-tier: pods, each its leaves and aggregation switches.
        leaves_per_pod: 3-tier: leaves in every pod.
        aggs_per_pod: 3-tier: aggregation switches in every pod (one core plane per index).
        cores_per_plane: 3-tier: core switches per plane.
        oversubscription: Downlink over uplink capacity: on 2 tiers one number (a leaf's GPUs x
            NIC rate over its spines x link rate; the link rate follows from it), on 3 tiers
            [leaf tier, aggregation tier] (the link rates follow from it).
        hash: The switches' ECMP hash function over the 5-tuple.
        seed: The hash seed of every switch (default: each switch's node id, as in HPCC/AstraSim).
        selection: How a hash picks a next hop: ``modulo`` (hash mod paths) or ``threshold``
            (hash-threshold, as Linux).
        agg_hash: 3-tier: the aggregation tier's own hash (default: ``hash``).
        agg_seed: 3-tier: the aggregation tier's own seed (default: ``seed``).
        agg_selection: 3-tier: the aggregation tier's own selection (default: ``selection``).
        transport: What links carry; sets goodput as a share of line rate (``rocev2-4096``:
            98.0%, ``rocev2-1024``: 92.6%, ``tcp-1500``: 94.1%, ``ideal``: 100%).
        prefill_leaves: Leaves whose GPUs run prefill (default: the first half; 3-tier: the first
            half of every pod's).
        decode_leaves: Leaves whose GPUs run decode (default: the rest).
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
    # A number on 2 tiers, [leaf tier, aggregation tier] on 3 (a fixed-length tuple in a union
    # with a number crashes msgspec 0.23's decoder, so the length is checked below).
    oversubscription: Positive | tuple[Positive, ...] | None = None
    hash: Annotated[str, accepted(HASH_MODELS)] = "murmur3-hpcc"
    seed: int | None = None
    selection: Annotated[str, accepted(HASH_SELECTIONS)] = "modulo"
    agg_hash: Annotated[str, accepted(HASH_MODELS)] | None = None
    agg_seed: int | None = None
    agg_selection: Annotated[str, accepted(HASH_SELECTIONS)] | None = None
    transport: Annotated[str, accepted(TRANSPORTS)] = "rocev2-4096"
    prefill_leaves: tuple[int, ...] | None = None
    decode_leaves: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.preset is not None:
            one_of("preset", self.preset, preset_names())
            if self._dimensions() or self._clos_dimensions():
                raise ValueError("preset: give either a preset or leaves/spines/... , not both")
        self._check_oversubscription()
        if self._clos_dimensions() and (self.leaves is not None or self.spines is not None or self.link_gbps is not None):
            raise ValueError("pods: a 3-tier fabric takes pods/leaves_per_pod/aggs_per_pod/cores_per_plane/"
                             "oversubscription, not leaves/spines/link_gbps")
        if not self.three_tier and any(getattr(self, k) is not None for k in _AGG_HASHING):
            raise ValueError("agg_hash: only a 3-tier fabric (pods = ...) has an aggregation tier")
        try:
            self.build()
        except TopologyError as e:  # "fabric.spines: ..." -> "spines: ..." under the table's path
            raise ValueError(str(e).removeprefix("fabric.")) from None

    def _check_oversubscription(self) -> None:
        over = self.oversubscription
        two_tier = any(getattr(self, k) is not None for k in ("leaves", "spines", "link_gbps"))
        shape = any(getattr(self, k) is not None for k in _CLOS_SHAPE)
        if isinstance(over, tuple):
            if two_tier and not shape:
                raise ValueError(f"oversubscription: a 2-tier fabric (leaves, spines) has one oversubscribed tier: "
                                 f"give one number, e.g. oversubscription = {over[0]:g}; [leaf tier, aggregation "
                                 "tier] is for a 3-tier fabric (pods = ...)")
            if len(over) != 2:
                raise ValueError(f"oversubscription: a 3-tier fabric takes [leaf tier, aggregation tier]; got "
                                 f"{list(over)}")
        elif over is not None:
            if shape:
                raise ValueError(f"oversubscription: a 3-tier fabric takes [leaf tier, aggregation tier], e.g. "
                                 f"[{over:g}, 1.0]; got {over:g}")
            if self.link_gbps is not None:
                raise ValueError("oversubscription: give link_gbps or oversubscription, not both (the link rate "
                                 "follows from the oversubscription)")

    def _dimensions(self) -> dict[str, Any]:
        """The 2-tier dimensions given (a number for oversubscription is one of them)."""
        dims = {k: getattr(self, k) for k in _DIMENSIONS if getattr(self, k) is not None}
        if self.oversubscription is not None and not isinstance(self.oversubscription, tuple):
            dims["oversubscription"] = self.oversubscription
        return dims

    def _clos_dimensions(self) -> dict[str, Any]:
        """The 3-tier dimensions given ([leaf, aggregation] oversubscription is one of them)."""
        dims = {k: getattr(self, k) for k in _CLOS_SHAPE if getattr(self, k) is not None}
        if isinstance(self.oversubscription, tuple):
            dims["oversubscription"] = self.oversubscription
        return dims

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
        over = kw.pop("oversubscription", None)
        if over is not None:  # hosts' NIC rate under a leaf over its uplinks' rate
            kw["link_gbps"] = kw["gpus_per_leaf"] * kw["nic_gbps"] / (max(1, kw["spines"]) * over)
        return spine_leaf(**kw, **hashing)
