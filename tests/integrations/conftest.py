"""Fixtures shared by the interposers' tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ark.agent.loopback import AgentProcs, write_cluster
from ark.integrations import verbs, verbs_standin
from ark.integrations.preload import PreloadError


@pytest.fixture(scope="module")
def built() -> tuple[Path, Path]:
    """(the verbs interposer, the stand-in libibverbs folder); skipped in one line without a
    compiler or verbs.h."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler (cc/gcc): the verbs interposer cannot be built")
    try:
        return verbs.library(), verbs_standin.build()
    except (verbs.VerbsError, PreloadError) as e:
        pytest.skip(f"verbs interposer not built: {e}")


@contextmanager
def two_agents(tmp_path: Path, lease_min_s: float) -> Iterator[str]:
    """Two real agents on loopback, gpu1 behind another leaf than gpu0: gpu0's local API."""
    (tmp_path / "api").mkdir()
    cfile, names = write_cluster(tmp_path, 2, lease_min_s=lease_min_s, heartbeat_s=0.1)
    procs = AgentProcs(cfile, names, tmp_path)
    for n in names:
        procs.start(n)
    try:
        procs.wait_ready(names)
        yield procs.api("gpu0")
    finally:
        procs.stop_all()
