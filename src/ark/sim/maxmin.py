"""Max-min fair rates: progressive filling, from scratch or incrementally.

:func:`maxmin_rates` fills one set of flows from scratch. :class:`FairShares` keeps the
max-min allocation of a changing set of flows and, after arrivals and departures,
recomputes only the flows whose rate can change:

* Every flow keeps a *designated bottleneck* ``beta``: a saturated link on which no flow
  has a higher rate (it exists for every flow of a max-min allocation). Progressive
  filling designates the link that froze the flow; ties go to the lowest link id, which
  is the host's NIC when the NIC limits the flow.
* After a change, the recomputed set ``C`` starts from the new flows and the flows whose
  designated bottleneck a departed flow crossed, and is closed under "a flow of ``C``
  crosses the designated bottleneck of flow ``g``: ``g`` joins". Flows outside ``C`` keep
  their rates and count as fixed background on the links ``C`` shares with them.
* ``C`` is filled progressively against the residual capacities. If a background flow on
  the bottleneck of some ``C`` flow is faster than that flow, the background flow joins
  ``C`` and the filling is redone.

The result is the max-min allocation of all flows: every link stays within capacity
(``C`` fills residuals, the rest is unchanged), every ``C`` flow has a saturated link on
which nobody is faster (the check), and every other flow keeps its designated bottleneck,
whose flows and rates did not change (the closure). Connected components that a change
does not reach cost nothing, and inside a component the recomputation stops where the
rate changes stop (no "ripple" through links that are not bottlenecks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

_REL = 1e-9  # relative tolerance of the "nobody on my bottleneck is faster" check


def maxmin_rates(flow_links: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates by progressive filling.

    Repeatedly find the link whose remaining capacity per unfrozen flow is smallest,
    freeze its flows at that share and charge every link they cross.
    """
    n = len(flow_links)
    users: dict[int, list[int]] = {}
    for i, links in enumerate(flow_links):
        for lk in links:
            u = users.get(lk)
            if u is None:
                users[lk] = [i]
            else:
                u.append(i)
    rem = {lk: float(capacity[lk]) for lk in users}
    cnt = {lk: len(u) for lk, u in users.items()}
    rate = [0.0] * n
    frozen = [False] * n
    left = n
    while left:
        best_l, best_s = -1, math.inf
        for lk, c in cnt.items():
            s = rem[lk] / c
            if s < best_s:
                best_l, best_s = lk, s
        best_s = max(best_s, 0.0)
        for i in users[best_l]:
            if frozen[i]:
                continue
            frozen[i] = True
            rate[i] = best_s
            left -= 1
            for lk in flow_links[i]:
                rem[lk] -= best_s
                c = cnt[lk] - 1
                if c:
                    cnt[lk] = c
                else:
                    del cnt[lk]
    return rate


class FairShares:
    """The max-min allocation of a changing set of flows (see the module docstring).

    :meth:`add` and :meth:`remove` record changes; :meth:`update` brings the rates up to
    date and returns the flows whose rate changed. ``capacity`` may grow with
    :meth:`add_link` (virtual links such as the spray bundles).
    """

    def __init__(self, capacity: Sequence[float]) -> None:
        self.capacity: list[float] = [float(c) for c in capacity]
        self.users: list[dict[int, None]] = [{} for _ in self.capacity]  # insertion-ordered sets
        self.beta_of: list[dict[int, None]] = [{} for _ in self.capacity]
        self.links: dict[int, tuple[int, ...]] = {}
        self.rate: dict[int, float] = {}
        self.beta: dict[int, int] = {}
        self._added: dict[int, None] = {}
        self._freed: dict[int, None] = {}  # links a departed flow crossed
        self.recomputed = 0  # flows filled over all updates (the cost measure)

    def add_link(self, capacity: float) -> int:
        self.capacity.append(float(capacity))
        self.users.append({})
        self.beta_of.append({})
        return len(self.capacity) - 1

    def set_capacity(self, link: int, capacity: float) -> None:
        """Change a link's capacity (a failed or degraded link); every flow crossing it is
        recomputed at the next :meth:`update`, and the closure reaches the flows it frees
        or squeezes elsewhere."""
        self.capacity[link] = float(capacity)
        self._added.update(self.users[link])

    def add(self, flow: int, links: Iterable[int]) -> None:
        lks = tuple(links)
        self.links[flow] = lks
        self.rate[flow] = math.nan  # unequal to any rate: the first update reports it
        for lk in lks:
            self.users[lk][flow] = None
        self._added[flow] = None

    def remove(self, flow: int) -> None:
        lks = self.links.pop(flow)
        del self.rate[flow]
        for lk in lks:
            del self.users[lk][flow]
            self._freed[lk] = None
        b = self.beta.pop(flow, None)
        if b is not None:
            del self.beta_of[b][flow]
        self._added.pop(flow, None)

    def update(self) -> dict[int, float]:
        """Recompute what the recorded changes can affect; flow -> new rate, for those that changed."""
        seeds = dict(self._added)
        for lk in self._freed:
            seeds.update(self.beta_of[lk])
        self._added, self._freed = {}, {}
        if not seeds:
            return {}
        group = self._closure(seeds, seeds)
        while True:
            rates, beta = self._fill(group)
            faster = self._faster_background(group, rates, beta)
            if not faster:
                break
            group = self._closure(group, faster)
        self.recomputed += len(group)
        return self._commit(rates, beta)

    def _closure(self, group: dict[int, None], new: dict[int, None]) -> dict[int, None]:
        """``group`` plus ``new``, closed under "crosses the designated bottleneck of"."""
        group = dict(group)
        group.update(new)
        frontier = list(new)
        links, beta_of = self.links, self.beta_of
        seen: set[int] = set()
        while frontier:
            f = frontier.pop()
            for lk in links[f]:
                if lk in seen:
                    continue
                seen.add(lk)
                for g in beta_of[lk]:
                    if g not in group:
                        group[g] = None
                        frontier.append(g)
        return group

    def _fill(self, group: dict[int, None]) -> tuple[dict[int, float], dict[int, int]]:
        """Progressive filling of ``group`` against residual capacities (heap of link shares)."""
        links, users, rate = self.links, self.users, self.rate
        rem: dict[int, float] = {}
        cnt: dict[int, int] = {}
        for f in group:
            for lk in links[f]:
                if lk in cnt:
                    cnt[lk] += 1
                    continue
                cnt[lk] = 1
                r = self.capacity[lk]
                for g in users[lk]:
                    if g not in group:
                        r -= rate[g]
                rem[lk] = r
        heap = [(rem[lk] / c, lk, c) for lk, c in cnt.items()]
        heapq.heapify(heap)
        out: dict[int, float] = {}
        beta: dict[int, int] = {}
        while heap:
            share, lk, c = heapq.heappop(heap)
            if cnt.get(lk) != c:
                continue  # stale: the link's count changed since this entry was pushed
            share = max(share, 0.0)
            touched: dict[int, None] = {}
            for f in users[lk]:
                if f not in group or f in out:
                    continue
                out[f] = share
                beta[f] = lk
                for l2 in links[f]:
                    rem[l2] -= share
                    cnt[l2] -= 1
                    touched[l2] = None
            cnt[lk] = 0
            for l2 in touched:
                c2 = cnt[l2]
                if c2:
                    heapq.heappush(heap, (rem[l2] / c2, l2, c2))
        return out, beta

    def _faster_background(self, group: dict[int, None], rates: dict[int, float],
                           beta: dict[int, int]) -> dict[int, None]:
        """Flows outside ``group`` faster than a ``group`` flow on that flow's bottleneck."""
        faster: dict[int, None] = {}
        users, rate = self.users, self.rate
        share: dict[int, float] = {}  # the flows a link froze all got its share then
        for f, lk in beta.items():
            share[lk] = rates[f]
        for lk, s in share.items():
            limit = s * (1 + _REL) + 1e-12
            for g in users[lk]:
                if g not in group and rate[g] > limit:
                    faster[g] = None
        return faster

    def _commit(self, rates: dict[int, float], beta: dict[int, int]) -> dict[int, float]:
        changed: dict[int, float] = {}
        for f, r in rates.items():
            old_b = self.beta.get(f)
            b = beta[f]
            if old_b != b:
                if old_b is not None:
                    del self.beta_of[old_b][f]
                self.beta_of[b][f] = None
                self.beta[f] = b
            if r != self.rate[f]:
                self.rate[f] = r
                changed[f] = r
        return changed
