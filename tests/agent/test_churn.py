"""An engine reserving and releasing back to back through the real local API is never
refused for bookkeeping: past the live cap it keeps reserving, and past what its peers
may retain of it, it gets plain ECMP leases that say why, never an error."""

from __future__ import annotations

import pytest

from ark.agent.bench import churn


def test_back_to_back_reserve_release_past_the_cap_gets_no_error() -> None:
    # The smallest cap a cluster file takes: released flows used to fill it in 16 cycles
    # and have every later request refused until they were forgotten (retention_s later).
    r = churn(seconds=3.0, max_flows_per_host=16)
    assert r["refusals"] == 0, r["refusal_reasons"]
    assert r["cycles"] > 200 and r["errors"] == 0
    # 48 reserved (the owner stops max_flows_per_host short of the 64 its peers keep of
    # it), then plain ECMP until the first of them are forgotten; the peer dropped none.
    assert set(r["ecmp_reasons"]) == {"cap: 48 reservations retained"} and r["capped"] == r["ecmp"]
    assert r["cycles"] - r["ecmp"] >= 48 and r["peer_overflow"] == 0


def _four_part_churn(seconds: float) -> None:
    """Back-to-back four-part leases, as fast as one client gets them answered, on a cluster
    sized for that rate: a peer that reads the whole stream (no syncs to slow the owner) and
    max_flows_per_host 8192 (24,576 retained, ~4,900 ends a second for one retention; one
    client here ends up to ~2,600 a second, past the ~2,450 of the default 4096). Every
    part reserved or plain ECMP for a path reason, none for a cap, the peer dropping none."""
    r = churn(seconds=seconds, parts=4, peer_rate=1e5, max_flows_per_host=8192)
    assert r["refusals"] == 0, r["refusal_reasons"]
    assert r["cycles"] > 50 * seconds and r["errors"] == 0
    assert r["capped"] == 0 and not [w for w in r["ecmp_reasons"] if w.startswith("cap:")], r["ecmp_reasons"]
    assert r["peer_overflow"] == 0 and r["peer_rate_limited"] == 0


def test_back_to_back_four_part_leases_meet_no_cap() -> None:
    _four_part_churn(8.0)  # past one retention (5 s) and the bookkeeping grid: forgetting has begun


@pytest.mark.slow
def test_back_to_back_four_part_leases_for_a_minute_meet_no_cap() -> None:
    _four_part_churn(60.0)
