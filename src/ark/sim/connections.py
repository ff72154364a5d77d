"""The connection schemes: engines that keep a few connections per peer and reuse them.

NIXL over UCX, NCCL and Mooncake's RDMA transport open their connections (or QPs) to a
peer once and send every later transfer over them, so a per-transfer lease never reaches
them; what can be steered is each connection when it opens. Two schemes model this:

* ``ecmp-conn``: ``[params.conn] connections`` per (source, destination) pair on random
  source ports, hashed by the switches: what such an engine does today;
* ``ark-conn``: the same connections, each placed when it opens by
  :func:`ark.core.connections.place_connections`: one pair's connections on distinct
  paths, each on the path whose reservable links carry the fewest connections of the
  whole fabric, on a source port the switches hash onto it. A connection lease is shared,
  not exclusive, and lives as long as the connection; the simulator counts every host's
  leases at once, as the agents' tables would once the leases have spread (a connection
  lives far longer than the control plane's delay).

A transfer is striped over its pair's connections: one sub-flow per connection, each with
its own max-min rate, all finishing together (as under the split schemes). Transfers of
one pair at the same time share its connections. A pair whose connections have carried
nothing for ``[params.conn] idle_s`` closes them: an idle connection gives its path back
and is placed again, against the load of that moment, at its pair's next transfer. After
a link failure the switches re-hash a connection's port like any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ark.core.connections import place_connections
from ark.core.protocol import PathMaps
from ark.core.topology import Fabric

CONN_SCHEMES = ("ark-conn", "ecmp-conn")


class _Pair:
    """One peer pair's open connections: their source ports and the links each holds."""

    __slots__ = ("busy", "held", "last", "ports")

    def __init__(self, ports: list[int], held: list[tuple[int, ...]]) -> None:
        self.ports, self.held = ports, held
        self.busy = 0  # transfers sending over them now
        self.last = 0.0  # when the last of them ended


class Connections:
    """The open connections of every peer pair of one run."""

    def __init__(
        self, fabric: Fabric, scheme: str, pathmaps: PathMaps, dport: int, *, per_pair: int, idle_s: float,
        random_port: Callable[[], int],
    ) -> None:
        if scheme not in CONN_SCHEMES:
            raise ValueError(f"scheme: must be one of {', '.join(CONN_SCHEMES)}; got {scheme!r}")
        self.fabric, self.placed = fabric, scheme == "ark-conn"
        self.pathmaps, self.dport = pathmaps, dport
        self.per_pair, self.idle_s = per_pair, idle_s
        self._random_port = random_port
        self._pairs: dict[tuple[int, int], _Pair] = {}
        self._idle: OrderedDict[tuple[int, int], None] = OrderedDict()  # pairs with nothing sending, oldest first
        self._load: dict[int, int] = {}  # reservable link -> placed connections crossing it
        self.opened = self.closed = 0

    def take(self, src: int, dst: int, now: float) -> list[int]:
        """The source ports of the connections a new transfer from ``src`` to ``dst`` uses."""
        self._close_idle(now)
        key = (src, dst)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = self._open(src, dst)
        self._idle.pop(key, None)
        pair.busy += 1
        return pair.ports

    def release(self, src: int, dst: int, now: float) -> None:
        """A transfer of the pair is done."""
        key = (src, dst)
        pair = self._pairs[key]
        pair.busy -= 1
        if pair.busy == 0:
            pair.last = now
            self._idle[key] = None

    def load(self) -> dict[int, int]:
        """Placed connections per reservable link now (``ark-conn``; empty under ``ecmp-conn``)."""
        return {lk: c for lk, c in self._load.items() if c}

    def _open(self, src: int, dst: int) -> _Pair:
        self.opened += self.per_pair
        if not self.placed:
            return _Pair([self._random_port() for _ in range(self.per_pair)], [])
        stages = self.fabric.stages(src, dst)
        pm = self.pathmaps(src, dst, self.dport)
        reachable = [k for k in range(self.fabric.n_paths(src, dst)) if pm.ports_of(k, need=1)]
        if not reachable:  # no port reaches any path (a map gone wrong): the engine's own ports
            return _Pair([self._random_port() for _ in range(self.per_pair)], [])
        paths = [tuple(st[k] for st in stages) for k in reachable]
        picks = place_connections(paths, self._load, self.per_pair)
        held = [paths[i] for i in picks]
        for links in held:
            for lk in links:
                self._load[lk] = self._load.get(lk, 0) + 1
        # The r-th connection on a path takes the path's r-th port: distinct source ports.
        ports, seen = [], dict.fromkeys(picks, 0)
        for i in picks:
            options = pm.ports_of(reachable[i], need=seen[i] + 1)
            ports.append(options[seen[i] % len(options)])
            seen[i] += 1
        return _Pair(ports, held)

    def _close_idle(self, now: float) -> None:
        idle, pairs = self._idle, self._pairs
        while idle:
            key = next(iter(idle))
            pair = pairs[key]
            if now - pair.last < self.idle_s:
                return
            del idle[key], pairs[key]
            self.closed += len(pair.ports)
            for links in pair.held:
                for lk in links:
                    self._load[lk] -= 1
