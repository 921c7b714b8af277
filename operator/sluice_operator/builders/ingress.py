"""Streaming-safe Nginx Ingress: no response or request buffering, timeouts >= stream timeout.

Two controllers answer to "nginx" in the field: the community ingress-nginx
(`nginx.ingress.kubernetes.io/*`, project retired but widely deployed) and F5's NGINX
Ingress Controller (`nginx.org/*`). Both default to the class name `nginx`, so
`spec.ingress.controller` says which one when the class name cannot.

Balancing (`spec.routing.balance`, `balance_annotations`): a stream holds its replica for its
whole length, so what matters is how many streams each replica has open.

- F5: `nginx.org/lb-method` is nginx's own upstream method. least-loaded is `least_conn`
  (open upstream connections, which is open streams: nginx counts a connection from the
  request until its response ends); round-robin is `round_robin`. F5's own default is
  `random two least_conn`, close to least_conn with many nginx workers. `least_time` (NGINX
  Plus only) weighs header or last-byte time, and for a stream last-byte time is its
  length, so it is not used.
- ingress-nginx balances in Lua and ignores upstream directives; its
  `nginx.ingress.kubernetes.io/load-balance` offers `round_robin` and `ewma` only. EWMA
  (balancer/ewma.lua) picks the better of two random replicas by a moving average (10 s
  decay) of upstream connect + response time, updated when a response ends. For a stream the
  response time is the stream's length, known only once it is over: replicas holding long
  streams look idle until those end, and then look slow once they are free again. That is
  not a load signal, so least-loaded keeps `round_robin` there, and load-aware routing on
  ingress-nginx needs the InferencePool path (a Gateway with an endpoint picker).
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .activator import UPSTREAM_VHOST, activator_service_name, upstream_host
from .common import PORT, PORT_NAME, metadata
from .routing import route_backend

# The session-affinity cookie that brings a resumed stream back to its pod.
AFFINITY_COOKIE = "sluice-affinity"
# Idle time nginx tolerates on top of the stream timeout before it cuts a connection.
TIMEOUT_MARGIN_SECONDS = 30
_F5_HINTS = ("nginx-org", "nginx-plus", "f5")


def controller(model: StreamingModel) -> str:
    ing = model.spec.ingress
    if ing.controller != "auto":
        return ing.controller
    return "f5-nginx" if any(h in ing.class_name for h in _F5_HINTS) else "ingress-nginx"


# spec.routing.balance -> each controller's method (see the module docstring).
LB_METHODS = {
    "f5-nginx": {"least-loaded": "least_conn", "round-robin": "round_robin"},
    "ingress-nginx": {"least-loaded": "round_robin", "round-robin": "round_robin"},
}


def balance_annotations(model: StreamingModel) -> dict[str, str]:
    which = controller(model)
    method = LB_METHODS[which][model.spec.routing.balance]
    if which == "f5-nginx":
        return {"nginx.org/lb-method": method}
    return {"nginx.ingress.kubernetes.io/load-balance": method}


def streaming_annotations(model: StreamingModel) -> dict[str, str]:
    spec = model.spec
    timeout = spec.streaming.stream_timeout_seconds + TIMEOUT_MARGIN_SECONDS
    body = str(spec.max_request_bytes)  # the server's --max-body-bytes: one limit
    if controller(model) == "f5-nginx":
        out = {
            "nginx.org/proxy-buffering": "false",
            "nginx.org/proxy-read-timeout": f"{timeout}s",
            "nginx.org/proxy-send-timeout": f"{timeout}s",
            "nginx.org/client-max-body-size": body,
        }
        if "websocket" in spec.streaming.protocols:
            out["nginx.org/websocket-services"] = model.name  # F5 needs WebSocket upstreams named
        if spec.streaming.resume.grace_seconds:  # NGINX Plus: sticky cookie per service
            out["nginx.org/sticky-cookie-services"] = (
                f"serviceName={model.name} {AFFINITY_COOKIE} path={cookie_path(model)}"
            )
        return out
    prefix = "nginx.ingress.kubernetes.io"
    out = {
        f"{prefix}/proxy-buffering": "off",
        f"{prefix}/proxy-request-buffering": "off",
        f"{prefix}/proxy-http-version": "1.1",
        f"{prefix}/proxy-read-timeout": str(timeout),
        f"{prefix}/proxy-send-timeout": str(timeout),
        f"{prefix}/proxy-body-size": body,
    }
    if spec.streaming.resume.grace_seconds:
        # A reconnect (Last-Event-ID) must reach the pod that holds the stream; persistent
        # mode keeps the pin when replicas are added (balanced mode would move sessions).
        out |= {
            f"{prefix}/affinity": "cookie",
            f"{prefix}/affinity-mode": "persistent",
            f"{prefix}/session-cookie-name": AFFINITY_COOKIE,
            f"{prefix}/session-cookie-path": cookie_path(model),
        }
    return out


def cookie_path(model: StreamingModel) -> str:
    return model.spec.ingress.path


def desired_ingress(model: StreamingModel) -> dict[str, Any] | None:
    ing = model.spec.ingress
    if not ing.enabled:
        return None
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": ing.path,
                    "pathType": "Prefix",
                    "backend": {"service": backend_service(model)},
                }
            ]
        }
    }
    if ing.host:
        rule = {"host": ing.host, **rule}
    spec: dict[str, Any] = {"ingressClassName": ing.class_name, "rules": [rule]}
    if ing.tls_secret_name:
        spec["tls"] = [{"hosts": [ing.host], "secretName": ing.tls_secret_name}]
    annotations = {
        **streaming_annotations(model),
        **balance_annotations(model),
        **ing.annotations,  # the user's win
    }
    if route_backend(model).via_activator_service:  # it tells models apart by Host
        annotations[UPSTREAM_VHOST] = upstream_host(model)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": metadata(model, annotations=annotations),
        "spec": spec,
    }


def backend_service(model: StreamingModel) -> dict[str, Any]:
    """The Ingress path's backend (`routing.route_backend`): the model's Service, or its
    activator Service for the router, or while the model has no Ready replica (scale to zero;
    ExternalName has no named port: by number). An Ingress cannot name an InferencePool: the
    Service."""
    if route_backend(model).via_activator_service:
        return {"name": activator_service_name(model), "port": {"number": PORT}}
    return {"name": model.name, "port": {"name": PORT_NAME}}


def ingress_url(model: StreamingModel) -> str | None:
    ing = model.spec.ingress
    if not ing.enabled:
        return None
    scheme = "https" if ing.tls_secret_name else "http"
    host = ing.host or "<ingress-address>"
    return f"{scheme}://{host}{ing.path.rstrip('/')}"
