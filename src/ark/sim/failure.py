"""A leaf-spine link that fails, or drops to a fraction of its rate, during a run.

:class:`LinkChange` is the ``[failure]`` table of an experiment file (and ``--fail-link
L:S@T[:FRACTION]``). At ``at_s`` both directions of the link between leaf ``L`` and
spine ``S`` change:

* **down** (``fraction`` 0): routing converges at once, as the testbed's ``converge``
  does: a leaf reaches another leaf over every spine both still connect to, so every
  ECMP group towards or from leaf ``L`` shrinks by spine ``S`` and the hash spreads
  ports over the spines left (:class:`FailedRoutes`): most ports of those pairs move.
  ARK's hosts notice ``detect_s`` later (the agent's periodic probe check), rebuild
  their path maps (:meth:`FailedRoutes.pathmap`: spine ``S`` has no port) and re-path
  the live reservations whose port now leads elsewhere, as ``Node.reload_pathmaps``
  does on the testbed;
* **degraded** (0 < ``fraction`` < 1): the link stays up at that fraction of its rate;
  no group changes, nothing is re-hashed, and no host is told.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
import numpy as np

from ark.core.hashing import hash_model, select, select_many
from ark.core.pathmap import PathMap, PortMap, pathmap_from_paths
from ark.core.protocol import PathMaps
from ark.core.schema import NonNegative, Positive
from ark.core.topology import Fabric

_SPEC = re.compile(r"^(\d+):(\d+)@([0-9.eE+-]+)(?::([0-9.eE+-]+))?$")
Fraction = Annotated[float, msgspec.Meta(ge=0, lt=1)]


class FailureError(ValueError):
    """A link change that cannot apply to the fabric."""


class LinkChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[failure]`` table: one leaf-spine link changes at ``at_s``.

    Keys:
        leaf: The link's leaf (0..leaves-1).
        spine: The link's spine (0..spines-1).
        at_s: When it changes, s after the run starts.
        fraction: 0: the link fails; else its rate drops to this fraction.
        detect_s: ARK hosts rebuild their path maps this long after a failure, s.
        window_s: Flows that start within this of ``at_s`` count as "during" the change, s.
    """

    leaf: Annotated[int, msgspec.Meta(ge=0)] = 0
    spine: Annotated[int, msgspec.Meta(ge=0)] = 0
    at_s: NonNegative = 20.0
    fraction: Fraction = 0.0  # 0: the link fails; else its rate drops to this fraction
    detect_s: NonNegative = 0.5  # ARK hosts rebuild their maps this long after a failure
    window_s: Positive = 1.0  # flows starting within this of at_s count as "during"

    @property
    def down(self) -> bool:
        return self.fraction == 0.0

    def links(self, fabric: Fabric) -> tuple[int, int]:
        """The link's two directions: leaf -> spine, spine -> leaf."""
        return fabric.uplink(self.leaf, self.spine), fabric.downlink(self.spine, self.leaf)

    def check(self, fabric: Fabric) -> None:
        """Refuse a change the fabric cannot have."""
        if fabric.tiers != 2:
            raise FailureError("failure: a link change needs a 2-tier spine-leaf fabric")
        if self.leaf >= fabric.n_leaves:
            raise FailureError(f"failure.leaf: must be 0..{fabric.n_leaves - 1}; got {self.leaf}")
        if self.spine >= fabric.n_spines:
            raise FailureError(f"failure.spine: must be 0..{fabric.n_spines - 1}; got {self.spine}")
        if self.down and fabric.n_spines < 2:
            raise FailureError("failure: with one spine a failed link disconnects its leaf")

    def label(self) -> str:
        what = "down" if self.down else f"at {self.fraction:g} of its rate"
        return f"leaf{self.leaf}-spine{self.spine} {what} at {self.at_s:g} s"


def parse_link_change(text: str) -> dict[str, float | int]:
    """``L:S@T[:FRACTION]`` as the fields of a ``[failure]`` table."""
    m = _SPEC.match(text.strip())
    if m is None:
        raise FailureError(f"--fail-link: expected LEAF:SPINE@SECONDS[:FRACTION], e.g. 0:2@20 or 0:2@20:0.25; got {text!r}")
    try:
        # Every field, so that a [failure] table in the config file cannot leave its own
        # fraction under a link the command line says is down.
        d: dict[str, float | int] = {"leaf": int(m.group(1)), "spine": int(m.group(2)), "at_s": float(m.group(3)),
                                     "fraction": 0.0 if m.group(4) is None else float(m.group(4))}
    except ValueError:
        raise FailureError(f"--fail-link: not a number in {text!r}") from None
    return d


class FailedRoutes:
    """Where the switches send each packet once a leaf-spine link is down (2-tier)."""

    def __init__(self, fabric: Fabric, change: LinkChange) -> None:
        change.check(fabric)
        self.fabric, self.change = fabric, change
        self._alive = tuple(k for k in range(fabric.n_spines) if k != change.spine)

    def group(self, src: int, dst: int) -> tuple[int, ...]:
        """The spines the source leaf's ECMP group holds towards ``dst``, in order."""
        fab = self.fabric
        a, b = fab.leaf_of(src), fab.leaf_of(dst)
        if a == b:
            return (0,)  # within a leaf: one path, no spine
        if self.change.leaf in (a, b):
            return self._alive
        return tuple(range(fab.n_spines))

    def switch_path(self, src: int, dst: int, sport: int, dport: int, proto: int = 17) -> int:
        """The spine the source leaf's hash picks among the group's members."""
        fab = self.fabric
        if fab.n_paths(src, dst) == 1:
            return 0
        group = self.group(src, dst)
        sw = fab.source_switch(src)
        model = hash_model(sw.hash)
        h = model.hash_one(sw.seed, fab.hosts[src].ip_int, fab.hosts[dst].ip_int, sport, dport, proto)
        return group[select(h, len(group), sw.selection, model.bits)]

    def pathmap(self, src: int, dst: int, dport: int, port_range: tuple[int, int], proto: int = 17) -> PathMap:
        """The map a host rebuilds: every port on the spine the shrunk group sends it to;
        the dead spine's bucket is empty, so no reservation can take it."""
        fab = self.fabric
        sw = fab.source_switch(src)
        model = hash_model(sw.hash)
        lo, hi = port_range
        ports = np.arange(lo, hi + 1, dtype=np.int64)
        group = np.asarray(self.group(src, dst), dtype=np.int64)
        s_ip, d_ip = fab.hosts[src].ip_int, fab.hosts[dst].ip_int
        member = select_many(model.hash_ports(sw.seed, s_ip, d_ip, dport, ports, proto), len(group),
                             sw.selection, model.bits)
        path = group[member] if fab.n_paths(src, dst) > 1 else np.zeros(len(ports), dtype=np.int64)
        return pathmap_from_paths(sw.hash, sw.seed, sw.selection, s_ip, d_ip, dport, ports, path,
                                  fab.n_paths(src, dst), proto)


class RebuiltMaps:
    """The maps ARK's cores read: the fabric's until :meth:`rebuild`, the failed fabric's after."""

    def __init__(self, healthy: PathMaps, routes: FailedRoutes, port_range: tuple[int, int]) -> None:
        self._healthy = healthy
        self._routes, self._range = routes, port_range
        self._failed: dict[tuple[int, int, int], PortMap] = {}
        self.rebuilt = False

    def rebuild(self) -> None:
        self.rebuilt = True

    def __call__(self, src: int, dst: int, dport: int) -> PortMap:
        if not self.rebuilt:
            return self._healthy(src, dst, dport)
        key = (src, dst, dport)
        m = self._failed.get(key)
        if m is None:
            m = self._failed[key] = self._routes.pathmap(src, dst, dport, self._range)
        return m
