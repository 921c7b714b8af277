"""Small helpers the tests share: wait for a condition (`eventually`), read StreamingModels and
their children."""

from __future__ import annotations

import copy
import functools

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from testkit.repo import ROOT
from testkit.wait import eventually as _eventually

GROUP, VERSION, PLURAL = "serving.sluice.dev", "v1alpha1", "streamingmodels"
SAMPLES = ROOT / "samples"
CRD_FILE = ROOT / "crds/streamingmodels.serving.sluice.dev.yaml"


# What a read of the Kubernetes API raises while the object, or the part of it a test
# waits for, is not there yet: a 404 (ApiException), a status field not written yet
# (KeyError; TypeError from indexing a None).
NOT_YET = (ApiException, KeyError, AssertionError, TypeError)

# `testkit.wait.eventually` for conditions read from the API: those errors mean "not yet",
# 15 s unless told otherwise, polled every 0.1 s.
eventually = functools.partial(_eventually, timeout=15.0, interval=0.1, retry_on=NOT_YET)


def load_sample(name: str, namespace: str, new_name: str | None = None) -> dict:
    """A sample StreamingModel from samples/, moved into `namespace` (and renamed)."""
    body = yaml.safe_load((SAMPLES / name).read_text())
    body["metadata"]["namespace"] = namespace
    if new_name:
        body["metadata"]["name"] = new_name
    return body


def model_body(name: str, namespace: str, **spec) -> dict:
    """A minimal StreamingModel; keyword arguments are merged into the spec."""
    base = {"model": {"uri": "hf://org/model"}}
    base.update(copy.deepcopy(spec))
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "StreamingModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": base,
    }


class Models:
    """StreamingModels and the children the operator makes for them."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.autoscaling = client.AutoscalingV2Api(api)
        self.policy = client.PolicyV1Api(api)

    def create(self, body: dict) -> dict:
        ns = body["metadata"]["namespace"]
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

    def get(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def patch(self, namespace: str, name: str, patch: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, patch
        )

    def delete(self, namespace: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def condition(self, namespace: str, name: str, type_: str) -> dict | None:
        status = self.get(namespace, name).get("status") or {}
        return next((c for c in status.get("conditions", []) if c["type"] == type_), None)

    # Children are named after the StreamingModel (docs/design.md: Service name = model name).
    def children(self, namespace: str, name: str) -> dict[str, object]:
        """Every child kind -> the object, or None when absent."""
        readers = {
            "Deployment": self.apps.read_namespaced_deployment,
            "Service": self.core.read_namespaced_service,
            "Ingress": self.networking.read_namespaced_ingress,
            "HorizontalPodAutoscaler": self.autoscaling.read_namespaced_horizontal_pod_autoscaler,
            "PodDisruptionBudget": self.policy.read_namespaced_pod_disruption_budget,
        }
        # A disaggregated model's pools (docs/disaggregation.md): `<name>-prefill`, `-decode`.
        pools = {
            f"{role.capitalize()}{kind}": (read, f"{name}-{role}")
            for role in ("prefill", "decode")
            for kind, read in (
                ("Deployment", readers["Deployment"]),
                ("HorizontalPodAutoscaler", readers["HorizontalPodAutoscaler"]),
            )
        }
        named = {kind: (read, name) for kind, read in readers.items()} | pools
        found: dict[str, object] = {}
        for kind, (read, child) in named.items():
            try:
                found[kind] = read(child, namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
                found[kind] = None
        return found

    def pods(self, namespace: str, name: str) -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/instance={name}"
        ).items

    def events_for(self, namespace: str, name: str) -> list[client.CoreV1Event]:
        return self.core.list_namespaced_event(
            namespace,
            field_selector=f"involvedObject.name={name},involvedObject.kind=StreamingModel",
        ).items
