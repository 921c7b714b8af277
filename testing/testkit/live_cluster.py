"""A real control plane (tests/e2e's harness) for the suites outside tests/e2e that need an
API server: the StreamingModel CRD and any extra CRDs installed and Established. Skips with
one line without K8S_ASSETS and etcd (docs/e2e.md).

Every test that needs a control plane carries the `e2e` marker (tests/e2e marks its own at
collection), so `pytest tests -m e2e` (`make test-e2e`) runs all of them."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SLUICE_CRD = "streamingmodels.serving.sluice.dev"


def skip_without_control_plane(config: pytest.Config, items: list, live: list) -> None:
    """For a `pytest_collection_modifyitems` hook: when the control plane cannot start here,
    skip the first of `live` with the reason and deselect the rest, so a suite reports one
    line instead of one per test."""
    if not live:
        return
    reason: str | None
    try:
        from e2e_harness.control_plane import missing_prerequisites
    except ImportError:
        reason = "tests/e2e harness not present: live tests skipped"
    else:
        reason = missing_prerequisites()
    if reason:
        live[0].add_marker(pytest.mark.skip(reason=reason))
        rest = {id(i) for i in live[1:]}
        config.hook.pytest_deselected(items=live[1:])
        items[:] = [i for i in items if id(i) not in rest]


def live_control_plane(workdir: Path, extra_crds: tuple[dict, ...] = ()) -> Iterator[tuple]:
    """Generator for a fixture (`yield from`): yields (ControlPlane, admin ApiClient)."""
    harness = pytest.importorskip("e2e_harness.control_plane", reason="tests/e2e harness absent")
    if reason := harness.missing_prerequisites():
        pytest.skip(reason)
    import yaml
    from e2e_harness.kube import CRD_FILE, eventually
    from kubernetes import client, config, utils

    cp = harness.ControlPlane(
        workdir, Path(os.environ["K8S_ASSETS"]), audited_namespace="sluice-system"
    )
    try:
        cp.start()
        admin = config.new_client_from_config(config_file=str(cp.kubeconfigs["admin"]))
        utils.create_from_dict(admin, yaml.safe_load(CRD_FILE.read_text()))
        ext = client.ApiextensionsV1Api(admin)
        for crd in extra_crds:
            ext.create_custom_resource_definition(crd)

        def established(name: str) -> bool:
            conds = ext.read_custom_resource_definition(name).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conds)

        for name in (SLUICE_CRD, *(crd["metadata"]["name"] for crd in extra_crds)):
            eventually(functools.partial(established, name), timeout=30, message=name)
        yield cp, admin
    finally:
        cp.stop()
