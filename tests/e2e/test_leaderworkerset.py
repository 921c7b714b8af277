"""Models on several nodes per replica on the real API server, under the chart's RBAC, with
the official LeaderWorkerSet CRD (LWS v0.10.0, from the workplace's `shared/crds/lws/`;
skipped where that folder is absent, e.g. a user's clone).

No LWS controller runs here (only its CRD is installed): nothing creates the groups' pods,
and `.status` is written by the test where the controller would write it. What is tested is
what the operator does: without the CRD a condition and one Event while a one-node model in
the same namespace converges as before; once the CRD is installed the retry creates the LWS,
which the API server validates against the official schema; a spec change gives a new
template; the HPA scales the LWS through its scale subresource (whose selector is
`.status.hpaPodSelector`, written here as the controller would); nodes 2 -> 1 -> 2 replaces
the LWS with a Deployment and back, one at the end of each switch; deleting the model
garbage-collects the LWS.
"""

from __future__ import annotations

import pytest
import yaml
from e2e_harness.kube import eventually, load_sample
from kubernetes import client
from testkit.repo import LWS_CRD, shared_crd

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
CRD_NAME = f"{PLURAL}.{GROUP}"
TWO_NODES = {"tensor": 1, "pipeline": 2, "nodes": 2}

pytestmark = pytest.mark.skipif(
    shared_crd(LWS_CRD) is None,
    reason=f"the official LWS CRD ({LWS_CRD}) is not in a shared/crds/ folder above the checkout",
)


def _lws(admin, namespace, name):
    try:
        return client.CustomObjectsApi(admin).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _crd_exists(ext) -> bool:
    try:
        ext.read_custom_resource_definition(CRD_NAME)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _condition(models, namespace, name):
    status = models.get(namespace, name).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}.get("LeaderWorkerSetReady")


def _workloads(admin, models, namespace, name) -> set[str]:
    found = {"LeaderWorkerSet"} if _lws(admin, namespace, name) is not None else set()
    if models.children(namespace, name)["Deployment"] is not None:
        found.add("Deployment")
    return found


def _install_crd(ext) -> None:
    crd = yaml.safe_load(shared_crd(LWS_CRD).read_text())  # type: ignore[union-attr]
    ext.create_custom_resource_definition(crd)
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(CRD_NAME).status.conditions or []
        ),
        timeout=30,
        message="the LeaderWorkerSet CRD to be established",
    )


def test_leaderworkerset_lifecycle(operator, admin, models, namespace):
    ext = client.ApiextensionsV1Api(admin)
    custom = client.CustomObjectsApi(admin)
    body = load_sample("chat-small.yaml", namespace, new_name="big")
    body["spec"]["parallelism"] = dict(TWO_NODES)
    models.create(body)
    models.create(load_sample("chat-small.yaml", namespace, new_name="small"))

    # 1. No LWS: a condition and an Event; no Deployment for it; the one-node model is unaffected.
    cond = eventually(
        lambda: (c := _condition(models, namespace, "big")) and c["status"] == "False" and c,
        timeout=30,
        message="LeaderWorkerSetReady=False without the LWS CRD",
    )
    assert cond["reason"] == "CRDMissing" and "LWS v0.10 or later" in cond["message"]
    children = models.children(namespace, "big")
    assert children["Service"] is not None and children["Deployment"] is None
    assert children["Service"].spec.selector["serving.sluice.dev/role"] == "leader"
    eventually(
        lambda: models.children(namespace, "small")["Deployment"] is not None,
        timeout=30,
        message="the one-node model's Deployment",
    )
    assert _condition(models, namespace, "small") is None

    def warnings():
        return models.core.list_namespaced_event(
            namespace, field_selector="reason=LeaderWorkerSetUnavailable"
        ).items

    eventually(warnings, timeout=10, message="the LeaderWorkerSetUnavailable Event")
    operator.process.check_alive()  # no crash loop

    # 2. The official CRD appears: the retry creates the LWS and the API server accepts it.
    _install_crd(ext)
    try:
        lws = eventually(
            lambda: _lws(admin, namespace, "big"),
            timeout=60,
            interval=0.5,
            message="the LeaderWorkerSet after the CRD was installed",
        )
        group = lws["spec"]["leaderWorkerTemplate"]
        assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert lws["spec"]["startupPolicy"] == "LeaderCreated"
        assert lws["metadata"]["ownerReferences"][0]["kind"] == "StreamingModel"
        (worker,) = group["workerTemplate"]["spec"]["containers"]
        assert "$(LWS_WORKER_INDEX)" in worker["args"] and "readinessProbe" not in worker
        eventually(
            lambda: (c := _condition(models, namespace, "big")) and c["status"] == "True",
            timeout=30,
            message="LeaderWorkerSetReady=True",
        )
        assert warnings() and len(warnings()) == 1

        # 3. A spec change: a new template.
        models.patch(namespace, "big", {"spec": {"engine": {"maxModelLen": 4096}}})

        def leader_args():
            found = _lws(admin, namespace, "big") or {}
            template = found.get("spec", {}).get("leaderWorkerTemplate", {})
            return template.get("leaderTemplate", {}).get("spec", {}).get("containers", [{}])[0]

        eventually(
            lambda: "4096" in (leader_args().get("args") or []),
            timeout=30,
            message="the LWS's leader template with the new maxModelLen",
        )

        # 4. The HPA scales the LWS (groups) through its scale subresource. The LWS
        # controller would write the status; the selector picks the leaders.
        models.patch(
            namespace,
            "big",
            {"spec": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 3}}},
        )
        hpa = eventually(
            lambda: models.children(namespace, "big")["HorizontalPodAutoscaler"],
            timeout=30,
            message="the HPA",
        )
        assert hpa.spec.scale_target_ref.kind == "LeaderWorkerSet"
        custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "big",
            {
                "status": {
                    "replicas": 1,
                    "hpaPodSelector": "leaderworkerset.sigs.k8s.io/name=big,"
                    "leaderworkerset.sigs.k8s.io/worker-index=0",
                }
            },
        )
        scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "big")
        assert scale["status"]["selector"].startswith("leaderworkerset.sigs.k8s.io/name=big")
        eventually(
            lambda: (_lws(admin, namespace, "big") or {}).get("spec", {}).get("replicas") == 2,
            timeout=90,
            message="the HPA to scale the LWS to minReplicas 2",
        )
        # The operator leaves .spec.replicas to the HPA (a pass does not put it back).
        models.patch(namespace, "big", {"spec": {"engine": {"maxModelLen": 2048}}})
        eventually(lambda: "2048" in leader_args()["args"], timeout=30, message="another pass")
        assert _lws(admin, namespace, "big")["spec"]["replicas"] == 2

        # 5. nodes 2 -> 1 -> 2: the workload is replaced, one at the end of each switch.
        for parallelism, want in (
            ({"pipeline": 1, "nodes": 1}, {"Deployment"}),
            (TWO_NODES, {"LeaderWorkerSet"}),
        ):
            models.patch(namespace, "big", {"spec": {"parallelism": parallelism}})
            eventually(
                lambda want=want: _workloads(admin, models, namespace, "big") == want,
                timeout=60,
                message=f"only a {want} after the switch",
            )
        # The pass writes the status after the children: wait for it, not just the LWS.
        eventually(
            lambda: (_condition(models, namespace, "big") or {}).get("status") == "True",
            timeout=30,
            message="LeaderWorkerSetReady=True after the switch back",
        )

        # 6. Garbage collection. The garbage collector watches a new CRD's kind only from
        # its next discovery sync (every 30 s), which may come after this delete.
        models.delete(namespace, "big")
        eventually(
            lambda: _lws(admin, namespace, "big") is None,
            timeout=90,
            message="the LeaderWorkerSet to be garbage collected",
        )
        operator.process.check_alive()
    finally:
        ext.delete_custom_resource_definition(CRD_NAME)
        # Gone before the next test, which runs without it.
        eventually(lambda: not _crd_exists(ext), timeout=30, message="the LWS CRD to be gone")
