"""Fixtures for the chart tests: the real helm binary, or one skip line when it is missing."""

from __future__ import annotations

import pytest

from .chartlib import Helm, find_helm


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.skip("helm not found (.tools/bin/helm or PATH): run `make tools` to install it")
    return path


@pytest.fixture(scope="session")
def h(helm: str) -> Helm:
    return Helm(helm)
