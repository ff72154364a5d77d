"""NIXL over UCX's TCP transport between two namespace hosts, steered by the connect()
interposer's process-wide rules (no line of ARK in the engine), checked at the spines.
Root and the nixl extra (scripts/install-nixl.sh); without either the tests skip."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ark.integrations import preload
from ark.integrations.preload import EnvRule, steer_rules
from ark.testbed import fabric as tbm
from ark.testbed import netns
from ark.testbed.nixl import blocks, forward_paths, free_listen_port, reply_paths, run_pair, ucx_env

PREFIX = "arkn"
LISTENS = range(15100, 15132)  # UCX's listener port: one nothing holds in TIME_WAIT (free_listen_port)
NBYTES = 3_000_000  # 24 Mbit: about 0.25 s at the testbed's 100 Mbit/s
PROBED = range(20000, 20128)  # source ports the rules may take
ECMP = range(30000, 30128)  # the kernel's own ports, for the run with steering off

root = pytest.mark.root
needs_ns = pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")


def test_blocks_cover_every_byte_once_and_ucx_env_is_checked():
    assert blocks(10, 3) == [(0, 4), (4, 3), (7, 3)] and blocks(2, 8) == [(0, 1), (1, 1)]
    assert ucx_env(15100, 2) == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_TCP_PORT_RANGE": "15100-15101"}
    with pytest.raises(tbm.TestbedError, match="listen_port"):
        ucx_env(80)


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    pytest.importorskip("nixl._api", reason="the nixl extra is not installed (scripts/install-nixl.sh)")
    base = str(tmp_path_factory.mktemp("tbn"))
    tbm.down(PREFIX, base)
    st = tbm.up(tbm.TestbedSpec(leaves=2, spines=4, gpus_per_leaf=1, prefix=PREFIX), base)
    yield st
    tbm.down(PREFIX, base)


@contextlib.contextmanager
def ephemeral(st: tbm.State, host: int, ports: list[int]) -> Iterator[None]:
    """The host's kernel picks its own source ports from ``ports`` (consecutive) only."""
    ns = st.layout.host_ns(host)
    old = netns.read_sysctl(ns, "net.ipv4.ip_local_port_range")
    netns.sysctl(ns, "net.ipv4.ip_local_port_range", f"{ports[0]} {ports[-1]}")
    try:
        yield
    finally:
        netns.sysctl(ns, "net.ipv4.ip_local_port_range", old.replace("\t", " "))


def plan(paths: dict[int, int], ecmp: dict[int, int]) -> tuple[list[int], int, list[int]]:
    """Four consecutive kernel ports whose spines leave one spine out, that spine, and rule ports
    of it: with steering off the bytes cannot reach the spine the rule asks for."""
    for lo in range(ECMP.start, ECMP.stop - 4):
        window = list(range(lo, lo + 4))
        if all(p in ecmp for p in window) and len({ecmp[p] for p in window}) < 4:
            target = min(set(range(4)) - {ecmp[p] for p in window})
            return window, target, [p for p, k in sorted(paths.items()) if k == target][:8]
    raise AssertionError("no window of four kernel ports leaves a spine out")


def steer_env(rule: EnvRule, log: Path) -> dict[str, str]:
    log.unlink(missing_ok=True)
    return {"LD_PRELOAD": str(preload.library()), "ARK_STEER_RULES": steer_rules([rule]), "ARK_STEER_LOG": str(log)}


def check(run, nbytes: int, spine: int | None, sport: int | None = None) -> dict[int, int]:
    assert run.ok and run.state == "DONE"
    per = run.spine_bytes()
    assert sum(per.values()) >= nbytes  # every KV byte crossed a spine (plus UCX's few headers)
    if spine is not None:
        assert set(per) == {spine}, run.connections
    if sport is not None:
        assert all(key[0] == sport for key in run.connections)
    return per


def _port(st: tbm.State, src: int, dst: int, *taken: int) -> int:
    return free_listen_port(st, (src, dst), [p for p in LISTENS if p not in taken])


@root
@needs_ns
def test_a_pull_is_steered_from_the_decode_side_onto_the_reverse_path(bed, tmp_path):
    """vLLM's way: only the decode side loads the prefill's metadata. The prefill sends the KV
    bytes back on the decode's connection: the decode picks a source port whose *reverse*
    direction (prefill listener -> that port) takes the spine ARK chose."""
    st, src, dst = bed, 0, 1
    listen = _port(st, src, dst)
    window, target, ports = plan(reply_paths(st, src, dst, listen, PROBED), reply_paths(st, src, dst, listen, ECMP))
    assert len(ports) >= 2
    rule = EnvRule(st.layout.host_ip(src), (tuple(ports),), listen)
    # The decode's kernel picks its own ports from a window whose paths miss the target: only
    # steering can put the bytes there.
    with ephemeral(st, dst, window):
        steered = run_pair(st, src, dst, NBYTES, tmp_path / "w", listen_port=listen,
                           read_env=steer_env(rule, tmp_path / "steer.log"))
    check(steered, NBYTES, target, sport=listen)
    (_, dport), = steered.connections  # one KV connection: the decode's, seen from the prefill
    assert dport in ports and steered.steer_log == [f"{st.layout.host_ip(src)} {listen} {dport} 0 1"]
    # Steering off: the kernel's port, and the spine its hash takes (probed before: afterwards
    # the 4-tuple sits in TIME_WAIT).
    off_port = _port(st, src, dst, listen)
    off_map = reply_paths(st, src, dst, off_port, window)
    with ephemeral(st, dst, window):
        off = run_pair(st, src, dst, NBYTES, tmp_path / "w", listen_port=off_port)
    (_, kport), = off.connections
    assert kport in window
    check(off, NBYTES, off_map[kport])


@root
@needs_ns
def test_with_metadata_both_ways_the_prefill_side_is_steered_onto_its_forward_path(bed, tmp_path):
    """Both sides load each other's metadata: the KV bytes go on the connection the prefill
    opened to the decode's listener, bound (the deferred bind: UCX binds ifaddr:0 first)
    to a port of the spine ARK chose."""
    st, src, dst = bed, 0, 1
    listen = _port(st, src, dst)
    window, target, ports = plan(forward_paths(st, src, dst, listen, PROBED), forward_paths(st, src, dst, listen, ECMP))
    rule = EnvRule(st.layout.host_ip(dst), (tuple(ports),), listen)
    with ephemeral(st, src, window):
        steered = run_pair(st, src, dst, NBYTES, tmp_path / "w", listen_port=listen, mutual=True,
                           hold_env=steer_env(rule, tmp_path / "steer.log"))
    check(steered, NBYTES, target)
    (sport, dport), = steered.connections
    assert sport in ports and dport == listen
    assert steered.steer_log == [f"{st.layout.host_ip(dst)} {listen} {sport} 0 1"]
    off_port = _port(st, src, dst, listen)
    off_map = forward_paths(st, src, dst, off_port, window)
    with ephemeral(st, src, window):
        off = run_pair(st, src, dst, NBYTES, tmp_path / "w", listen_port=off_port, mutual=True)
    (kport, _), = off.connections
    assert kport in window
    check(off, NBYTES, off_map[kport])


def _one_spine_windows(paths: dict[int, int]) -> Iterator[tuple[list[int], int]]:
    """Two consecutive kernel ports on one spine, and that spine."""
    for lo in range(ECMP.start, ECMP.stop - 1):
        if lo in paths and paths.get(lo + 1) == paths[lo]:
            yield [lo, lo + 1], paths[lo]


@root
@needs_ns
def test_a_connection_lease_carries_the_kv_bytes_and_ends_with_the_connection(bed, tmp_path):
    """Agents on the hosts, a connection-lease holder beside the prefill side: the prefill's UCX
    connection asks the holder (a lease:... rule), takes a port of the path leased for it alone,
    and every KV byte crosses that path's spine; when the processes are gone, the holder sees
    the connection leave the socket table and releases the lease."""
    import json
    import time

    from ark.testbed.nixl import leased

    st, src, dst = bed, 0, 1
    used: list[int] = []
    for attempt in range(3):
        listen = _port(st, src, dst, *used)
        used.append(listen)
        window, kernel_spine = next(_one_spine_windows(forward_paths(st, src, dst, listen, ECMP)))
        with leased(st, src, dst, tmp_path / f"cl{attempt}", listen) as (env, state):
            with ephemeral(st, src, window):  # steering off, the bytes would cross kernel_spine
                run = run_pair(st, src, dst, NBYTES, tmp_path / "w", listen_port=listen, mutual=True, hold_env=env)
            (sport, dport), = run.connections
            time.sleep(1.0)  # the holder's sweeps see the connection gone
            held = json.loads(state.read_text())
        lease = next(c for c in held["ended"] + held["live"] if c["sport"] == sport)
        if lease["path"] != kernel_spine:  # else the agent chose the kernel's spine: try another window
            break
    else:
        raise AssertionError("the agent leased the kernel's spine three times")
    check(run, NBYTES, lease["path"])
    assert dport == listen and lease["dst"] == st.layout.host_ip(dst) and lease["dport"] == listen
    assert lease["state"] == "closed" and held["live"] == [] and held["refused"] == 0
