"""50 StreamingModels applied at once all converge; how long, and at what API cost.

The operator reads from memory (its watches' indexes), so the cost is its writes: at most
`CALL_BUDGET` calls per model in all, and none at all on a resync once every model is settled.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_harness.control_plane import is_write
from e2e_harness.expect import expected_kinds
from e2e_harness.kube import eventually, load_sample
from e2e_harness.node_agent import NodeAgent

from .conftest import TIMINGS

COUNT = 50
CALL_BUDGET = 15  # operator API calls per model, reads and writes, from apply to all Ready
RESYNC_SECONDS = 2
SETTLED_RESYNCS = 12  # an hour of resyncs at the default --resync-seconds 300

pytestmark = pytest.mark.slow


@pytest.fixture
def more_gpu_nodes(admin, gpu_node):
    """Enough GPUs for every model to run: 7 more nodes x 8 GPUs next to the first."""
    nodes = [NodeAgent(admin, f"gpu-node-{i}", gpus=8).start() for i in range(1, 8)]
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture
def fast_resync(operator):
    """The session's operator restarted with a short resync, and restored after."""
    flag = f"--resync-seconds={RESYNC_SECONDS}"
    operator.argv.append(flag)
    operator.restart()
    try:
        yield operator
    finally:
        operator.argv.remove(flag)
        operator.restart()


def _in(namespace: str, events: list[dict]) -> list[dict]:
    return [e for e in events if (e.get("objectRef") or {}).get("namespace") == namespace]


def _what(event: dict) -> str:
    """'verb resource[/subresource]' of an audit event (discovery calls have no objectRef)."""
    ref = event.get("objectRef") or {}
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{event['verb']} {ref.get('resource', event.get('requestURI', '?'))}{sub}"


def _present(models, namespace: str) -> dict[str, set[str]]:
    """Child kind -> names present, from one list call per kind."""
    return {
        "Deployment": {
            o.metadata.name for o in models.apps.list_namespaced_deployment(namespace).items
        },
        "Service": {o.metadata.name for o in models.core.list_namespaced_service(namespace).items},
        "HorizontalPodAutoscaler": {
            o.metadata.name
            for o in models.autoscaling.list_namespaced_horizontal_pod_autoscaler(namespace).items
        },
        "PodDisruptionBudget": {
            o.metadata.name
            for o in models.policy.list_namespaced_pod_disruption_budget(namespace).items
        },
        "Ingress": {
            o.metadata.name for o in models.networking.list_namespaced_ingress(namespace).items
        },
    }


# more_gpu_nodes comes before namespace: fixtures are torn down in reverse, so the nodes'
# kubelets are still there to remove the pods when the namespace goes.
def test_fifty_models_converge(
    fast_resync, models, admin, more_gpu_nodes, namespace, control_plane, operator_user
):
    bodies = []
    for i in range(COUNT):
        body = load_sample("chat-small.yaml", namespace, new_name=f"model-{i:02d}")
        body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2}  # HPA + PDB too
        bodies.append(body)
    want = expected_kinds(bodies[0]["spec"])
    mark = control_plane.audit_mark()
    applied: dict[str, float] = {}

    def apply(body):
        models.create(body)
        applied[body["metadata"]["name"]] = time.monotonic()

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(apply, bodies))
    apply_seconds = time.monotonic() - began

    converged: dict[str, float] = {}

    def all_converged() -> bool:
        present = _present(models, namespace)
        now = time.monotonic()
        for name in applied:
            if name not in converged and all(name in present[k] for k in want):
                converged[name] = now - applied[name]
        return len(converged) == COUNT

    eventually(all_converged, timeout=180, interval=0.2,
               message=lambda: f"all converged: only {len(converged)} of {COUNT}")  # fmt: skip
    all_children = time.monotonic() - began

    def all_ready():
        items = models.custom.list_namespaced_custom_object(
            "serving.sluice.dev", "v1alpha1", namespace, "streamingmodels"
        )["items"]
        return sum((m.get("status") or {}).get("phase") == "Ready" for m in items) == COUNT

    eventually(all_ready, timeout=180, interval=1, message=f"all {COUNT} models Ready")
    all_ready_seconds = time.monotonic() - began
    time.sleep(2)
    calls = [
        e
        for e in control_plane.audit_events(operator_user, since=mark)
        if e.get("objectRef", {}).get("namespace") in (namespace, None)
    ]
    writes = [e for e in calls if is_write(e)]
    by_kind = Counter(_what(e) for e in writes)
    latencies = sorted(converged.values())
    TIMINGS["50 models: create calls took (s)"] = round(apply_seconds, 2)
    TIMINGS["50 models: machine load average (1 min) at the end"] = round(os.getloadavg()[0], 1)
    TIMINGS["50 models: apply -> all children present, per model (s)"] = (
        f"median {statistics.median(latencies):.2f}, worst {latencies[-1]:.2f}"
    )
    TIMINGS["50 models: first apply -> last model's children / all Ready (s)"] = (
        f"{all_children:.1f} / {all_ready_seconds:.1f}"
    )
    TIMINGS["50 models: operator API calls per model (writes / all)"] = (
        f"{len(writes) / COUNT:.1f} / {len(calls) / COUNT:.1f}"
    )
    TIMINGS["50 models: operator writes by verb and resource"] = dict(by_kind)
    reads = Counter(_what(e) for e in calls if not is_write(e))
    TIMINGS["50 models: operator reads by verb and resource"] = dict(reads.most_common(8))
    assert len(calls) <= CALL_BUDGET * COUNT, (
        f"{len(calls) / COUNT:.1f} operator API calls per model (budget {CALL_BUDGET}): "
        f"writes {dict(by_kind)}, reads {dict(reads)}"
    )

    # Settled: resyncs converge every model from memory and make no call in the namespace.
    # First the HPA controller's first evaluation of every HPA (within its 15 s sync period),
    # which the operator mirrors into the status: a real change, not the resync's.
    def hpas_mirrored():
        items = models.custom.list_namespaced_custom_object(
            "serving.sluice.dev", "v1alpha1", namespace, "streamingmodels"
        )["items"]
        return all("message" in (m.get("status") or {}).get("autoscaling", {}) for m in items)

    eventually(
        hpas_mirrored, timeout=60, interval=1, message="every HPA's first evaluation mirrored"
    )
    time.sleep(2)
    settled = control_plane.audit_mark()
    log_before = fast_resync.log_text().count("resync: ")
    eventually(
        lambda: fast_resync.log_text().count("resync: ") - log_before >= SETTLED_RESYNCS,
        timeout=SETTLED_RESYNCS * RESYNC_SECONDS * 3,
        interval=0.5,
        message=f"{SETTLED_RESYNCS} resyncs",
    )
    resync_calls = _in(namespace, control_plane.audit_events(operator_user, since=settled))
    TIMINGS[
        f"50 models: operator calls in the namespace over {SETTLED_RESYNCS} settled resyncs"
    ] = len(resync_calls)
    assert resync_calls == [], Counter(_what(e) for e in resync_calls)
    # Negative control: the same counting sees the calls a change causes (a hand edit of
    # one Service, put back by the operator).
    from kubernetes import client

    changed = control_plane.audit_mark()
    core = client.CoreV1Api(admin)
    hand_edit = [{"op": "replace", "path": "/spec/ports/0/appProtocol", "value": "grpc"}]
    core.patch_namespaced_service("model-00", namespace, hand_edit)  # a JSON patch
    eventually(
        lambda: (
            core.read_namespaced_service("model-00", namespace).spec.ports[0].app_protocol == "http"
        ),
        timeout=30,
        message="the operator to restore the hand-edited Service",
    )
    restore_calls = _in(namespace, control_plane.audit_events(operator_user, since=changed))
    assert any(is_write(e) for e in restore_calls), Counter(_what(e) for e in restore_calls)
