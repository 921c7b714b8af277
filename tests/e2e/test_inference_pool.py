"""The InferencePool path on the real API server, with the official CRDs, under the chart's
RBAC.

The CRDs are upstream's own files (`../shared/crds`: GAIE v1.6.0's InferencePool, Gateway
API v1.6.1's Standard HTTPRoute), so the API server judges the pool and the route with
their real schemas and CEL rules; the tests skip where that folder is absent (a user's
clone). First without them: conditions InferencePoolReady and RouteBackend say so, one
Warning Event, the rest converges. Then with them: the pool and the route that names it are
accepted; switching the pool off and on again leaves exactly one backend each time; and the
API server refuses a pool the official CEL rule forbids (the negative control: the schema is
really enforced). No Gateway controller runs, so nothing accepts the route.
"""

from __future__ import annotations

import copy
import time

import pytest
import yaml
from e2e_harness.kube import eventually, load_sample
from kubernetes import client
from testkit.repo import shared_crd

POOL_CRD = shared_crd(
    "gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml"
)
ROUTE_CRD = shared_crd("gateway-api/standard/gateway.networking.k8s.io_httproutes.yaml")
pytestmark = pytest.mark.skipif(
    POOL_CRD is None or ROUTE_CRD is None,
    reason="the official InferencePool and HTTPRoute CRDs are not in ../shared/crds "
    "(set SLUICE_SHARED_CRDS to a folder that holds them, see its INDEX.md)",
)
POOL = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTE = ("gateway.networking.k8s.io", "v1", "httproutes")
GATEWAY = {"parentRefs": [{"name": "inference-gateway"}], "path": "/"}
ROUTING = {"inferencePool": {"enabled": True, "endpointPicker": {
    "name": "pool-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}}}  # fmt: skip


def _get(admin, coords, namespace, name):
    try:
        return client.CustomObjectsApi(admin).get_namespaced_custom_object(
            *coords[:2], namespace, coords[2], name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _conditions(models, namespace, name):
    status = models.get(namespace, name).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def _install(ext, path):
    body = yaml.safe_load(path.read_text())
    ext.create_custom_resource_definition(body)
    name = body["metadata"]["name"]
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(name).status.conditions or []
        ),
        timeout=30,
        message=f"CRD {name} established",
    )
    return name


def _backend(admin, namespace, name):
    route = _get(admin, ROUTE, namespace, name)
    return route and [b.get("kind", "Service") for b in route["spec"]["rules"][0]["backendRefs"]]


def test_inference_pool_lifecycle(operator, admin, models, namespace):
    ext = client.ApiextensionsV1Api(admin)
    body = load_sample("chat-small.yaml", namespace, new_name="pool")
    body["spec"]["gateway"] = copy.deepcopy(GATEWAY)
    body["spec"]["routing"] = copy.deepcopy(ROUTING)
    models.create(body)

    # 1. No InferencePool CRD: both conditions say so, one Event, the rest converges.
    conditions = eventually(
        lambda: (
            (c := _conditions(models, namespace, "pool")).get("RouteBackend", {}).get("status")
            == "False"
            and c
        ),
        timeout=30,
        message="RouteBackend=False without the InferencePool CRD",
    )
    assert conditions["RouteBackend"]["reason"] == "InferencePoolUnavailable"
    assert "Inference Extension is not installed" in conditions["RouteBackend"]["message"]
    assert conditions["InferencePoolReady"]["status"] == "False"
    children = models.children(namespace, "pool")
    assert children["Deployment"] is not None and children["Service"] is not None

    def warnings():
        return models.core.list_namespaced_event(
            namespace, field_selector="reason=InferencePoolUnavailable"
        ).items

    eventually(warnings, timeout=10, message="the InferencePoolUnavailable Event")
    operator.process.check_alive()

    installed = []
    try:
        # 2. The official CRDs appear: the retry applies the pool and the route naming it.
        installed.append(_install(ext, POOL_CRD))
        installed.append(_install(ext, ROUTE_CRD))
        pool = eventually(
            lambda: _get(admin, POOL, namespace, "pool"),
            timeout=90,
            interval=0.5,
            message="the InferencePool after its CRD was installed",
        )
        deployment = children["Deployment"]
        assert pool["spec"]["selector"]["matchLabels"] == deployment.spec.selector.match_labels
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"] == {
            "group": "",  # the CRD's default, filled in by the API server
            "kind": "Service",
            "name": "pool-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        }
        assert pool["metadata"]["ownerReferences"][0]["kind"] == "StreamingModel"
        eventually(
            lambda: _backend(admin, namespace, "pool") == ["InferencePool"],
            timeout=90,
            interval=0.5,
            message="the HTTPRoute naming the pool",
        )
        conditions = eventually(
            lambda: (
                (c := _conditions(models, namespace, "pool"))["RouteBackend"]["status"] == "True"
                and c
            ),
            timeout=30,
            message="RouteBackend=True",
        )
        assert conditions["RouteBackend"]["reason"] == "InferencePool"
        assert conditions["InferencePoolReady"]["status"] == "True"

        # 3. Pool -> Service -> pool: exactly one backend at the end of each switch.
        models.patch(
            namespace, "pool", {"spec": {"routing": {"inferencePool": {"enabled": False}}}}
        )
        eventually(
            lambda: (
                _get(admin, POOL, namespace, "pool") is None
                and _backend(admin, namespace, "pool") == ["Service"]
            ),
            timeout=30,
            message="pool gone, route to the Service",
        )
        conditions = eventually(
            lambda: (
                (c := _conditions(models, namespace, "pool"))["RouteBackend"]["reason"] == "Service"
                and c
            ),
            timeout=30,
            message="RouteBackend=Service",
        )
        assert "InferencePoolReady" not in conditions
        models.patch(namespace, "pool", {"spec": {"routing": {"inferencePool": {"enabled": True}}}})
        eventually(
            lambda: (
                _get(admin, POOL, namespace, "pool") is not None
                and _backend(admin, namespace, "pool") == ["InferencePool"]
            ),
            timeout=30,
            message="pool back, route to the pool",
        )

        # 4. Negative control: the official CEL rule (a Service EPP needs a port) is enforced.
        bad = copy.deepcopy(pool)
        bad["metadata"] = {"name": "bad", "namespace": namespace}
        del bad["spec"]["endpointPickerRef"]["port"]
        with pytest.raises(client.ApiException) as info:
            client.CustomObjectsApi(admin).create_namespaced_custom_object(
                *POOL[:2], namespace, POOL[2], bad, dry_run="All"
            )
        assert info.value.status == 422 and "port is required" in info.value.body
    finally:
        for name in installed:
            ext.delete_custom_resource_definition(name)
        eventually(
            lambda: not [n for n in installed
                         if any(c.metadata.name == n
                                for c in ext.list_custom_resource_definition().items)],
            timeout=60,
            message="the CRDs removed",
        )  # fmt: skip
        time.sleep(1)
