"""The arbiter mode's fault harness (tests/vopr_arbiter.py): many seeds, one seed one run,
and arbiters or links broken on purpose that it must catch, naming the seed."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter

import pytest

from ark.core.arbiter import Arbiter
from ark.core.arbiter_host import ArbiterLink
from tests import vopr_arbiter as va

DEFAULT_SEEDS = int(os.environ.get("ARK_VOPR_ARBITER_SEEDS", "300"))
SLOW_SEEDS = int(os.environ.get("ARK_VOPR_ARBITER_SLOW_SEEDS", "10000"))


def _run_seeds(seeds: range) -> None:
    for s in seeds:
        va.run(s)  # raises Violation naming the seed and how to rerun it


def test_vopr_arbiter_default_seeds() -> None:
    _run_seeds(range(DEFAULT_SEEDS))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(10))
def test_vopr_arbiter_many_seeds(chunk: int) -> None:
    per = SLOW_SEEDS // 10
    _run_seeds(range(100_000 + chunk * per, 100_000 + (chunk + 1) * per))


def test_a_violation_names_its_seed() -> None:
    sim = va.Sim(7)
    with pytest.raises(va.Violation, match=r"seed 7, .*rerun: python -m tests.vopr_arbiter 7"):
        sim.fail("synthetic")


def test_same_seed_same_run() -> None:
    a, b = va.run(11, trace=True), va.run(11, trace=True)
    assert a.trace and a.trace == b.trace
    assert a.summary == b.summary and a.t == b.t and a.seq == b.seq
    assert va.run(12, trace=True).trace != a.trace


def test_the_seeds_exercise_what_the_harness_claims() -> None:
    """Over a few seeds: every fault happens, hosts fall back and recover, leaders change."""
    total: Counter[str] = Counter()
    arbiters: Counter[int] = Counter()
    for s in range(40):
        sim = va.run(s)
        total.update({k: v for k, v in vars(sim.summary).items() if v})
        arbiters[sim.n_arbs] += 1
    for s in range(40, 200):  # rare since leaders answer only within their leases: a flow the leader lost
        if total["unreserved"]:
            break
        total["unreserved"] += va.run(s).summary.unreserved
    assert set(arbiters) == {1, 2, 3}
    for what in ("granted", "ecmp", "unanswered", "renewed", "released", "expired_clients", "arbiter_crashes",
                 "arbiter_restarts", "host_crashes", "host_restarts", "partitions", "takeovers", "registered_kept",
                 "unreserved", "judged", "dead_judged", "pauses", "no_lease"):
        assert total[what] > 0, what
    assert total["quiet_checks"] == 80


# ---------------------------------------------------------------------- broken on purpose
def _caught(seeds: range) -> tuple[int, va.Violation]:
    for s in seeds:
        try:
            va.run(s)
        except va.Violation as e:
            return s, e
    pytest.fail(f"no seed of {seeds} caught it")


def _names(seed: int, e: va.Violation) -> str:
    msg = str(e)
    assert msg.startswith(f"seed {seed}, ") and msg.endswith(f"(rerun: python -m tests.vopr_arbiter {seed})")
    return msg


def test_an_arbiter_that_hands_out_held_paths_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 1: the arbiter answers the lowest path the ask may use, free or not."""
    new_table = Arbiter._new_table

    def broken(self: Arbiter) -> object:
        table = new_table(self)
        table.lowest_free = lambda sids, n, usable: (usable & -usable).bit_length() - 1  # type: ignore[method-assign]
        return table

    monkeypatch.setattr(Arbiter, "_new_table", broken)
    seed, e = _caught(range(10))
    assert "holds flow" in _names(seed, e) or "held by" in str(e)


def test_an_arbiter_whose_leases_outlast_a_dead_host_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 2: leases ten times what the policy gives."""
    init = Arbiter.__init__

    def long_leases(self: Arbiter, *args: object, **kw: object) -> None:
        init(self, *args, **kw)  # type: ignore[arg-type]
        self._lease = lambda nbytes, rate: 10 * va.LEASE(nbytes, rate)

    monkeypatch.setattr(Arbiter, "__init__", long_leases)
    seed, e = _caught(range(40))
    assert "of dead host incarnation" in _names(seed, e)


def test_a_link_that_never_probes_again_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 3: down after an unanswered request, it never pings an arbiter."""

    def go_down(self: ArbiterLink, now: float) -> None:
        if self.up:
            self.up, self.down_since, self._next_probe = False, now, math.inf

    monkeypatch.setattr(ArbiterLink, "_go_down", go_down)
    seed, e = _caught(range(10))
    assert "unanswered although" in _names(seed, e) or "not by the leader" in str(e)


def test_a_follower_that_drops_the_changes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 4: a follower that takes the whole table but no Changes after it."""
    on_arbiter = Arbiter.on_arbiter

    def deaf(self: Arbiter, rank: int, data: bytes, now: float) -> list:  # type: ignore[type-arg]
        return [] if data[1] == 22 else on_arbiter(self, rank, data, now)  # 22: Changes

    monkeypatch.setattr(Arbiter, "on_arbiter", deaf)
    seed, e = _caught(range(20))
    assert "table differs from the leader's" in _names(seed, e)


def test_a_standby_that_leads_beside_a_live_leader_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 5: rank 1 leads three takeover periods after it started, whatever it heard."""
    tick = Arbiter.tick

    def eager(self: Arbiter, now: float) -> list:  # type: ignore[type-arg]
        if self.rank == 1 and not self.leading and not getattr(self, "eager", False) and self._started is not None \
                and now >= self._started + 3 * self.takeover_s:
            self.eager = True  # type: ignore[attr-defined]
            self._become("leading", now)
        return tick(self, now)

    monkeypatch.setattr(Arbiter, "tick", eager)
    seed, e = _caught(range(20))
    assert "took over" in _names(seed, e) or "two leaders answered in overlapping windows" in str(e)


def _only(monkeypatch: pytest.MonkeyPatch, **faults: bool) -> None:
    """Every seed draws its faults as usual, then keeps only the named kinds of these."""
    draw = va.Faults.draw.__func__  # type: ignore[attr-defined]
    kinds = ("pauses", "partitions", "arbiter_crashes", "host_crashes")

    def only(cls: type[va.Faults], rng: object) -> va.Faults:
        return dataclasses.replace(draw(cls, rng), **{k: faults.get(k, False) for k in kinds})

    monkeypatch.setattr(va.Faults, "draw", classmethod(only))


@pytest.mark.parametrize("fault", ["pauses", "partitions"])
def test_a_leader_without_a_lease_is_caught(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Invariants 6 and 1: the old rule, a leader answering whenever it believes it leads.
    A stopped leader resumes, or one cut from its follower goes on, and answers hosts that
    have not heard the new epoch from a table that lacks the new leader's grants."""
    monkeypatch.setattr(Arbiter, "_lease_held", lambda self, now: True)
    _only(monkeypatch, **{fault: True})
    seed, e = _caught(range(20))
    assert "two leaders answered in overlapping windows" in _names(seed, e) or "stale table" in str(e)


def test_a_leader_without_a_lease_hands_out_a_held_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 1 across epochs on its own (invariant 6 silenced): two honest hosts hold one
    link under two epochs, the older granted after the newer epoch began answering."""
    monkeypatch.setattr(Arbiter, "_lease_held", lambda self, now: True)
    note = va.Sim._note_answer

    def silenced(self: va.Sim, r: int, host: int, data: bytes) -> None:
        top, self.top_answered = self.top_answered, -1
        note(self, r, host, data)
        self.top_answered = max(top, self.top_answered)

    monkeypatch.setattr(va.Sim, "_note_answer", silenced)
    _only(monkeypatch, partitions=True)
    seed, e = _caught(range(20))
    assert "an old leader answered from a stale table" in _names(seed, e)


# ---------------------------------------------------------------------- known src bugs
# Seeds that caught bugs in src, fixed since: each broke an invariant before its fix.
# rid: a restarted host's request ids began again at 1 and got its previous process's kept
# answers; restart: a standby restarted beside a live leader of a lower rank led on an
# empty table; sync: a follower whose SyncAsk was lost never asked again and led on part
# of the table; repath: the host's own table moved a granted part to another path; lease:
# a host counted its lease from the answer's arrival and outlived the arbiter's.
FIXED = {"rid": 9, "restart": 62, "sync": 3, "repath": 71, "lease": 251}


@pytest.mark.parametrize("bug", sorted(FIXED))
def test_seeds_that_caught_fixed_bugs(bug: str) -> None:
    va.run(FIXED[bug])
