"""The RoCEv2 wire check (ark testbed roce-check, scripts/roce-wire-check.py): its parts here, its capture on the
namespace testbed with plain UDP datagrams standing in for RoCEv2 (no Soft-RoCE needed)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ark.integrations import rocewire
from ark.testbed import netns

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "roce-wire-check.py"


def frame(src: str, dst: str, sport: int, dport: int = 4791, proto: int = 17, ethertype: bytes = b"\x08\x00") -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 48, 0, 0, 64, proto, 0, socket.inet_aton(src), socket.inet_aton(dst))
    return bytes(12) + ethertype + ip + struct.pack("!HHHH", sport, dport, 28, 0) + bytes(20)


def test_frames_are_read_as_roce_only_when_they_are() -> None:
    assert rocewire.parse_roce(frame("10.0.0.1", "10.0.1.1", 49153)) == ("10.0.0.1", "10.0.1.1", 49153)
    assert rocewire.parse_roce(frame("10.0.0.1", "10.0.1.1", 49153, dport=5201)) is None
    assert rocewire.parse_roce(frame("10.0.0.1", "10.0.1.1", 49153, proto=6)) is None
    assert rocewire.parse_roce(frame("10.0.0.1", "10.0.1.1", 49153, ethertype=b"\x86\xdd")) is None
    assert rocewire.parse_roce(b"\x00" * 20) is None


def test_gid_index_ports_per_spine_and_verdict(tmp_path) -> None:
    port = tmp_path / "rxe0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    table = [("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"), (rocewire.mapped_gid("10.0.0.1"), "IB/RoCE v1"),
             (rocewire.mapped_gid("10.0.0.1"), "RoCE v2")]
    for i, (gid, kind) in enumerate(table):
        (port / "gids" / str(i)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    assert rocewire.mapped_gid("10.0.0.1") == "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert rocewire.roce_gid_index("rxe0", "10.0.0.1", sysfs=tmp_path) == 2
    assert rocewire.roce_gid_index("rxe0", "10.0.0.2", sysfs=tmp_path) is None
    assert rocewire.ports_per_spine(lambda p: p % 3, 3, 2) == {0: [49152, 49155], 1: [49153, 49156], 2: [49154, 49157]}
    with pytest.raises(ValueError, match=r"^ports: no 1 RoCEv2 ports reach spine\(s\) \[2\]"):
        rocewire.ports_per_spine(lambda p: p % 2, 3, 1)
    checks, stray = rocewire.judge({49152: 0, 49153: 1}, {49152: {0: 5}, 49153: {0: 1, 1: 4}, 50000: {1: 2}})
    assert [(c.port, c.seen, c.packets, c.ok) for c in checks] == [(49152, (0,), 5, True), (49153, (0, 1), 5, False)]
    assert stray == [50000]


def test_why_not_names_one_reason() -> None:
    assert rocewire.why_not("5.15.0-91-generic") == "kernel 5.15.0-91-generic: rxe takes the source port from the flow label since 5.17"
    why = rocewire.why_not()
    assert why is None or "\n" not in why


@pytest.mark.parametrize("argv", [[str(SCRIPT)], ["-m", "ark", "testbed", "roce-check"]])
def test_the_script_and_the_testbed_option_skip_in_one_line_without_soft_roce(argv) -> None:
    if rocewire.why_not() is None:
        pytest.skip("this machine has Soft-RoCE: the script would run the real check")
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.count("\n") == 1 and res.stdout.startswith("roce-wire-check: skipped: ")


def test_spine_counters_must_cover_the_capture() -> None:
    from ark.testbed.roce import WireCheck, WireCheckError, counters_agree

    seen = {49153: {0: 10}, 49154: {1: 7}}
    assert counters_agree(seen, [100, 50], [112, 57]) == []
    assert counters_agree(seen, [100, 50], [105, 57]) == [0]  # spine 0 counted fewer than were captured there
    with pytest.raises(WireCheckError, match=r"per_spine: expected an integer 1\.\.64; got 0"):
        WireCheck(per_spine=0)


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    from ark.testbed import fabric as tb

    base = str(tmp_path_factory.mktemp("tb"))
    tb.down("arkrw", base)  # a crashed earlier run
    st = tb.up(tb.TestbedSpec(leaves=2, spines=2, gpus_per_leaf=1, prefix="arkrw"), base)
    yield st
    tb.down("arkrw", base)


@pytest.mark.root
@pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")
def test_capture_sees_each_leased_port_at_its_spine(bed) -> None:
    """The check's port choice (the leaf's own routes) and its spine capture, end to end on
    the testbed, with UDP datagrams to port 4791 from each leased port standing in for the
    QPs' RoCEv2 packets."""

    from ark.testbed import roce as mod

    src, dst, per = mod.plan(bed, 2)
    lay = bed.layout
    leased = {p: k for k, ps in per.items() for p in ps}
    assert sorted(per) == [0, 1] and all(len(v) == 2 for v in per.values())
    spines = [lay.spine_ns(k) for k in range(2)]
    before = mod.spine_packets(spines)
    cap = mod.Capture(spines, lay.host_ip(src), lay.host_ip(dst))
    try:
        with netns.inside(lay.host_ns(src)):
            socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in leased]
        for s, p in zip(socks, sorted(leased), strict=True):
            s.bind((lay.host_ip(src), p))
            for _ in range(3):
                s.sendto(b"roce stand-in", (lay.host_ip(dst), rocewire.ROCE_DPORT))
        time.sleep(0.5)
    finally:
        seen = cap.close()
        for s in socks:
            s.close()
    checks, stray = rocewire.judge(leased, seen)
    assert all(c.ok and c.packets == 3 for c in checks), checks
    assert stray == []
    assert mod.counters_agree(seen, before, mod.spine_packets(spines)) == []
