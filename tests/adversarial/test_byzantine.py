"""A listed peer that lies, driven through the sans-IO node: frozen-assignment claims and
replayed signed messages must never move, erase or revive a reservation on honest hosts.

The liar runs a correct node for its own flows; what it sends is rewritten on the way out
(claims added to its sync replies, captured messages relayed). The invariant checked on
every honest host: no link held by two flows of which one claims it alone, every honest
replica holds the same table, and each honest owner's reserved flows sit where it thinks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ark.core.envelope import K_DATA, K_HELLO, decode_envelope, encode_envelope
from ark.core.lease import LeasePolicy
from ark.core.messages import Reserve, decode
from ark.core.node import Node, Publish
from ark.core.pathmap import PathMapCache
from ark.core.topology import preset
from tests.liars import add_to_sync_reply, shift_clock, sign, verify

FAB = preset("paper")  # leaf 0: hosts 0-7, leaf 1: hosts 8-15; 4 spines
MAPS = PathMapCache(FAB)
HOSTS = [0, 1, 2, 8, 9]
LIAR = 2

Rewrite = Callable[[int, int, bytes], bytes]  # (src, dst, envelope) -> envelope


class ByzNet:
    """Instant delivery between real nodes; the liar's envelopes pass through ``rewrite``."""

    def __init__(self, retention_s: float = 5.0, hosts: list[int] = HOSTS) -> None:
        self.hosts, self.retention_s = hosts, retention_s
        self.inc = dict.fromkeys(hosts, 1)
        self.nodes = {h: self._node(h) for h in hosts}
        self.rewrite: Rewrite = lambda s, d, data: data
        self.down: set[int] = set()
        self.seen: list[tuple[int, bytes]] = []  # every DATA envelope the liar received

    def _node(self, h: int) -> Node:
        return Node(h, FAB, MAPS, [p for p in self.hosts if p != h], incarnation=self.inc[h],
                    lease=LeasePolicy(min_s=1.0, slack=2.0, max_s=600.0), retention_s=self.retention_s,
                    heartbeat_s=0.2, peer_timeout_s=1.0, sync_timeout_s=0.5, expiry_grace_s=0.05,
                    signer=lambda raw: sign(h, raw), verifier=verify)

    def emit(self, src: int, outs, now: float) -> None:
        queue = [(src, o) for o in outs]
        while queue:
            s, o = queue.pop(0)
            for d in [h for h in self.nodes if h != s] if isinstance(o, Publish) else [o.peer]:
                if d in self.down:
                    continue
                data = self.rewrite(s, d, o.data) if s == LIAR else o.data
                if d == LIAR and decode_envelope(data).kind == K_DATA:
                    self.seen.append((s, data))
                queue.extend((d, r) for r in self.nodes[d].on_message(s, data, now))
        for n in self.nodes.values():
            n.flush()

    def start(self, now: float = 0.0) -> None:
        for h, n in self.nodes.items():
            self.emit(h, n.start(now), now)
        self.run(now, now + 0.6)

    def run(self, t0: float, t1: float, step: float = 0.05) -> None:
        t = t0
        while t <= t1:
            for h, n in self.nodes.items():
                if h not in self.down:
                    self.emit(h, n.tick(t), t)
            t += step

    def renewing(self, flows: list[tuple[int, tuple[int, int]]], t0: float, t1: float) -> float:
        """Owners renew ``flows`` ((host, flow)) every 0.5 s while time runs from t0 to t1;
        returns the time reached."""
        t = t0
        while t < t1:
            for h, f in flows:
                self.emit(h, self.nodes[h].renew(f, t)[1], t)
            self.run(t, t + 0.45)
            t += 0.5
        return t

    def restart(self, h: int, now: float) -> Node:
        self.inc[h] += 1
        node = self.nodes[h] = self._node(h)
        self.emit(h, node.start(now), now)
        return node

    def check_honest(self, at: float) -> None:
        honest = [n for h, n in self.nodes.items() if h != LIAR and h not in self.down]
        for n in honest:
            assert not n.core.exclusive_conflicts(at=at), f"host {n.host} has a link with two holders"
        assert len({n.core.digest(at=at) for n in honest}) == 1, {n.host: n.core.table(at=at) for n in honest}
        for n in honest:
            for f, (_dst, path, _port, reserved) in n.core.local_flows().items():
                if reserved:
                    assert all(m.core.table(at=at).get(f, (None,))[0] == path for m in honest), f


def claims(extra: list[list[int | bool]]) -> Rewrite:
    """Add frozen-assignment claims to every sync reply the liar sends."""
    return lambda src, dst, data: add_to_sync_reply(data, claims=extra)


@pytest.mark.parametrize("claimed_path", [-1, 1, 3])
def test_a_claim_about_another_hosts_live_flow_moves_nothing(claimed_path: int) -> None:
    net = ByzNet()
    net.start()
    lease, outs = net.nodes[0].reserve(8, 10**10, 1.0)
    net.emit(0, outs, 1.0)
    assert lease.reserved and lease.path == 0
    net.rewrite = claims([[0, lease.flow_id[1], claimed_path, False]])
    joiner = net.restart(1, 1.2)
    net.run(1.2, 2.0)
    assert joiner.ready and joiner.core.table(at=2.0)[lease.flow_id][0] == 0
    assert joiner.counters.frozen_conflicts >= 1 and joiner.alerts
    mine, outs = joiner.reserve(9, 10**10, 2.0)  # a leaf-mate of the victim, same spines
    net.emit(1, outs, 2.0)
    assert mine.reserved and mine.path != lease.path
    net.check_honest(2.0)


def test_a_claim_about_the_receivers_own_flow_moves_nothing() -> None:
    net = ByzNet()
    net.start()
    lease, outs = net.nodes[1].reserve(9, 10**10, 1.0)
    net.emit(1, outs, 1.0)
    net.rewrite = claims([[1, lease.flow_id[1], 2, False]] * 300)
    net.restart(LIAR, 1.2)  # a new incarnation: every host asks it for a snapshot
    net.run(1.2, 2.0)
    assert net.nodes[1].lease_of(lease.flow_id).path == lease.path
    # Every claim counted, one alert for the reply part that carried them (no log flood).
    me = net.nodes[1]
    assert me.counters.frozen_conflicts >= 300 and len(me.alerts) == 1 and me.alerts[0]["count"] >= 300
    net.check_honest(2.0)


def _frozen_pair(net: ByzNet) -> tuple[tuple[int, int], int]:
    """Flows A (0 -> 8) and B (1 -> 9) both ask for spine 0 at 1.0 s; A wins the race and
    B is moved to spine 1. A ends at 2.0 s; once it is forgotten, B is frozen on spine 1 on
    every replica, while a replica that recomputed B without A would give it the spine it
    asked for. Returns (B, its path)."""
    a, outs_a = net.nodes[0].reserve(8, 10**9, 1.0)
    b, outs_b = net.nodes[1].reserve(9, 10**12, 1.0)
    net.emit(0, outs_a, 1.0)
    net.emit(1, outs_b, 1.0)
    assert (a.path, b.path) == (0, 0) and net.nodes[1].lease_of(b.flow_id).path == 1
    net.emit(0, net.nodes[0].release(a.flow_id, 2.0), 2.0)
    net.renewing([(1, b.flow_id)], 2.0, 4.5)
    assert all(n.core.frozen().get(b.flow_id) == (1, False) for n in net.nodes.values())
    return b.flow_id, 1


def test_an_honest_majority_restores_a_frozen_assignment_and_a_lie_is_outvoted() -> None:
    net = ByzNet(retention_s=1.0)
    net.start()
    fb, path = _frozen_pair(net)
    net.rewrite = claims([[fb[0], fb[1], 0, False]])  # the liar says B is on the spine it asked for
    joiner = net.restart(8, 4.6)
    net.run(4.6, 5.2)
    assert joiner.core.table(at=5.2)[fb][0] == path
    assert joiner.counters.frozen_conflicts >= 1
    net.check_honest(5.2)


def test_a_lone_liar_cannot_decide_a_frozen_assignment() -> None:
    # Only the liar and the joiner are up: the liar's claim is one vote of four listed
    # peers, so the joiner keeps its own recomputation rather than the lie.
    net = ByzNet(retention_s=1.0)
    net.start()
    fb, _path = _frozen_pair(net)
    net.rewrite = claims([[fb[0], fb[1], 3, False]])
    net.down = {0, 1, 9}
    joiner = net.restart(8, 4.6)
    net.run(4.6, 5.4)
    assert joiner.core.table(at=5.4)[fb][0] != 3


def relays(items: list[list[bytes]], hide_from: int) -> Rewrite:
    """Add captured signed messages to the sync replies the liar sends, except to their owner."""
    return lambda src, dst, data: data if dst == hide_from else add_to_sync_reply(data, items=items)


def test_a_replayed_reservation_of_an_earlier_incarnation_is_not_revived() -> None:
    net = ByzNet(retention_s=1.0)
    net.start()
    lease, outs = net.nodes[0].reserve(8, 10**12, 1.0)  # a lease of minutes
    net.emit(0, outs, 1.0)
    signed = [[raw, sig] for s, d in net.seen if s == 0
              for raw, sig in [decode_envelope(d).payload] if isinstance(decode(raw), Reserve)]
    assert signed and lease.flow_id in net.nodes[LIAR].core.table()
    net.emit(0, net.nodes[0].release(lease.flow_id, 1.5), 1.5)  # the liar keeps the RESERVE
    net.restart(0, 1.6)
    net.run(1.6, 3.5)  # everyone forgets the flow
    assert all(not n.core.knows(lease.flow_id) for n in net.nodes.values())
    net.rewrite = relays(signed, hide_from=0)
    net.restart(LIAR, 3.6)  # a new incarnation: every host asks the liar for a snapshot
    net.run(3.6, 4.5)
    for h, n in net.nodes.items():
        if h != LIAR:
            assert lease.flow_id not in n.core.table(at=4.5), h
    assert all(net.nodes[h].counters.replayed >= 1 for h in (1, 8, 9))
    net.check_honest(4.5)



def test_with_most_peers_down_the_owners_word_beats_a_liar_at_a_joiner() -> None:
    net = ByzNet(retention_s=1.0)
    net.start()
    fb, path = _frozen_pair(net)
    net.rewrite = claims([[fb[0], fb[1], 0, False]])
    net.down = {0, 9}  # up: the owner (1), the liar and the joiner
    joiner = net.restart(8, 4.6)
    net.run(4.6, 5.4)
    assert joiner.core.table(at=5.4)[fb][0] == path == net.nodes[1].lease_of(fb).path
    assert joiner.counters.frozen_conflicts >= 1


def test_a_liar_cannot_move_its_own_old_flow_onto_another_hosts_path() -> None:
    # The liar's flow L has lived longer than the retention; it makes every replica ask it
    # for a snapshot (a HELLO whose digest differs) and claims L sits on host 0's spine.
    net = ByzNet(retention_s=1.0)
    net.start()
    mine, outs = net.nodes[LIAR].reserve(9, 10**12, 1.0)
    net.emit(LIAR, outs, 1.0)
    victim, outs = net.nodes[0].reserve(8, 10**12, 1.1)
    net.emit(0, outs, 1.1)
    assert (mine.path, victim.path) == (0, 1)
    both = [(LIAR, mine.flow_id), (0, victim.flow_id)]
    net.renewing(both, 1.2, 4.0)
    lie = claims([[LIAR, mine.flow_id[1], victim.path, False]])

    def rewrite(src: int, dst: int, data: bytes) -> bytes:
        env = decode_envelope(data)
        if env.kind == K_HELLO:
            p = env.payload
            return encode_envelope(K_HELLO, env.sender, env.incarnation, env.seq, [b"\xff" * 8, *p[1:]])
        return lie(src, dst, data)

    net.rewrite = rewrite
    t = net.renewing(both, 4.0, 7.0)  # several rounds of syncs with the liar
    for h, n in net.nodes.items():
        if h != LIAR:
            assert n.core.table(at=t)[mine.flow_id][0] == mine.path and n.counters.frozen_conflicts >= 2
    assert net.nodes[0].lease_of(victim.flow_id).path == victim.path
    net.check_honest(t)


class SkewNet(ByzNet):
    """ByzNet where host h's clock reads the true time plus ``skew[h]``."""

    def __init__(self, hosts: list[int], skew: dict[int, float]) -> None:
        self.skew = skew
        super().__init__(hosts=hosts)

    def emit(self, src: int, outs, now: float) -> None:  # ``now``: the true time
        queue = [(src, o) for o in outs]
        while queue:
            s, o = queue.pop(0)
            for d in [h for h in self.nodes if h != s] if isinstance(o, Publish) else [o.peer]:
                if d in self.down:
                    continue
                data = self.rewrite(s, d, o.data) if s == LIAR else o.data
                queue.extend((d, r) for r in self.nodes[d].on_message(s, data, now + self.skew.get(d, 0.0)))
        for n in self.nodes.values():
            n.flush()

    def start(self, now: float = 0.0) -> None:
        for h, n in self.nodes.items():
            if h not in self.down:
                self.emit(h, n.start(now + self.skew.get(h, 0.0)), now)
        self.run(now, now + 0.6)

    def run(self, t0: float, t1: float, step: float = 0.05) -> None:
        t = t0
        while t <= t1:
            for h, n in self.nodes.items():
                if h not in self.down:
                    self.emit(h, n.tick(t + self.skew.get(h, 0.0)), t)
            t += step

    def live_paths(self, h: int) -> set[int]:
        """The paths host h's reserved flows are on now, as h itself sees them (where its
        packets go)."""
        return {path for _dst, path, _port, reserved in self.nodes[h].core.local_flows().values() if reserved}


def test_a_skewed_owner_vouched_for_by_a_liar_never_shares_a_path_with_its_leaf_mate() -> None:
    # Four hosts, one down (8). Host 0's clock is 1 s behind; host 1, its leaf-mate, is
    # honest; the liar tells host 0 its clock is 1 s behind too, so host 0 (one of its two
    # fresh peers ahead of it) is not fenced, and host 1 (one of two peers within the bound)
    # does not judge others' clocks. Host 1 must still see host 0's flows for as long as
    # they really last: it judges their ends by its own measurement of host 0's clock.
    skewed, mate = 0, 1
    net = SkewNet([skewed, mate, LIAR, 8], {skewed: -1.0})
    net.down = {8}
    net.rewrite = lambda src, dst, data: shift_clock(data, -1.0) if dst == skewed else data
    net.start()
    net.run(0.6, 3.0)
    assert not net.nodes[skewed].skewed and not net.nodes[mate].clock.trusted(3.0)
    # 64 rounds: the skewed host reserves, its leaf-mate 0.65 s later (while the first flow
    # still runs; read on one clock, its 1 s lease has ended). Then 32 rounds the other way
    # round: the skewed host's reservation 0.3 s after its leaf-mate's carries a timestamp
    # 0.7 s earlier, wins the race on every replica, and the leaf-mate's flow moves.
    doubles, moved, t = [0, 0], 0, 3.0
    for k in range(96):
        first, second, gap = (skewed, mate, 0.65) if k < 64 else (mate, skewed, 0.3)
        a, outs = net.nodes[first].reserve(9, 10**6, t + net.skew.get(first, 0.0))
        net.emit(first, outs, t)
        net.run(t + 0.05, t + gap - 0.05)
        b, outs = net.nodes[second].reserve(9, 10**6, t + gap + net.skew.get(second, 0.0))
        net.emit(second, outs, t + gap)
        net.run(t + gap + 0.05, t + 0.8)
        doubles[k >= 64] += bool(net.live_paths(skewed) & net.live_paths(mate))
        mine = a if first == mate else b
        moved += net.nodes[mate].lease_of(mine.flow_id).path != mine.path
        for h, lease in ((first, a), (second, b)):
            net.emit(h, net.nodes[h].release(lease.flow_id, t + 0.85 + net.skew.get(h, 0.0)), t + 0.85)
        net.run(t + 0.9, t + 1.5)
        t += 1.5
    assert doubles == [0, 0] and moved == 32
    assert net.nodes[mate].core.behind(skewed) == pytest.approx(1.0) and net.nodes[skewed].core.behind(mate) == pytest.approx(-1.0)
