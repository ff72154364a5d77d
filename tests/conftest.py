from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("default", max_examples=60, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="session")
def paper_fabric():
    from ark.core.topology import preset

    return preset("paper")
