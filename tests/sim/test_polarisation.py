"""Hash polarisation: which seedings leave paths unreachable."""

from __future__ import annotations

from ark.core.clos import CLOS_PRESETS
from ark.sim.polarisation import SEEDINGS, reachability_table

SMALL = dict(CLOS_PRESETS["clos3-small"], aggs_per_pod=4, cores_per_plane=4)


def test_a_seed_per_switch_unties_only_a_hash_that_mixes_its_seed() -> None:
    rows = {(r["hash"], r["seeding"]): r["mean"] for r in reachability_table(SMALL, pairs=4)}
    one, per_switch, other = (label for label, _ in SEEDINGS)
    assert rows[("murmur3-hpcc", one)] == 0.25
    assert rows[("murmur3-hpcc", per_switch)] == 1.0
    # CRC and XOR are affine in the key: a seed fed in as key data shifts both switches'
    # hashes by constants and their choices stay tied.
    for h in ("crc32", "crc16-ccitt", "xor16"):
        assert rows[(h, one)] == rows[(h, per_switch)] == 0.25
        assert rows[(h, other)] == 1.0
