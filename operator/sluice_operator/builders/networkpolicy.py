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

A router model on vLLM whose own policy is off (the default) still gets one policy,
`<name>-kv-events` (`desired_kv_events_network_policy`): its events carry prompt token ids
and take no credentials, so they must not be open to the whole cluster because the model's
owner left `spec.networkPolicy` off. It keeps open what is open without it and closes only
the events: a pod selected by any policy admits only what some policy allows, so besides the
events rule (the router's pods) it has a rule that admits every source on every other port:
TCP 1-5556 and 5559-65535 (`endPort`, Kubernetes 1.25+), with the server port also listed
alone so that a CNI that ignores `endPort` (it then admits the first port of each range
only) still serves the model, and every UDP port; SCTP in a rule of its own (a CNI without
SCTP policies drops that rule alone). What is not a port (ICMP) is up to the CNI once a
policy selects the pod; most drop it. With the model's own policy on, that policy already
admits the events from the router's pods only, and this one is not made (its open rule would
undo the model's).

A disaggregated model with the NIXL connector (builders/disaggregation.py) has one more
port closed the same way, in the same policies: the side channel (5600), open only between
the pods of its two pools (the pods' `serving.sluice.dev/role` prefill or decode), since a
decode pod pulls KV blocks, prompt content, from a prefill pod there without credentials.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import POOL_ROLE_LABEL, PORT, metadata, selector_labels
from .disaggregation import model_side_ports
from .kvevents import ROUTER_POD_LABELS, kv_event_ports

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
KV_EVENTS_SUFFIX = "-kv-events"
MAX_PORT = 65535


def _namespaces(names: list[str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(set(names))}
            ]
        }
    }


def _router_namespace(model: StreamingModel) -> str:
    return model.activator_host.split(".")[1]  # <service>.<namespace>.svc...


def _events_rule(model: StreamingModel, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The KV-event ports, from the router's pods in the operator's namespace only."""
    router = {
        **_namespaces([_router_namespace(model)]),
        "podSelector": {"matchLabels": ROUTER_POD_LABELS},
    }
    return {
        "from": [router],
        "ports": [{"protocol": "TCP", "port": p["containerPort"]} for p in events],
    }


def _side_channel_rule(model: StreamingModel, ports: list[int]) -> dict[str, Any]:
    """A disaggregated model's NIXL side channel (builders/disaggregation.py): from the pods
    of its two pools only (a decode pod asks a prefill pod for its blocks)."""
    pools = {
        "matchLabels": selector_labels(model),
        "matchExpressions": [
            {"key": POOL_ROLE_LABEL, "operator": "In", "values": ["decode", "prefill"]}
        ],
    }
    return {
        "from": [{"podSelector": pools}],
        "ports": [{"protocol": "TCP", "port": p} for p in ports],
    }


def _policy(model: StreamingModel, name: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    if model.multi_node:  # leader <-> workers of a group: the engine's own ports
        ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(model)}}]})
    meta = metadata(model)
    meta["name"] = name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp_ranges_around(closed: list[int]) -> list[dict[str, Any]]:
    """Every TCP port but `closed`, as ranges (a single port without `endPort`)."""
    out, start = [], 1
    for port in [*sorted(set(closed)), MAX_PORT + 1]:
        if port > start:
            last = port - 1
            entry: dict[str, Any] = {"protocol": "TCP", "port": start}
            if last > start:
                entry["endPort"] = last
            out.append(entry)
        start = port + 1
    return out


def desired_kv_events_network_policy(model: StreamingModel) -> dict[str, Any] | None:
    """`<name>-kv-events`: a router model's events from the router's pods only, every
    other port as open as without a policy (module docstring); None with the model's own
    policy on, or without events."""
    events = kv_event_ports(model)
    side = model_side_ports(model)
    if not (events or side) or model.spec.network_policy.enabled:
        return None
    closed = [p["containerPort"] for p in events] + side
    others = [
        {"protocol": "TCP", "port": PORT},  # also alone: a CNI that ignores endPort
        *_tcp_ranges_around(closed),
        {"protocol": "UDP"},
    ]
    ingress = [
        *([_events_rule(model, events)] if events else []),
        *([_side_channel_rule(model, side)] if side else []),
        {"ports": others},  # no `from`: every source
        {"ports": [{"protocol": "SCTP"}]},
    ]
    return _policy(model, model.name + KV_EVENTS_SUFFIX, ingress)


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
    if model.spec.scale_to_zero is not None or model.routed:
        peers.append(_namespaces([_router_namespace(model)]))
    ingress: list[dict[str, Any]] = [{"from": peers, "ports": port}]
    events = kv_event_ports(model)
    if events:  # the router's pods only, in the operator's namespace
        ingress.append(_events_rule(model, events))
    side = model_side_ports(model)
    if side:  # the model's two pools only
        ingress.append(_side_channel_rule(model, side))
    return _policy(model, model.name, ingress)
