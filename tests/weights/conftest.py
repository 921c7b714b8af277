from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.fake_hub import FakeHub


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as h:
        yield h


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "weights"
    r.mkdir()
    return r
