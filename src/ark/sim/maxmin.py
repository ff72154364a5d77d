"""Max-min fair rates by progressive filling: the fluid model's bandwidth sharing."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
