"""Items 3, 4 (operator side) and 8: what goes wrong, and that the operator says so and recovers."""

from __future__ import annotations

import copy
import time

from e2e_harness.control_plane import is_write
from e2e_harness.expect import children_present
from e2e_harness.kube import eventually, load_sample
from e2e_harness.operator_process import OperatorProcess, RenderedChart, install_operator_identity
from kubernetes import client

from .conftest import OPERATOR_NAMESPACE, TIMINGS


def test_model_larger_than_any_node_is_pending_with_the_schedulers_reason(
    operator, models, namespace, control_plane, operator_user
):
    body = load_sample("chat-small.yaml", namespace, new_name="too-big")
    body["spec"].update({"resources": {"gpus": 16}, "parallelism": {"tensor": 16}})
    models.create(body)

    def explained():
        status = models.get(namespace, "too-big").get("status") or {}
        text = " ".join(
            [status.get("message") or ""]
            + [c.get("message", "") for c in status.get("conditions", [])]
        )
        return (
            status.get("phase") in ("Progressing", "Degraded", "Pending")
            and "nvidia.com/gpu" in text
            and status
        )

    status = eventually(explained, timeout=30, message="status to carry the scheduler's reason")
    print(status)
    (pod,) = models.pods(namespace, "too-big")
    assert pod.status.phase == "Pending"
    # No crash loop and no retry storm: once the status says why, the operator lives and
    # (nearly) stops writing while the pod waits for GPUs that will not come.
    time.sleep(3)
    mark = control_plane.audit_mark()
    time.sleep(10)
    operator.process.check_alive()
    writes = [
        e
        for e in control_plane.audit_events(operator_user, since=mark)
        if is_write(e) and e.get("objectRef", {}).get("namespace") == namespace
    ]
    assert len(writes) <= 1, [(e["verb"], e["objectRef"]) for e in writes]


def _without_cel(schema: dict) -> dict:
    """The schema with every CEL rule removed (an API server from before the rules)."""
    if isinstance(schema, dict):
        return {k: _without_cel(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if isinstance(schema, list):
        return [_without_cel(v) for v in schema]
    return schema


def test_spec_the_api_server_accepts_but_the_operator_rejects(
    operator, admin, crd, models, namespace
):
    """An object stored before the CEL rules existed (or on a server without CEL) must still
    get SpecValid=False and an Event, not a broken Deployment and not a retry storm."""
    ext = client.ApiextensionsV1Api(admin)
    name = crd["metadata"]["name"]
    original = ext.read_custom_resource_definition(name)
    relaxed = copy.deepcopy(crd)
    relaxed["spec"] = _without_cel(relaxed["spec"])
    relaxed["metadata"]["resourceVersion"] = original.metadata.resource_version
    ext.replace_custom_resource_definition(name, relaxed)
    body = load_sample("chat-small.yaml", namespace, new_name="bad-tp")
    body["spec"].update({"resources": {"gpus": 4}, "parallelism": {"tensor": 3}})
    try:
        # The relaxed schema takes a moment to reach the API server's validators.
        eventually(
            lambda: models.create(body),
            timeout=15,
            message="the relaxed CRD to accept TP 3 on 4 GPUs",
        )
    finally:
        current = ext.read_custom_resource_definition(name)
        restored = copy.deepcopy(crd)
        restored["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, restored)

    def rejected():
        cond = models.condition(namespace, "bad-tp", "SpecValid")
        return cond and cond["status"] == "False" and cond

    cond = eventually(rejected, timeout=20, message="SpecValid=False")
    assert "parallelism.tensor" in cond["message"] and "resources.gpus" in cond["message"], cond
    assert (models.get(namespace, "bad-tp").get("status") or {}).get("phase") == "Failed"
    events = eventually(
        lambda: models.events_for(namespace, "bad-tp"), message="an Event on the StreamingModel"
    )
    assert any(e.type == "Warning" and "parallelism.tensor" in (e.message or "") for e in events), [
        (e.type, e.reason, e.message) for e in events
    ]
    assert models.children(namespace, "bad-tp")["Deployment"] is None


def test_operator_restart_mid_rollout_resumes_without_duplicates(
    operator, models, namespace, gpu_node
):
    names = [f"m{i}" for i in range(4)]
    for n in names:
        models.create(load_sample("chat-small.yaml", namespace, new_name=n))
    # Stop the operator as soon as it has made the first Deployment: the others are half done.
    eventually(
        lambda: models.apps.list_namespaced_deployment(namespace).items,
        timeout=20,
        message="the first Deployment",
    )
    operator.process.proc.kill()  # no graceful shutdown: as if the node died
    operator.process.proc.wait()
    made_before = len(models.apps.list_namespaced_deployment(namespace).items)
    # An edit lands while no operator runs.
    models.patch(
        namespace, "m0", {"spec": {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}}}
    )
    started = time.monotonic()
    operator.start()

    def all_converged():
        for n in names:
            model = models.get(namespace, n)
            if not children_present(models.children(namespace, n), model["spec"]):
                return False
            if (model.get("status") or {}).get("observedGeneration") != model["metadata"][
                "generation"
            ]:
                return False
        return True

    eventually(all_converged, timeout=30, message="every model to converge after the restart")
    TIMINGS["restart mid-rollout -> all converged (s)"] = round(time.monotonic() - started, 2)
    print(f"{made_before} of {len(names)} Deployments existed when the operator was killed")
    for kind, items in (
        ("Deployment", models.apps.list_namespaced_deployment(namespace).items),
        ("Service", models.core.list_namespaced_service(namespace).items),
    ):
        assert sorted(o.metadata.name for o in items) == names, kind
        for o in items:
            assert len(o.metadata.owner_references) == 1, (kind, o.metadata.owner_references)
    dep = models.apps.read_namespaced_deployment("m0", namespace)
    assert dep.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"


def test_rbac_gap_in_the_chart_fails_visibly(operator, admin, control_plane, models, namespace):
    """Negative control for the harness: the same chart with one verb fewer (no `patch` on
    Deployments) must not converge, and the API server must have refused the operator."""
    narrow = RenderedChart.render(OPERATOR_NAMESPACE, release="narrow")
    for role in narrow.of_kind("ClusterRole", "Role"):
        for rule in role.get("rules") or []:
            if "deployments" in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    kubeconfig = install_operator_identity(admin, control_plane, narrow)
    ns, sa = narrow.service_account()
    user = f"system:serviceaccount:{ns}:{sa}"  # audited: its namespace is the operator's
    operator.stop()  # one operator at a time on the same objects
    narrow_op = OperatorProcess(narrow, kubeconfig, control_plane.logs, name="narrow-operator")
    try:
        narrow_op.start()
        mark = control_plane.audit_mark()
        models.create(load_sample("chat-small.yaml", namespace))

        def refused():
            return [
                e
                for e in control_plane.audit_events(user, since=mark)
                if e["responseStatus"]["code"] == 403
                and e["objectRef"].get("resource") == "deployments"
            ]

        denials = eventually(
            refused, timeout=20, message="the API server to refuse the Deployment patch"
        )
        assert denials[0]["verb"] == "patch"
        assert models.children(namespace, "chat-small")["Deployment"] is None
    finally:
        narrow_op.stop()
        operator.start()
