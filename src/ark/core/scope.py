"""Scoped dissemination: which hosts need to hear which reservations.

A reservation's assignment depends only on reservations that share a link with one of
its candidate paths, and theirs on those sharing links with theirs, and so on. Given the
pairs of hosts that send to each other (the traffic a cluster declares), the links the
pairs can use fall into connected components; a reservation lives entirely inside one.
A host that sends needs exactly the reservations of its component to make the decisions
full broadcast would make; a host that never sends needs none. So every host talks only
to the senders of its own component, and a request whose links leave the component is
not reserved (plain ECMP), since its reservation could touch what nobody there hears.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ark.core.protocol import Routes


def pair_links(routes: Routes, src: int, dst: int) -> frozenset[int]:
    """Every reservable link a reservation from ``src`` to ``dst`` could hold, on any path."""
    return frozenset(lk for stage in routes.stages(src, dst) for lk in stage)


@dataclass(frozen=True)
class Scope:
    """Components of the declared traffic: for each sending host, its peers and its links."""

    peers_of: dict[int, frozenset[int]]  # sending host -> the other senders of its component
    links_of: dict[int, frozenset[int]]  # sending host -> every link its component's pairs use

    def peers(self, host: int) -> frozenset[int]:
        return self.peers_of.get(host, frozenset())

    def links(self, host: int) -> frozenset[int]:
        return self.links_of.get(host, frozenset())

    def sends(self, host: int) -> bool:
        return host in self.peers_of

    def components(self) -> list[frozenset[int]]:
        seen: set[int] = set()
        out = []
        for h, peers in sorted(self.peers_of.items()):
            if h not in seen:
                seen |= peers | {h}
                out.append(frozenset(peers | {h}))
        return out


def scope_of(routes: Routes, pairs: Iterable[tuple[int, int]]) -> Scope:
    """Union-find over links: two pairs are in one component when their links meet."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    senders: dict[int, set[int]] = {}  # sender -> links of its own pairs
    for src, dst in pairs:
        links = pair_links(routes, src, dst)
        senders.setdefault(src, set()).update(links)
        first = next(iter(links), None)
        for lk in links:
            if first is not None:
                parent[find(lk)] = find(first)
    groups: dict[int, set[int]] = {}
    for h, own in senders.items():  # a sender with no reservable link is a component of its own
        groups.setdefault(find(next(iter(own))) if own else -1 - h, set()).add(h)
    peers_of: dict[int, frozenset[int]] = {}
    links_of: dict[int, frozenset[int]] = {}
    for members in groups.values():
        comp_links = frozenset(lk for h in members for lk in senders[h])
        for h in members:
            peers_of[h] = frozenset(members - {h})
            links_of[h] = comp_links
    return Scope(peers_of, links_of)
