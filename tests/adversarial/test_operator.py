"""An unlucky operator: bad settings, unusable files and directories, clocks that jump."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from ark.agent import cluster as clmod
from ark.agent.cluster import ClusterError
from ark.agent.incarnation import EPOCH, IncarnationError, next_incarnation
from ark.agent.loopback import write_cluster
from ark.agent.sockets import AgentError, check_resolvable, private_api_dir


def _raw(tmp_path) -> dict:
    cfile, _ = write_cluster(tmp_path, 2)
    return clmod.load(cfile), msgspec.toml.decode(cfile.read_bytes())


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"heartbeat_s": 1e-6}, "cluster.heartbeat_s: must be >= 0.01; got 1e-06"),
        ({"heartbeat_s": 1.0, "peer_timeout_s": 0.5}, "cluster.peer_timeout_s: must be >= 2 x heartbeat_s (2); got 0.5"),
        ({"lease_min_s": 1000.0}, "cluster.max_lease_s: must be > lease_min_s (1000.0); got 600.0"),
        ({"max_clock_offset_s": 1.0}, "cluster.max_clock_offset_s: must be <= lease_min_s / 4 (0.25)"),
        ({"heartbeat_s": float("nan")}, "cluster.heartbeat_s: must be >= 0.01; got nan"),
        ({"peer_rate": float("inf")}, "cluster.peer_rate: must be <= 10000000; got inf"),
        ({"max_dports": 0}, "cluster.max_dports: must be >= 1; got 0"),
    ],
)
def test_settings_and_their_relations_are_checked(tmp_path, cluster: dict, message: str) -> None:
    _, raw = _raw(tmp_path)
    raw["cluster"].update(cluster)
    with pytest.raises(ClusterError) as e:
        clmod.from_dict(raw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_two_hosts_cannot_share_a_control_address_or_api(tmp_path) -> None:
    _, raw = _raw(tmp_path)
    for key in ("control", "api"):
        r = {**raw, "hosts": [dict(h) for h in raw["hosts"]]}
        r["hosts"][1][key] = r["hosts"][0][key]
        with pytest.raises(ClusterError, match=rf"^hosts\[1\]\.{key}: the same as hosts\[0\]'s"):
            clmod.from_dict(r)


def test_unresolvable_hosts_are_one_line_errors() -> None:
    with pytest.raises(AgentError, match=r"^hosts\[3\].control: cannot resolve tcp://no-such-host.invalid:7100"):
        check_resolvable("tcp://no-such-host.invalid:7100", "hosts[3].control")
    check_resolvable("tcp://127.0.0.1:7100", "x")
    check_resolvable("ipc:///tmp/x.sock", "x")


def test_an_api_directory_others_can_write_to_is_refused(tmp_path) -> None:
    d = tmp_path / "api"
    d.mkdir(mode=0o700)
    private_api_dir(f"ipc://{d}/a.sock")  # ours, private: fine
    os.chmod(d, 0o777)
    with pytest.raises(AgentError, match="writable by group or others"):
        private_api_dir(f"ipc://{d}/a.sock")
    os.chmod(d, 0o700)
    (d / "a.sock").write_text("not a socket")
    with pytest.raises(AgentError, match="not this user's socket"):
        private_api_dir(f"ipc://{d}/a.sock")
    fresh = tmp_path / "new" / "deeper"
    private_api_dir(f"ipc://{fresh}/a.sock")
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_an_api_directory_of_another_user_is_refused(tmp_path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)  # nobody
    with pytest.raises(AgentError, match="belongs to uid 65534"):
        private_api_dir(f"ipc://{d}/a.sock")


def test_incarnations_never_go_back(tmp_path) -> None:
    now = [EPOCH + 1_000_000.0]
    first = next_incarnation(tmp_path, "gpu0", lambda: now[0])
    assert first == 1_000_000
    now[0] -= 3600  # the clock steps back an hour
    second = next_incarnation(tmp_path, "gpu0", lambda: now[0])
    assert second == first + 1
    now[0] = EPOCH + 10.0  # far back, as a wrap of a millisecond counter would look
    assert next_incarnation(tmp_path, "gpu0", lambda: now[0]) == second + 1
    now[0] = EPOCH + 2_000_000.0  # and forward again: the clock wins
    assert next_incarnation(tmp_path, "gpu0", lambda: now[0]) == 2_000_000
    assert stat.S_IMODE(os.stat(tmp_path / "gpu0.incarnation").st_mode) == 0o600
    # Without its file (a new disk) it still grows with the clock.
    os.unlink(tmp_path / "gpu0.incarnation")
    now[0] += 5
    assert next_incarnation(tmp_path, "gpu0", lambda: now[0]) == 2_000_005


def test_a_damaged_or_unwritable_state_is_one_line(tmp_path) -> None:
    (tmp_path / "gpu0.incarnation").write_text("garbage")
    with pytest.raises(IncarnationError, match="is damaged"):
        next_incarnation(tmp_path, "gpu0")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(IncarnationError, match="^state_dir: cannot keep"):
        next_incarnation(blocked / "sub", "gpu0")


def test_cli_agent_with_bad_settings_fails_in_one_line(tmp_path) -> None:
    import subprocess
    import sys

    cfile, names = write_cluster(tmp_path, 2)
    cfile.write_text(cfile.read_text().replace("heartbeat_s = 0.25", "heartbeat_s = 0.000001"))
    p = subprocess.run([sys.executable, "-m", "ark", "agent", "--cluster", str(cfile), "--host", names[0]],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cluster.heartbeat_s" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe\x00\x01", "١٢٣".encode(), "²".encode(), b"12 34", b"12\x00", b" \t\n", b"9" * 5000,
     b"1073741824", b"", b"-5", b"+5", b"0x10", b"1" * 10 + b" " * 100],
    ids=["not-utf8", "arabic-indic-digits", "superscript", "two-numbers", "nul", "only-whitespace", "huge",
         "over-30-bits", "empty", "negative", "plus-sign", "hex", "over-64-bytes"],
)
def test_a_damaged_incarnation_file_is_refused_in_one_line(tmp_path, content: bytes) -> None:
    """Never repaired: its value is unknown and may be above the clock (see ark.agent.incarnation)."""
    f = tmp_path / "gpu0.incarnation"
    f.write_bytes(content)
    with pytest.raises(IncarnationError) as e:
        next_incarnation(tmp_path, "gpu0", lambda: EPOCH + 10.0)
    msg = str(e.value)
    assert msg.startswith(f"state_dir: {f} is damaged") and "expected ASCII digits" in msg and "\n" not in msg, msg
    assert f.read_bytes() == content  # left as it was, for the operator to look at


def test_an_incarnation_file_that_is_not_a_file_is_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "gpu0.incarnation").mkdir()
    with pytest.raises(IncarnationError, match=r"^state_dir: .*gpu0.incarnation is not a regular file; expected"):
        next_incarnation(tmp_path, "gpu0")


def test_whitespace_around_the_incarnation_is_read(tmp_path) -> None:
    (tmp_path / "gpu0.incarnation").write_bytes(b"  123\n\n")
    assert next_incarnation(tmp_path, "gpu0", lambda: EPOCH + 10.0) == 124
