"""Where a long-lived connection goes: the placement rule of connection-level leases.

Engines that keep a few connections (or QPs) per peer and reuse them for every transfer
(NIXL over UCX, NCCL, Mooncake's RDMA transport) cannot be steered per transfer: their
source port is fixed when the connection opens. They can be steered per connection:
when a connection opens, ARK chooses its path, and the lease lasts as long as the
connection. Such leases are shared, not exclusive: many connections may cross a link,
and the rule spreads them.

The rule, for ``k`` new connections of one peer pair: take the path whose reservable
links carry the fewest connections (the most loaded of its links first, then the sum
over its links, then the lowest path index), count the new connection on it, and repeat;
a path already given to one of the ``k`` is taken again only when every path of the
pair has one (a pair with fewer paths than connections cycles over them). One pair's
connections therefore sit on distinct paths, and the fabric's connections stay balanced
across the links that every host's leases count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ark.core.table import CoreError

MAX_CONNECTIONS = 64  # per peer pair


def place_connections(paths: Sequence[Sequence[int]], load: Mapping[int, int], k: int) -> list[int]:
    """Path indices for ``k`` new connections of one pair.

    ``paths[i]`` lists the reservable links of the pair's path ``i`` (an empty tuple for a
    pair within one leaf, which has one path); ``load[link]`` counts the connections that
    cross ``link`` now (missing links count 0). ``load`` is not changed: the caller
    counts the connections it opens.
    """
    if not 1 <= k <= MAX_CONNECTIONS:
        raise CoreError(f"connections: must be 1..{MAX_CONNECTIONS}; got {k}")
    if not paths:
        raise CoreError("paths: a pair has at least one path")
    added: dict[int, int] = {}
    chosen: list[int] = []
    n = len(paths)
    for _ in range(k):
        used = set(chosen[len(chosen) - len(chosen) % n:])  # this round's: distinct until every path has one
        fresh = [i for i in range(n) if i not in used]

        def cost(i: int) -> tuple[int, int, int]:
            counts = [load.get(lk, 0) + added.get(lk, 0) for lk in paths[i]]
            return (max(counts, default=0), sum(counts), i)

        best = min(fresh, key=cost)
        chosen.append(best)
        for lk in paths[best]:
            added[lk] = added.get(lk, 0) + 1
    return chosen
