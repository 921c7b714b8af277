"""Fixtures for the chart tests: the real helm binary, or one skip line when it is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.live_cluster import live_control_plane, skip_without_control_plane

from .chartlib import Helm, find_helm

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Without a control plane, the live tests here (marked e2e) report one skip line."""
    live = [i for i in items if Path(i.fspath).parent == _HERE and i.get_closest_marker("e2e")]
    skip_without_control_plane(config, items, live)


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.skip("helm not found (.tools/bin/helm or PATH): run `make tools` to install it")
    return path


@pytest.fixture(scope="session")
def h(helm: str) -> Helm:
    return Helm(helm)


@pytest.fixture(scope="session")
def live_cluster(tmp_path_factory):
    """A real control plane (tests/e2e's harness) for the chart tests that need an API
    server, with the CRD installed; skipped with one line without K8S_ASSETS/etcd."""
    yield from live_control_plane(tmp_path_factory.mktemp("chart-cp"))
