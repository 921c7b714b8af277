"""Where the model's route sends requests: ONE switch over the backends, and the
InferencePool (`spec.routing.inferencePool`) that is one of them.

`route_backend` is the only place that decides the route's backend; the HTTPRoute rule's
`backendRefs` (`backend_ref`) and filters (`route_filters`), the Ingress path's backend
(builders/ingress.py) and the `RouteBackend` condition (`backend_verdict`) all read it, so
the Service, the pool and the activator never both claim the route.

The router (`spec.routing.router`, `model.via_router`) wins for a model that opts in, at
any replica count: the router places each request on one of the model's Ready pods, and
holds it while there is none. Otherwise the activator (scale to zero,
builders/activator.py) wins while the pass found no Ready replica of a model with
minReplicas 0 (`model.via_activator`). Both are the same pods (the operator chart's
activator Deployment) reached the same way: the route names the model's ExternalName
Service `<name>-activator` and sets the upstream Host to the model Service's FQDN
(HTTPRoute: a URLRewrite `hostname` filter; Ingress: ingress-nginx's upstream-vhost), which
is how the router tells models apart. A model that opts in while the chart runs no router
keeps the Service (condition RouterReady says why: `router_verdict`).

The InferencePool is written against `inference.networking.k8s.io/v1` as GAIE v1.6.0's CRD
declares it (kubernetes-sigs/gateway-api-inference-extension, tag v1.6.0; endpointPickerRef
optional there since GAIE #2949):

- `selector.matchLabels`: the Service's selector, so the pool holds exactly the model's
  serving pods (a multi-node group's leaders, never its workers; the EPP watches them and
  scrapes each pod's `/metrics` on a target port);
- `targetPorts`: the server's one port; `appProtocol`: HTTP/1.1 unless asked for h2c;
- `endpointPickerRef`: the platform's EPP Service (name, port, failureMode), or none: the
  field is optional in v1.6.0, and the gateway implementation then picks on its own.

The pool's backendRef carries no port (the pool's targetPorts say where pods listen; the
HTTPRoute CRD requires a port only for Services).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from ..models.resource import StreamingModel
from .activator import activator_service_name, upstream_host
from .common import PORT, metadata, selector_labels
from .leaderworkerset import leader_selector

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"


class Backend(StrEnum):
    """What the HTTPRoute rule's backendRef names (the condition's reason too)."""

    SERVICE = "Service"
    INFERENCE_POOL = "InferencePool"
    ACTIVATOR = "Activator"
    ROUTER = "Router"

    @property
    def via_activator_service(self) -> bool:
        """The route names `<name>-activator` with the model's Host (the router's pods)."""
        return self in (Backend.ACTIVATOR, Backend.ROUTER)


def route_backend(model: StreamingModel) -> Backend:
    """The one decision: the router for a model that opts in (when the chart runs it), else
    the activator while a model with minReplicas 0 has no Ready replica, else the pool when
    the model asks for one, else the Service."""
    if model.via_router:
        return Backend.ROUTER
    if model.via_activator:
        return Backend.ACTIVATOR
    if model.spec.routing.inference_pool.enabled:
        return Backend.INFERENCE_POOL
    return Backend.SERVICE


def backend_ref(model: StreamingModel) -> dict[str, Any]:
    """The HTTPRoute rule's one backendRefs entry."""
    backend = route_backend(model)
    if backend.via_activator_service:
        return {"name": activator_service_name(model), "port": PORT}
    if backend is Backend.INFERENCE_POOL:
        return {"group": POOL_GROUP, "kind": "InferencePool", "name": model.name}
    return {"name": model.name, "port": PORT}


def route_filters(model: StreamingModel) -> list[dict[str, Any]]:
    """The HTTPRoute rule's filters: the model's Host for the router, else none."""
    if route_backend(model).via_activator_service:
        return [{"type": "URLRewrite", "urlRewrite": {"hostname": upstream_host(model)}}]
    return []


def backend_verdict(
    model: StreamingModel, pool_unavailable: str | None = None
) -> tuple[bool, str, str]:
    """(status, reason, message) of the RouteBackend condition: which backend the route
    names, False when that backend cannot exist (`pool_unavailable`: why the pool could not
    be applied)."""
    backend = route_backend(model)
    route = "HTTPRoute" if model.spec.gateway is not None else "Ingress"
    if backend is Backend.ACTIVATOR:
        return (
            True,
            backend.value,
            (
                f"no Ready replica: the {route} sends requests to the activator (Service "
                f"{activator_service_name(model)}), which holds them until one is Ready"
            ),
        )
    if backend is Backend.ROUTER:
        return (
            True,
            backend.value,
            (
                f"the {route} sends requests to the router (Service "
                f"{activator_service_name(model)}), which places each on a Ready replica"
            ),
        )
    if backend is Backend.INFERENCE_POOL:
        if pool_unavailable is not None:
            return False, "InferencePoolUnavailable", pool_unavailable
        epp = model.spec.routing.inference_pool.endpoint_picker
        who = (
            f"endpoint picker {epp.name}:{epp.port.number}, {epp.failure_mode}"
            if epp is not None
            else "no endpointPickerRef: the gateway picks"
        )
        return (
            True,
            backend.value,
            f"the HTTPRoute sends requests to InferencePool {model.name} ({who})",
        )
    return True, backend.value, f"the {route} sends requests to Service {model.name}"


# Where the operator chart turns the router on (it is the activator Deployment).
ROUTER_CHART_VALUE = "activator.enabled"


def router_verdict(model: StreamingModel) -> tuple[bool, str, str]:
    """(status, reason, message) of the RouterReady condition of a model that opts into
    the router."""
    if not model.router_available:
        return (
            False,
            "RouterDisabled",
            (
                "spec.routing.router.enabled, but the operator runs without the router (the "
                f"sluice-operator chart's {ROUTER_CHART_VALUE} is false): the route goes to "
                f"Service {model.name}; set {ROUTER_CHART_VALUE}=true, or turn "
                "spec.routing.router off"
            ),
        )
    return (
        True,
        "Listed",
        (
            f"the router lists {model.namespace}/{model.name} with its pods and places each "
            "request on a Ready replica"
        ),
    )


def desired_inference_pool(model: StreamingModel) -> dict[str, Any] | None:
    pool = model.spec.routing.inference_pool
    if not pool.enabled:
        return None
    spec: dict[str, Any] = {
        # As the Service: with several nodes per replica only the leaders serve HTTP.
        "selector": {"matchLabels": {**selector_labels(model), **leader_selector(model)}},
        "targetPorts": [{"number": PORT}],
        "appProtocol": pool.app_protocol,
    }
    if pool.endpoint_picker is not None:
        epp = pool.endpoint_picker
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": epp.name,
            "port": {"number": epp.port.number},
            "failureMode": epp.failure_mode,
        }
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata(model),
        "spec": spec,
    }


def pool_verdict(
    model: StreamingModel, pool: Mapping[str, Any] | None
) -> tuple[bool | None, str, str]:
    """(status, reason, message) of the InferencePoolReady condition: what the pool's
    status.parents say (each Gateway that uses it reports Accepted and ResolvedRefs)."""
    parents = ((pool or {}).get("status") or {}).get("parents") or []
    refused = []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        for c in parent.get("conditions") or []:
            if c.get("type") in ("Accepted", "ResolvedRefs") and c.get("status") == "False":
                refused.append(
                    f"{ref.get('kind', 'Gateway')} {ref.get('name', '?')}: {c.get('type')} "
                    f"{c.get('reason', '')} {c.get('message', '')}".strip()
                )
    if refused:
        return False, "NotAccepted", "; ".join(refused)[:1024]
    return True, "Applied", "the InferencePool selects the model's pods"
