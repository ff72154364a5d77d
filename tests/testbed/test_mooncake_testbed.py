"""Mooncake Transfer Engines on the namespace testbed: real engines, real agents, kernel ECMP,
spine counters. Root and the mooncake extra; without either the tests skip."""

from __future__ import annotations

import json

import pytest

from ark.testbed import fabric as tbm
from ark.testbed import netns
from ark.testbed.mooncake import pattern, receiver_offsets, split

SMALL = dict(leaves=2, spines=4, gpus_per_leaf=2, prefix="arkm")


def test_split_and_offsets_cover_every_byte_once():
    assert split(10, 3) == [4, 3, 3] and split(2, 8) == [1, 1] and split(0, 4) == [0]
    from ark.core.flows import FlowSpec

    flows = [FlowSpec(0, 0, 2, 5, 0.0), FlowSpec(1, 1, 2, 7, 0.1), FlowSpec(2, 0, 3, 4, 0.2)]
    offsets, size = receiver_offsets(flows)
    assert offsets == {0: 0, 1: 5, 2: 0} and size == {2: 12, 3: 4}
    assert pattern(3, 1000).tobytes() == pattern(3, 1000).tobytes() != pattern(4, 1000).tobytes()


root = pytest.mark.root
needs_ns = pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")
    base = str(tmp_path_factory.mktemp("tbm"))
    tbm.down("arkm", base)
    st = tbm.up(tbm.TestbedSpec(**SMALL), base)
    yield st, base
    tbm.down("arkm", base)


@root
@needs_ns
def test_steered_mooncake_transfers_cross_their_reserved_spines(bed):
    from ark.testbed import run as tr

    st, _ = bed
    # 256 probed ports: ~64 a path, more than a minute of this run's connections leaves in
    # TIME_WAIT (with 64, ~16 a path, back-to-back runs ran out and connections fell back).
    kw = dict(requests=16, qps=8.0, seed=1, sample=256, engine="mooncake", buffers=2)
    ark = tr.run(st, tr.RunParams(scheme="ark", **kw))
    assert ark["errors"] == 0 and ark["flows_verified"] == 16 and ark["bytes_verified_fraction"] == 1.0
    steered = [f for f in ark["flows"] if not f["ecmp"]]  # the rest found every path taken: plain ECMP
    assert len(steered) >= 8 and ark["ecmp_fallbacks"] == 16 - len(steered)
    assert ark["path_checked"] == len(steered) and ark["capture_drops"] == 0
    assert ark["path_match_fraction"] == 1.0, [f for f in steered if not f["path_match"]]
    for f in steered:
        segs = f["segments"]
        # Two requests, two connections, each on its own port of the leased path, every byte on its spine.
        assert len(segs) == 2 and len({s["sport"] for s in segs}) == 2 and all(s["steered"] for s in segs)
        assert all(s["spine_bytes"] and set(s["spine_bytes"]) == {str(f["reserved_spine"])} for s in segs)
        assert all(s["dport"] in (st.spec.dport + 2 * k + j for k in range(16) for j in (0, 1)) for s in segs)
    ecmp = tr.run(st, tr.RunParams(scheme="ecmp", **kw), reprobe=False)
    assert ecmp["errors"] == 0 and ecmp["flows_verified"] == 16 and ecmp["path_match_fraction"] is None
    assert all(s["steered"] is None for f in ecmp["flows"] for s in f["segments"])  # the engine's own ports
    assert sum(ecmp["flows_per_spine"]) == 16
    assert [f["bytes"] for f in ecmp["flows"]] == [f["bytes"] for f in ark["flows"]]


@root
@needs_ns
def test_ark_split_puts_a_flows_mooncake_connections_on_its_parts(bed):
    from ark.testbed import run as tr

    st, _ = bed
    kw = dict(requests=12, qps=8.0, seed=2, sample=256, engine="mooncake", buffers=4)
    rec = tr.run(st, tr.RunParams(scheme="ark-split", parts=2, **kw))
    assert rec["errors"] == 0 and rec["bytes_verified_fraction"] == 1.0 and rec["capture_drops"] == 0
    assert rec["path_checked"] == 12
    # A race that moves a part while its connections stay put is the one way to miss
    # (docs/engines/mooncake.md); the record says so, and any other flow must match.
    assert all(f["path_match"] for f in rec["flows"] if not f["repathed"]), rec["flows"]
    assert sum(f["repathed"] for f in rec["flows"]) <= 2
    for f in rec["flows"]:
        segs = f["segments"]
        # Four requests on a lease of two parts: two connections per part, alternating, each
        # on a port of its part's path, and each part on a spine of its own.
        assert len(segs) == 4 and all(s["steered"] for s in segs)
        assert sorted(s["part"] for s in segs) == [0, 0, 1, 1]
        paths = {s["part"]: s["path"] for s in segs}
        assert len(set(paths.values())) == 2 and all(s["path"] == paths[s["part"]] for s in segs)
        assert f["repathed"] or all(set(s["spine_bytes"]) == {str(s["path"])} for s in segs)


@root
@needs_ns
def test_cli_engine_option_and_refusals(bed, capsys):
    from ark.cli import main

    _st, base = bed
    rc = main(["testbed", "run", "--seeds", "1", "--engine", "mooncake", "--requests", "8", "--qps", "6", "--scheme", "ark",
               "--sample", "256", "--prefix", "arkm", "--state-dir", base, "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["engine"] == "mooncake" and rec["buffers"] == 1 and rec["bytes_verified_fraction"] == 1.0
    assert rec["path_match_fraction"] == 1.0
    rc = main(["testbed", "run", "--seeds", "1", "--engine", "mooncake", "--fail-link", "0:1@1", "--prefix", "arkm",
               "--state-dir", base])
    assert rc == 2 and "fail_link: only with the builtin engine" in capsys.readouterr().err
