"""Gateway API on the real API server, under the chart's RBAC.

First without Gateway API CRDs (the GatewayRoute condition says so, the rest converges, no
crash loop); then with an HTTPRoute CRD whose schema is the strict one written from the
Gateway API reference (`tests/operator/schemas/gateway-httproute.schema.json`: the official
CRD files are not in any registry reachable here), so the API server validates every route
the operator writes; Ingress <-> Gateway switches leave exactly one; garbage collection
removes the route; and with the Standard channel's CRD (no sessionPersistence) a route that
asks for it is applied without it, with the condition saying so. No Gateway controller runs, so nothing accepts the route: the condition
stays Unknown/Pending, which is what a cluster without a controller for the parent shows.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from e2e_harness.kube import eventually, load_sample
from kubernetes import client
from testkit.repo import ROOT

SCHEMA = ROOT / "tests" / "operator" / "schemas" / "gateway-httproute.schema.json"
GATEWAY = {
    "parentRefs": [{"name": "public", "namespace": "gateways"}],
    "hostnames": ["chat.example.com"],
    "path": "/chat",
}


def _structural(node):
    """The JSON schema as a CRD's openAPIV3Schema: no $-keys, const as enum, and no
    `additionalProperties: false` (structural schemas prune unknown fields instead)."""
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("$") or (key == "additionalProperties" and value is False):
            continue
        if key == "const":
            out["type"], out["enum"] = "string", [value]
        elif key == "enum":
            out["type"], out["enum"] = "string", value
        else:
            out[key] = _structural(value)
    if "properties" in out:
        out.setdefault("type", "object")
    if out.get("properties", {}).get("metadata"):
        out["properties"]["metadata"] = {"type": "object"}  # the API server owns metadata
    if "items" in out:
        out.setdefault("type", "array")
    return out


def _httproute_crd() -> dict:
    schema = _structural(json.loads(SCHEMA.read_text()))
    schema["properties"]["spec"]["properties"]["rules"]["items"]["properties"]["timeouts"][
        "x-kubernetes-validations"
    ] = [
        {
            "rule": "!(has(self.request) && has(self.backendRequest) && "
            "duration(self.request) != duration('0s') && "
            "duration(self.backendRequest) > duration(self.request))",
            "message": "backendRequest timeout cannot be longer than request timeout",
        }
    ]
    schema["properties"]["status"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # *.k8s.io groups need the approval annotation; the official CRDs carry this one.
        "metadata": {
            "name": "httproutes.gateway.networking.k8s.io",
            "annotations": {
                "api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api/pull/2466"
            },
        },
        "spec": {
            "group": "gateway.networking.k8s.io",
            "scope": "Namespaced",
            "names": {
                "plural": "httproutes",
                "singular": "httproute",
                "kind": "HTTPRoute",
                "listKind": "HTTPRouteList",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def _condition(models, namespace, name):
    status = models.get(namespace, name).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}.get("GatewayRoute")


def _route(admin, namespace, name):
    try:
        return client.CustomObjectsApi(admin).get_namespaced_custom_object(
            "gateway.networking.k8s.io", "v1", namespace, "httproutes", name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_gateway_route_lifecycle(operator, admin, models, namespace):
    ext = client.ApiextensionsV1Api(admin)
    body = load_sample("chat-small.yaml", namespace, new_name="gw")
    body["spec"]["gateway"] = copy.deepcopy(GATEWAY)
    models.create(body)

    # 1. No Gateway API: a condition and an Event, the rest converges.
    cond = eventually(
        lambda: (c := _condition(models, namespace, "gw")) and c["status"] == "False" and c,
        timeout=30,
        message="GatewayRoute=False without the Gateway API CRDs",
    )
    assert cond["reason"] == "GatewayAPIUnavailable" and "not installed" in cond["message"]
    children = models.children(namespace, "gw")
    assert children["Deployment"] is not None and children["Service"] is not None

    def warnings():
        return models.core.list_namespaced_event(
            namespace, field_selector="reason=GatewayAPIUnavailable"
        ).items

    # kopf posts Events in the background: the status may be written first.
    eventually(warnings, timeout=10, message="the GatewayAPIUnavailable Event")
    time.sleep(1)
    assert len(warnings()) == 1
    operator.process.check_alive()  # no crash loop

    # 2. The CRD appears: the retry (backoff) creates the route, the API server accepts it.
    ext.create_custom_resource_definition(_httproute_crd())
    try:
        eventually(
            lambda: any(
                c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(
                    "httproutes.gateway.networking.k8s.io"
                ).status.conditions
                or []
            ),
            timeout=30,
            message="the HTTPRoute CRD to be established",
        )
        route = eventually(
            lambda: _route(admin, namespace, "gw"),
            timeout=60,
            interval=0.5,
            message="the HTTPRoute after the CRD was installed",
        )
        (rule,) = route["spec"]["rules"]
        assert rule["timeouts"]["request"].endswith("s")
        assert route["metadata"]["ownerReferences"][0]["kind"] == "StreamingModel"
        status = eventually(
            lambda: (
                (s := models.get(namespace, "gw").get("status") or {})
                and {c["type"]: c for c in s["conditions"]}["GatewayRoute"]["reason"] == "Pending"
                and s
            ),
            timeout=30,
            message="GatewayRoute Pending",
        )
        assert status["url"] == "http://chat.example.com/chat"
        assert models.children(namespace, "gw")["Ingress"] is None

        # 3. Gateway -> Ingress -> Gateway: exactly one at the end of each switch.
        models.patch(
            namespace,
            "gw",
            {"spec": {"gateway": None, "ingress": {"enabled": True, "host": "chat.example.com"}}},
        )
        eventually(
            lambda: (
                models.children(namespace, "gw")["Ingress"] is not None
                and _route(admin, namespace, "gw") is None
            ),
            timeout=30,
            message="Ingress in, HTTPRoute out",
        )
        eventually(
            lambda: _condition(models, namespace, "gw") is None,
            timeout=30,
            message="GatewayRoute condition gone",
        )
        models.patch(namespace, "gw", {"spec": {"gateway": GATEWAY, "ingress": {"enabled": False}}})
        eventually(
            lambda: (
                models.children(namespace, "gw")["Ingress"] is None
                and _route(admin, namespace, "gw") is not None
            ),
            timeout=30,
            message="HTTPRoute in, Ingress out",
        )

        # 3b. Resumable streams with session persistence (an Experimental channel field, in
        # the schema the CRD is made from): the API server accepts and keeps it.
        models.patch(
            namespace,
            "gw",
            {
                "spec": {
                    "gateway": {"sessionPersistence": True},
                    "streaming": {"resume": {"graceSeconds": 30}},
                }
            },
        )
        route = eventually(
            lambda: (
                (r := _route(admin, namespace, "gw"))
                and "sessionPersistence" in r["spec"]["rules"][0]
                and r
            ),
            timeout=30,
            message="the route's session persistence",
        )
        assert route["spec"]["rules"][0]["sessionPersistence"]["sessionName"] == "sluice-affinity"

        # 4. Both at once: refused by the API server (CEL).
        with pytest.raises(client.ApiException) as err:
            models.patch(namespace, "gw", {"spec": {"ingress": {"enabled": True}}})
        assert "exclusive" in err.value.body

        # 5. Garbage collection. The garbage collector watches a new CRD's kind only from
        # its next discovery sync (every 30 s), which may come after this delete.
        models.delete(namespace, "gw")
        eventually(
            lambda: _route(admin, namespace, "gw") is None,
            timeout=90,
            message="the HTTPRoute to be garbage collected",
        )

        # 6. The Standard channel's CRD (no rules[].sessionPersistence): server-side apply
        # refuses a route that carries it (a 500, "field not declared in schema"), so the
        # operator applies it without, and the condition says so.
        standard = _httproute_crd()
        spec_schema = standard["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        del spec_schema["properties"]["spec"]["properties"]["rules"]["items"]["properties"][
            "sessionPersistence"
        ]
        name = standard["metadata"]["name"]
        standard["metadata"]["resourceVersion"] = ext.read_custom_resource_definition(
            name
        ).metadata.resource_version
        ext.replace_custom_resource_definition(name, standard)
        time.sleep(2)  # the API server serves the new schema
        body = load_sample("chat-small.yaml", namespace, new_name="gw2")
        body["spec"]["gateway"] = {**copy.deepcopy(GATEWAY), "sessionPersistence": True}
        body["spec"].setdefault("streaming", {})["resume"] = {"graceSeconds": 30}
        models.create(body)
        cond = eventually(
            lambda: (
                (c := _condition(models, namespace, "gw2"))
                and c["reason"] == "SessionPersistenceDropped"
                and c
            ),
            timeout=30,
            message="GatewayRoute=False: the CRD has no sessionPersistence",
        )
        assert cond["status"] == "False" and "Experimental channel" in cond["message"]
        route = _route(admin, namespace, "gw2")
        assert route["spec"]["hostnames"] == GATEWAY["hostnames"]
        assert "sessionPersistence" not in route["spec"]["rules"][0]
    finally:
        ext.delete_custom_resource_definition("httproutes.gateway.networking.k8s.io")
        time.sleep(1)
