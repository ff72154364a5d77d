"""Fixtures shared by the verbs interposer's tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
