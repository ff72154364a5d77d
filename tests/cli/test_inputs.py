"""Every bad path and size is one line naming its option, before any work starts.

In-process (``ark.cli.main``), with the sweep and the key writer replaced by functions that
fail the test: a refusal that comes after the work would reach them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ark.cli import common, main


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the work started before the input was checked")

    import ark.agent.keys
    import ark.sim.experiment

    monkeypatch.setattr(ark.sim.experiment, "run_sweep", boom)
    monkeypatch.setattr(ark.agent.keys, "create_keypair", boom)


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("ark: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("argv", "needles"), [
    (["compare", "--out", "/proc/nope"], ["--out", "/proc/nope", "cannot write"]),
    (["reproduce", "--out", "/proc/nope"], ["--out"]),
    (["compare", "--figures", "/proc/nope/figs"], ["--figures"]),
    (["race-window", "--out", "/proc/nope"], ["--out"]),
    (["polarisation", "--out", "/proc/nope"], ["--out"]),
    (["sweep", "--out", "/proc/nope"], ["--out"]),
    (["keygen", "--name", "gpu0", "--out", "/proc/k"], ["--out", "/proc/k"]),
    (["keygen", "--name", "../gpu0"], ["--name"]),
    (["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "4", "--save", "/proc/x.json"],
     ["--save", "/proc/x.json"]),
    (["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "40000"],
     ["--paths", "1..16384"]),
    (["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "16385"],
     ["--paths", "1..16384"]),
    (["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "11",
      "--port-range", "100-109"], ["--paths", "1..10"]),
    (["reproduce", "--requests", "2147483648"], ["--requests", "2,147,483,648", "GiB", "at most"]),
    (["bench", "control-plane", "--plot", "/proc/x.png", "--no-measure"], ["--plot"]),
])
def test_bad_paths_and_sizes_are_one_line_before_the_work(capsys, no_work, argv, needles) -> None:
    one_line(capsys, argv, *needles)


def test_an_output_folder_that_is_a_file_names_the_option(tmp_path, capsys, no_work) -> None:
    f = tmp_path / "taken"
    f.write_text("x")
    one_line(capsys, ["compare", "--out", str(f)], "--out", "is a file, not a folder")
    one_line(capsys, ["testbed", "run", "--out", str(tmp_path)], "--out", "is a folder, not a file")


def test_a_large_sweep_is_sized_before_it_starts(monkeypatch, capsys) -> None:
    from ark.sim.config import default

    cfg = default().with_overrides(requests=100_000_000)
    monkeypatch.setattr(common, "available_memory", lambda: 24 << 30)
    with pytest.raises(Exception, match=r"100,000,000 requests per run need about 476\.9 GiB") as e:
        common.check_sweep_size(cfg, 2)
    assert type(e.value).__name__ == "BadParameter"
    monkeypatch.setattr(common, "available_memory", lambda: 4 << 40)  # a machine that holds it
    note = common.check_sweep_size(cfg, 2)
    assert note is not None and note.startswith("estimate: 84 runs of 100,000,000 requests on 2 workers") and " h " in note
    with pytest.raises(Exception, match="--jobs 6"):  # each run fits, eight at once do not
        monkeypatch.setattr(common, "available_memory", lambda: 3 << 40)
        common.check_sweep_size(cfg, 8)
    assert common.check_sweep_size(default(), 2) is None  # the default sweep: seconds, nothing said


def test_pathmap_warns_when_some_paths_get_no_port(capsys) -> None:
    rc = main(["pathmap", "--hash", "crc32", "--src", "10.0.0.1", "--dst", "10.0.1.1", "--paths", "16384", "--json"])
    cap = capsys.readouterr()
    assert rc == 0 and "paths got no source port" in cap.err
    d = json.loads(cap.out)
    empty = sum(1 for v in d["ports"].values() if not v)
    assert f"ark: warning: {empty} of 16384 paths" in cap.err


def test_keygen_writes_where_it_was_told(tmp_path, capsys) -> None:
    assert main(["keygen", "--name", "gpu0", "--out", str(tmp_path / "k" / "deeper")]) == 0
    assert (Path(tmp_path) / "k" / "deeper" / "gpu0.key_secret").is_file()
