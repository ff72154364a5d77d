"""The steered Mooncake engine's rules that need no engine: the polled write against a
scripted stand-in for one (the real engine's polled writes are checked in test_mooncake.py):
what it returns, and that it never returns while a request may still read the caller's
buffers; and the warning for a release known to hang."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from ark.integrations import mooncake
from ark.integrations.mooncake import SteeredTransferEngine, hanging_release, polled_write
from ark.integrations.preload import PreloadError, loaded


class ScriptedEngine:
    """A stand-in engine: ``submit`` answers each submission in turn (a batch id, 0 for a
    refused one); ``states[batch]`` answers that batch's status checks in turn, the last
    answer repeated."""

    def __init__(self, submit: list[int], states: dict[int, list[int]]) -> None:
        self.submit, self.states = list(submit), {b: list(s) for b, s in states.items()}
        self.submitted: list[tuple[str, int, int, int, str]] = []
        self.checks: list[int] = []

    def transfer_submit_write(self, target: str, buf: int, peer: int, n: int, hint: str = "") -> int:
        self.submitted.append((target, buf, peer, n, hint))
        return self.submit.pop(0)

    def transfer_check_status(self, batch: int) -> int:
        self.checks.append(batch)
        answers = self.states[batch]
        return answers.pop(0) if len(answers) > 1 else answers[0]



def test_each_request_is_submitted_on_its_own_and_polled_until_done() -> None:
    eng = ScriptedEngine([11, 12, 13], {11: [0, 1], 12: [0, 0, 0, 1], 13: [1]})
    assert polled_write(eng, "10.0.1.1:15100", [100, 200, 300], [1000, 2000, 3000], [10, 20, 30], "", 0.0005) == 0
    assert eng.submitted == [("10.0.1.1:15100", 100, 1000, 10, ""), ("10.0.1.1:15100", 200, 2000, 20, ""),
                             ("10.0.1.1:15100", 300, 3000, 30, "")]
    assert eng.checks.count(12) == 4 and eng.checks.count(11) == 2 and eng.checks.count(13) == 1


def test_a_failed_request_fails_the_write_only_after_the_others_have_ended() -> None:
    # 21 fails at once; 22 is still reading the caller's buffer for three more checks.
    eng = ScriptedEngine([21, 22], {21: [-1], 22: [0, 0, 0, 1]})
    assert polled_write(eng, "h:1", [1, 2], [3, 4], [5, 6], "", 0.0005) == -1
    assert eng.checks.count(22) == 4 and eng.checks.count(21) == 1  # the failed one is not asked again


def test_a_refused_submission_stops_submitting_and_waits_for_those_in_flight() -> None:
    eng = ScriptedEngine([31, 0, 33], {31: [0, 1]})
    assert polled_write(eng, "h:1", [1, 2, 3], [4, 5, 6], [7, 8, 9], "", 0.0005) == -1
    assert len(eng.submitted) == 2 and eng.checks == [31, 31]


def test_the_time_limit_ends_a_write_whose_requests_never_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "TIMEOUT_S", 0.05)
    eng = ScriptedEngine([41], {41: [0]})
    assert polled_write(eng, "h:1", [1], [2], [3], "", 0.005) == -1
    assert 3 <= eng.checks.count(41) <= 40


def test_mismatched_lists_are_refused_before_anything_is_submitted() -> None:
    eng = ScriptedEngine([51], {51: [1]})
    assert polled_write(eng, "h:1", [1, 2], [3], [4, 5]) == -1 and eng.submitted == []


def test_a_release_known_to_hang_is_named_in_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    installed = {"mooncake-transfer-engine-non-cuda": "0.3.12.post1"}

    def version(dist: str) -> str:
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert hanging_release() is None
    installed["mooncake-transfer-engine-non-cuda"] = "0.3.13.post1"
    assert hanging_release() == "0.3.13.post1"
    del installed["mooncake-transfer-engine-non-cuda"]
    assert hanging_release() is None
    installed["mooncake-transfer-engine"] = "0.3.13"  # the CUDA build's name
    assert hanging_release() == "0.3.13"
    if loaded():
        pytest.skip("the interposer is preloaded here: the wrapper would be built, not refused")
    with caplog.at_level(logging.WARNING, "ark.integrations.mooncake"), pytest.raises(PreloadError):
        SteeredTransferEngine(engine=object(), agent=None, hosts={})
    assert any("mooncake-transfer-engine 0.3.13: its writes with one connection per request hang" in r.message
               for r in caplog.records)
