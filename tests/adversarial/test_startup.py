"""Every refusal of ``ark agent`` to start: one line on stderr, a non-zero exit, no traceback.

Each case sets up its own directory (cluster file, keys, state) so that exactly one thing
is wrong, then runs the real CLI in a subprocess. The cases run at once (they only start
and fail), each test checks its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ark.agent.loopback import free_ports, write_cluster

Case = Callable[[Path, Path], tuple[list[str], str, list[Any]]]  # (dir, cluster file) -> (args, expected, held)


def _edit(cfile: Path, old: str, new: str) -> None:
    text = cfile.read_text()
    assert old in text, old
    cfile.write_text(text.replace(old, new, 1))


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _no_secret_key(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    _edit(c, 'secret_key_file = "keys/gpu0.key_secret"\n', "")
    return [], "secret_key_file: not set for gpu0; give --secret-key", []


def _wrong_secret_key(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    return ["--secret-key", str(d / "keys" / "gpu1.key_secret")], "does not match gpu0's public_key", []


def _missing_secret_key(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    return ["--secret-key", str(d / "nosuch")], f"secret_key_file: cannot read {d / 'nosuch'}", []


def _junk_secret_key(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    (d / "junk").write_bytes(b"\xff\xfe not a key \x00")
    return ["--secret-key", str(d / "junk")], f"secret_key_file: cannot read {d / 'junk'}", []


def _unresolvable_peer(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    text = c.read_text()
    k = text.index("tcp://127.0.0.1:", text.index('name = "gpu1"'))
    c.write_text(text[:k] + "tcp://no-such-host.invalid:" + text[k + len("tcp://127.0.0.1:"):])
    return [], "hosts[1].control: cannot resolve tcp://no-such-host.invalid:", []


def _damaged_incarnation(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    (d / "state").mkdir(mode=0o700)
    (d / "state" / "gpu0.incarnation").write_bytes(b"\xff\xfe12")
    return [], f"state_dir: {d / 'state' / 'gpu0.incarnation'} is damaged", []


def _state_dir_is_a_file(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    (d / "state").write_text("")
    return [], f"state_dir: cannot keep {d / 'state' / 'gpu0.incarnation'}", []


def _api_dir_open_to_others(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    os.chmod(d / "api", 0o777)
    return [], f"api: {d / 'api'} is writable by group or others (mode 777); make it 0700", []


def _api_dir_not_creatable(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    (d / "file").write_text("")
    _edit(c, f"ipc://{d}/api/gpu0.sock", f"ipc://{d}/file/sub/gpu0.sock")
    return [], f"api: cannot create {d / 'file' / 'sub'}", []


def _api_path_not_a_socket(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    (d / "api" / "gpu0.sock").write_text("")
    return [], f"api: {d / 'api' / 'gpu0.sock'} exists and is not this user's socket", []


def _control_port_taken(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    text = c.read_text()
    k = text.index("tcp://127.0.0.1:") + len("tcp://127.0.0.1:")
    port = int(text[k:text.index('"', k)])
    return [], f"control: cannot bind tcp://127.0.0.1:{port}: Address already in use", [_listening(port)]


def _metrics_port_taken(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    port = free_ports(1)[0]
    _edit(c, 'secret_key_file = "keys/gpu0.key_secret"\n', f'secret_key_file = "keys/gpu0.key_secret"\nmetrics_port = {port}\n')
    return [], f"metrics_port: cannot listen on 127.0.0.1:{port} (Address already in use)", [_listening(port)]


def _cluster_not_text(d: Path, c: Path) -> tuple[list[str], str, list[Any]]:
    c.write_bytes(b"\xff" + c.read_bytes())
    return [], f"cluster: {c} is not UTF-8 text", []


CASES: dict[str, Case] = {f.__name__.lstrip("_"): f for f in (
    _no_secret_key, _wrong_secret_key, _missing_secret_key, _junk_secret_key, _unresolvable_peer,
    _damaged_incarnation, _state_dir_is_a_file, _api_dir_open_to_others, _api_dir_not_creatable,
    _api_path_not_a_socket, _control_port_taken, _metrics_port_taken, _cluster_not_text,
)}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.CompletedProcess[str], str]]]:
    """Every case's agent, started at once; their exits and what each should say."""
    held: list[Any] = []
    running: dict[str, tuple[subprocess.Popen[str], str]] = {}
    try:
        for name, case in CASES.items():
            d = tmp_path_factory.mktemp(name)
            (d / "api").mkdir(mode=0o700)
            cfile, _ = write_cluster(d, 2)
            args, expected, keep = case(d, cfile)
            held += keep
            cmd = [sys.executable, "-m", "ark", "agent", "--cluster", str(cfile), "--host", "gpu0", *args]
            running[name] = (subprocess.Popen(cmd, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                             expected)
        done = {}
        for name, (p, expected) in running.items():
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # it started: the case did not make it refuse
                p.kill()
                out, err = p.communicate()
            done[name] = (subprocess.CompletedProcess(p.args, p.returncode, out, err), expected)
        yield done
    finally:
        for p, _ in running.values():
            if p.poll() is None:
                p.kill()
        for s in held:
            s.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_start_is_one_line(refusals, case: str) -> None:
    p, expected = refusals[case]
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("ark: error: ") and expected in p.stderr, p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_an_api_directory_of_another_user_is_a_one_line_refusal(tmp_path) -> None:
    (tmp_path / "api").mkdir(mode=0o755)
    os.chown(tmp_path / "api", 65534, 65534)
    cfile, _ = write_cluster(tmp_path, 2)
    p = subprocess.run([sys.executable, "-m", "ark", "agent", "--cluster", str(cfile), "--host", "gpu0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"api: {tmp_path / 'api'} belongs to uid 65534" in p.stderr, p.stderr
