"""Session fixtures: one control plane, one fake GPU node and one operator for the whole suite.

Without the Kubernetes binaries (K8S_ASSETS) or etcd every test here is skipped with one
line saying how to provide them, so `make test` stays green on machines without them.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
from kubernetes import client, config, utils
from testkit.live_cluster import skip_without_control_plane

from .harness.control_plane import ControlPlane
from .harness.fake_node import FakeGpuNode
from .harness.kube import CRD_FILE, Models, eventually
from .harness.operator_process import OperatorProcess, RenderedChart, install_operator_identity

OPERATOR_NAMESPACE = "sluice-system"
TIMINGS: dict[str, object] = {}
_E2E_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _E2E_DIR in Path(item.fspath).parents]
    for item in mine:
        item.add_marker(pytest.mark.e2e)
    # One clear line in the summary instead of one per test.
    skip_without_control_plane(config, items, mine)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "e2e timings")
        for key, value in TIMINGS.items():
            terminalreporter.write_line(f"{key}: {value}")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    workdir = Path(os.environ.get("SLUICE_E2E_WORKDIR") or tmp_path_factory.mktemp("control-plane"))
    cp = ControlPlane(
        workdir, Path(os.environ["K8S_ASSETS"]), audited_namespace=OPERATOR_NAMESPACE
    ).start()
    TIMINGS["control plane start-up (s)"] = round(cp.startup_seconds, 2)
    TIMINGS["logs"] = str(cp.logs)
    pids = cp.pids()
    try:
        yield cp
    finally:
        cp.stop()
        strays = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        (workdir / "timings.json").write_text(json.dumps(TIMINGS, indent=2))
        assert not strays, f"control-plane processes left running: {strays}"


@pytest.fixture(scope="session")
def admin(control_plane) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(
        str(control_plane.kubeconfigs["admin"]), client_configuration=configuration
    )
    configuration.connection_pool_maxsize = 32  # tests apply from a thread pool
    api = client.ApiClient(configuration)
    # The default namespace's ServiceAccount is made by the controller manager; pods need it.
    eventually(
        lambda: client.CoreV1Api(api).read_namespaced_service_account("default", "default"),
        timeout=30,
        message="the default ServiceAccount",
    )
    return api


@pytest.fixture(scope="session")
def models(admin) -> Models:
    return Models(admin)


@pytest.fixture(scope="session")
def crd(admin) -> dict:
    """The CRD from crds/ (the file the chart ships), installed and served."""
    import yaml

    body = yaml.safe_load(CRD_FILE.read_text())
    utils.create_from_dict(admin, body)
    ext = client.ApiextensionsV1Api(admin)

    def established():
        got = ext.read_custom_resource_definition(body["metadata"]["name"])
        return any(
            c.type == "Established" and c.status == "True" for c in got.status.conditions or []
        )

    eventually(established, timeout=30, message="the CRD to be Established")
    return body


@pytest.fixture(scope="session")
def gpu_node(admin):
    node = FakeGpuNode(admin, "gpu-node-0", gpus=8).start()
    core = client.CoreV1Api(admin)

    def schedulable():
        n = core.read_node(node.name)
        return not any(t.effect == "NoSchedule" for t in n.spec.taints or [])

    # The node lifecycle controller removes the not-ready taint once it sees the heartbeat.
    eventually(schedulable, timeout=30, message="the fake GPU node to lose its not-ready taint")
    yield node
    node.stop()
    if node.errors:  # relists after a watch expired are normal; many of them are not
        warnings.warn(
            f"fake kubelet {node.name}: {len(node.errors)} errors, last: {node.errors[-1]}",
            stacklevel=1,
        )


@pytest.fixture(scope="session")
def chart() -> RenderedChart:
    return RenderedChart.render(OPERATOR_NAMESPACE)


@pytest.fixture(scope="session")
def operator(control_plane, admin, crd, gpu_node, chart):
    kubeconfig = install_operator_identity(admin, control_plane, chart)
    op = OperatorProcess(chart, kubeconfig, control_plane.logs).start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="session")
def operator_user(chart) -> str:
    ns, sa = chart.service_account()
    return f"system:serviceaccount:{ns}:{sa}"


@pytest.fixture
def namespace(admin, request):
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower())[:40].strip(
        "-"
    )
    name = f"e2e-{slug}-{uuid.uuid4().hex[:5]}"
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    eventually(
        lambda: core.read_namespaced_service_account("default", name),
        timeout=30,
        message=f"the default ServiceAccount in {name}",
    )
    yield name
    core.delete_namespace(name)
    # Pods hold GPUs of the shared fake node: wait until the fake kubelet has removed them.
    eventually(
        lambda: not core.list_namespaced_pod(name).items,
        timeout=60,
        message=f"pods of namespace {name} to be gone",
    )


@pytest.fixture
def stopwatch():
    return time.monotonic
