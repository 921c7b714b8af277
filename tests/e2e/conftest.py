"""Session fixtures: one control plane, one fake GPU node and one operator for the whole suite.

Without the Kubernetes binaries (K8S_ASSETS) or etcd every test here is skipped with one
line saying how to provide them, so `make test` stays green on machines without them.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
from e2e_harness.control_plane import ControlPlane
from e2e_harness.ingress import IngressController
from e2e_harness.kube import CRD_FILE, Models, eventually
from e2e_harness.node_agent import NodeAgent
from e2e_harness.operator_process import OperatorProcess, RenderedChart, install_operator_identity
from e2e_harness.sandbox import sandbox_problem
from kubernetes import client, config, utils
from testkit.live_cluster import skip_without_control_plane

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
    node = NodeAgent(admin, "gpu-node-0", gpus=8).start()
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


# --- live pods: node agents that run pods under bubblewrap, an ingress that follows them ---
LIVE_LABEL = "sluice.dev/e2e-live"


@pytest.fixture(scope="session")
def ingress(control_plane, admin):
    """One nginx for the session, configured from every Ingress of class nginx."""
    try:
        ctl = IngressController(admin, control_plane.workdir / "ingress").start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        yield ctl
    finally:
        ctl.stop()
        if ctl.errors:
            warnings.warn(
                f"ingress: {len(ctl.errors)} errors, last: {ctl.errors[-1]}", stacklevel=1
            )


@pytest.fixture
def live_nodes(admin, control_plane):
    """`make(n, cpus=None) -> (agents, placement)`: n live node agents that only the pods
    with `placement` (nodeSelector + toleration of their taint) land on."""
    if reason := sandbox_problem():
        pytest.skip(reason)
    created: list[NodeAgent] = []
    core = client.CoreV1Api(admin)

    def make(n: int = 1, cpus: set[int] | None = None) -> tuple[list[NodeAgent], dict]:
        pool = f"live-{uuid.uuid4().hex[:6]}"
        taint = {"key": LIVE_LABEL, "value": pool, "effect": "NoSchedule"}
        agents = []
        for i in range(n):
            agent = NodeAgent(admin, f"{pool}-{i}", gpus=8, cpu="16", taint=taint,
                              labels={LIVE_LABEL: pool}, run_pods=True, cpus=cpus,
                              workdir=control_plane.workdir / "live" / f"{pool}-{i}").start()  # fmt: skip
            created.append(agent)
            agents.append(agent)
        for agent in agents:
            eventually(lambda a=agent: all(t.key == LIVE_LABEL for t in
                                           core.read_node(a.name).spec.taints or []),
                       timeout=30, message=f"{agent.name} to lose its not-ready taint")  # fmt: skip
        placement = {
            "nodeSelector": {LIVE_LABEL: pool},
            "tolerations": [{"key": LIVE_LABEL, "operator": "Equal", "value": pool,
                             "effect": "NoSchedule"}],
        }  # fmt: skip
        return agents, placement

    yield make
    for agent in created:
        agent.stop()
        if agent.errors:
            warnings.warn(f"{agent.name}: {len(agent.errors)} errors, last: {agent.errors[-1]}",
                          stacklevel=1)  # fmt: skip


class Footprint:
    """Peak RSS of the test process and everything it started (control plane, operator,
    pods, ingress, client), sampled every 0.5 s, and the wall time."""

    def __init__(self) -> None:
        self.peak = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.5):
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(timeout=5)
        return f"{time.monotonic() - self.started:.0f} s, peak RSS {self.peak / 2**30:.2f} GiB"


@pytest.fixture
def live_router(admin, chart):
    """The chart's router (Deployment, Service, pin key) for live nodes: `start(placement,
    replicas, **pod_spec)` (live_helpers.LiveRouter); removed, its pods gone, after the test."""
    from .live_helpers import LiveRouter

    router = LiveRouter(admin, chart)
    yield router
    router.close()


@pytest.fixture
def footprint(request):
    """Use it in a scenario: its wall time and peak RSS land in the e2e timings."""
    f = Footprint()
    yield f
    TIMINGS[f"live: {request.node.name} (wall, peak RSS of the run's process tree)"] = f.stop()
