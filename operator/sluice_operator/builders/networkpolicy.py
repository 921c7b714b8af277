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

A router model (spec.routing.router) admits the operator's namespace on the server port too
(the router forwards to the pods directly), and the router's pods alone on the KV-event
ports (builders/kvevents.py: the events carry prompt token ids, unauthenticated).

With parallelism.nodes > 1 the model's own pods also reach each other on every port: vLLM's
rendezvous (`--master-port`) is one, but NCCL and the engine's message queues pick theirs at
run time, so no fixed list of ports would do.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import PORT, metadata, selector_labels
from .kvevents import ROUTER_POD_LABELS, kv_event_ports

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
    router_namespace = model.activator_host.split(".")[1]  # <service>.<namespace>.svc...
    if model.spec.scale_to_zero is not None or model.routed:
        peers.append(_namespaces([router_namespace]))
    ingress: list[dict[str, Any]] = [{"from": peers, "ports": port}]
    events = kv_event_ports(model)
    if events:  # the router's pods only, in the operator's namespace
        router = {
            **_namespaces([router_namespace]),
            "podSelector": {"matchLabels": ROUTER_POD_LABELS},
        }
        ingress.append(
            {
                "from": [router],
                "ports": [{"protocol": "TCP", "port": p["containerPort"]} for p in events],
            }
        )
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
