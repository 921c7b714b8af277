"""The optional NetworkPolicy for the model pods (`spec.networkPolicy`).

Only ingress is restricted (egress stays open: model downloads, the HF hub, object stores).
The server port accepts connections from pods in the model's own namespace, from the
namespaces of the ingress controller or Gateway data plane that proxy to it, and from the
monitoring namespaces that scrape `/metrics` (a NetworkPolicy cannot tell paths apart, so
that is the same port). Namespaces are matched by their `kubernetes.io/metadata.name` label,
which the API server sets on every namespace. Needs a CNI that enforces NetworkPolicy.

With autoscaling.minReplicas 0 the operator's namespace is admitted too: the activator there
forwards held requests to the pods, and the operator reads their `/metrics` (the idle
signal).

With parallelism.nodes > 1 the model's own pods also reach each other on every port: vLLM's
rendezvous (`--master-port`) is one, but NCCL and the engine's message queues pick theirs at
run time, so no fixed list of ports would do.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import PORT, metadata, selector_labels

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _namespaces(names: list[str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(set(names))}
            ]
        }
    }


def desired_network_policy(model: StreamingModel) -> dict[str, Any] | None:
    np = model.spec.network_policy
    if not np.enabled:
        return None
    port = [{"protocol": "TCP", "port": PORT}]
    peers: list[dict[str, Any]] = [{"podSelector": {}}]  # the model's own namespace
    if np.proxy_namespaces:
        peers.append(_namespaces(np.proxy_namespaces))
    if np.monitoring_namespaces:
        peers.append(_namespaces(np.monitoring_namespaces))
    if model.spec.scale_to_zero is not None:  # <service>.<namespace>.svc.cluster.local
        peers.append(_namespaces([model.activator_host.split(".")[1]]))
    ingress: list[dict[str, Any]] = [{"from": peers, "ports": port}]
    if model.multi_node:  # leader <-> workers of a group: the engine's own ports
        ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(model)}}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(model),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
