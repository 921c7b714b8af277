"""The KEDA backend against a real API server, with the chart's RBAC (keda.enabled=true).

KEDA cannot run here, and its CRD is not copied into this repo: a stand-in CRD for
keda.sh/v1alpha1 ScaledObject (namespaced, schema-less: x-kubernetes-preserve-unknown-fields)
gives the API server the resource, so what is tested is the operator's real HTTP (server-side
apply, delete, ownership), the chart's RBAC for it (no denial in the audit log), the hash
annotation's no-op resync on a real round trip, the garbage collector, and the backend
switch in both directions. The object it stores is checked with our ScaledObject schema.

Needs K8S_ASSETS and etcd like tests/e2e (its harness is reused); skipped with one line.
"""

from __future__ import annotations

import jsonschema
import pytest
from operator_helpers import KEDA_SCHEMA
from testkit.live_cluster import live_control_plane

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NS = "keda-live"
STAND_IN_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
                "subresources": {"status": {}},
            }
        ],
    },
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    yield from live_control_plane(tmp_path_factory.mktemp("keda-cp"), (STAND_IN_CRD,))


def test_keda_backend_on_a_real_api_server(plane):
    from e2e_harness.kube import Models, eventually, model_body
    from e2e_harness.operator_process import (
        OperatorProcess,
        RenderedChart,
        install_operator_identity,
    )
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    cp, admin = plane
    custom = client.CustomObjectsApi(admin)
    models = Models(admin)
    op = None

    def scaled_object():
        try:
            return custom.get_namespaced_custom_object(
                "keda.sh", "v1alpha1", NS, "scaledobjects", "m"
            )
        except ApiException as e:
            if e.status != 404:
                raise
            return None

    try:
        client.CoreV1Api(admin).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=NS))
        )
        chart = RenderedChart.render("sluice-system", values={"keda.enabled": "true"})
        kubeconfig = install_operator_identity(admin, cp, chart)
        ns, sa = chart.service_account()
        user = f"system:serviceaccount:{ns}:{sa}"
        op = OperatorProcess(chart, kubeconfig, cp.logs).start()

        # keda: a ScaledObject owned by the model, and no HPA.
        models.create(model_body("m", NS, autoscaling={"backend": "keda", "maxReplicas": 3}))
        so = eventually(scaled_object, timeout=60, message="the ScaledObject")
        model = models.get(NS, "m")
        (ref,) = so["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"]) == ("StreamingModel", model["metadata"]["uid"])
        stored = {k: v for k, v in so.items() if k in ("apiVersion", "kind", "spec")}
        stored["metadata"] = {"name": "m", "namespace": NS}
        jsonschema.Draft202012Validator(__import__("json").loads(KEDA_SCHEMA.read_text())).validate(
            stored
        )
        eventually(
            lambda: (
                (models.get(NS, "m").get("status") or {}).get("autoscaling", {}).get("backend")
                == "keda"
            ),
            timeout=30,
            message="status.autoscaling.backend",
        )
        assert models.children(NS, "m")["HorizontalPodAutoscaler"] is None

        # A resync with nothing to do leaves the ScaledObject alone (real round trip of the
        # hash annotation and server-side apply): its resourceVersion does not move.
        version = so["metadata"]["resourceVersion"]
        models.patch(NS, "m", {"metadata": {"labels": {"touch": "1"}}})  # an update event
        eventually(lambda: models.get(NS, "m")["metadata"]["labels"].get("touch"), message="label")
        import time

        time.sleep(3)
        assert scaled_object()["metadata"]["resourceVersion"] == version

        # keda -> hpa: the ScaledObject goes, our HPA comes.
        models.patch(NS, "m", {"spec": {"autoscaling": {"backend": "hpa"}}})
        eventually(
            lambda: scaled_object() is None and models.children(NS, "m")["HorizontalPodAutoscaler"],
            timeout=60,
            message="ScaledObject deleted and HPA created",
        )
        # hpa -> keda again: the HPA goes, the ScaledObject comes back.
        models.patch(NS, "m", {"spec": {"autoscaling": {"backend": "keda"}}})
        eventually(
            lambda: scaled_object() and models.children(NS, "m")["HorizontalPodAutoscaler"] is None,
            timeout=60,
            message="HPA deleted and ScaledObject created",
        )
        # The chart granted everything the operator called on the way; the audit log did
        # see those calls (the check is not vacuous), and nothing beyond what is granted.
        calls = {
            e["verb"]
            for e in cp.audit_events(user=user)
            if e.get("objectRef", {}).get("resource") == "scaledobjects"
        }
        assert {"get", "patch", "delete"} <= calls <= {"get", "create", "patch", "delete"}
        denied = [
            (e["verb"], e.get("objectRef", {}).get("resource"))
            for e in cp.audit_events(user=user)
            if e.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"
        ]
        assert denied == []
        # Deleting the model lets the garbage collector remove the ScaledObject.
        models.delete(NS, "m")
        eventually(lambda: scaled_object() is None, timeout=60, message="ScaledObject collected")
    finally:
        if op is not None:
            op.stop()
