"""The operator's PodMonitor, accepted by a real API server that serves a PodMonitor CRD.

The Prometheus Operator's own CRD is not available offline; its schema is the one written
from the Prometheus Operator's API reference (tests/operator/schemas/podmonitor.schema.json),
turned into a structural CRD schema here. The API server then enforces it: the builder's
object is created (server-side dry run, strict field validation as kubectl does), and a
misspelt field or a bad duration is refused (the negative controls).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from e2e_harness.kube import eventually
from kubernetes import client, utils

SCHEMA = Path(__file__).parents[1] / "operator" / "schemas" / "podmonitor.schema.json"
GROUP, VERSION, PLURAL = "monitoring.coreos.com", "v1", "podmonitors"
COPIED = ("pattern", "minimum", "maximum", "minLength", "maxLength", "required")


def structural(node: dict, defs: dict) -> dict:
    """JSON Schema (the subset the hand-written schema uses) -> structural CRD schema."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    kind = node.get("type")
    if "const" in node:
        out = {"type": "string", "enum": [node["const"]]}
    elif "enum" in node:
        out = {"type": "string", "enum": list(node["enum"])}
    elif isinstance(kind, list):
        out = {"x-kubernetes-int-or-string": True}
    else:
        out = {"type": kind}
    out.update({k: node[k] for k in COPIED if k in node})
    if kind == "object":
        if "properties" in node:
            out["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
        elif isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = structural(node["additionalProperties"], defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = structural(node["items"], defs)
    return out


def pod_monitor_crd() -> dict:
    schema = json.loads(SCHEMA.read_text())
    spec = structural(schema["properties"]["spec"], schema["$defs"])
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": "PodMonitor", "listKind": "PodMonitorList", "plural": PLURAL,
                      "singular": "podmonitor", "categories": ["prometheus-operator"]},
            "scope": "Namespaced",
            "versions": [{"name": VERSION, "served": True, "storage": True, "schema": {
                "openAPIV3Schema": {"type": "object", "required": ["spec"],
                                    "properties": {"spec": spec}}}}],
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def pod_monitor_kind(admin):
    body = pod_monitor_crd()
    utils.create_from_dict(admin, body)
    ext = client.ApiextensionsV1Api(admin)

    def established():
        got = ext.read_custom_resource_definition(body["metadata"]["name"])
        return any(
            c.type == "Established" and c.status == "True" for c in got.status.conditions or []
        )

    eventually(established, timeout=30, message="the PodMonitor CRD to be Established")
    yield
    ext.delete_custom_resource_definition(body["metadata"]["name"])


def _create(admin, body: dict) -> dict:
    return client.CustomObjectsApi(admin).create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, body, dry_run="All", field_validation="Strict"
    )


def _pod_monitor() -> dict:
    from sluice_operator.builders.podmonitor import desired_pod_monitor
    from sluice_operator.validation import load_model

    body = {
        "apiVersion": "serving.sluice.dev/v1alpha1",
        "kind": "StreamingModel",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"model": {"uri": "hf://org/model"},
                 "observability": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}},
    }  # fmt: skip
    return desired_pod_monitor(load_model(body))


def test_the_operators_pod_monitor_is_accepted(admin, pod_monitor_kind):
    created = _create(admin, _pod_monitor())
    assert created["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert created["metadata"]["labels"]["release"] == "kps"


@pytest.mark.parametrize(
    "mutate,says",
    [
        (lambda o: o["spec"].update(podMetricEndpoints=[]), "unknown field"),
        (lambda o: o["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"), "interval"),
        (lambda o: o["spec"].pop("selector"), "selector"),
    ],
)
def test_the_api_server_enforces_the_schema(admin, pod_monitor_kind, mutate, says):
    body = copy.deepcopy(_pod_monitor())
    mutate(body)
    with pytest.raises(client.ApiException) as err:
        _create(admin, body)
    assert err.value.status in (400, 422)
    assert says in json.loads(err.value.body)["message"]
