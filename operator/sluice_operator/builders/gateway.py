"""The optional Gateway API HTTPRoute (`spec.gateway`), the Ingress's successor.

Written against the `gateway.networking.k8s.io/v1` HTTPRoute of the Standard channel
(Gateway API v1.2 and later, where `rules[].timeouts` is standard):

- `parentRefs`, `hostnames` as given; one rule: `PathPrefix` on `spec.gateway.path` to the
  model's Service port, the path passed on unchanged (no URLRewrite), as with the Ingress;
- `timeouts.request` and `timeouts.backendRequest`: the stream timeout plus the same margin
  the Ingress gives nginx, so the gateway never cuts a stream the server would still serve
  (implementations default to 15 s or so for a whole request, and a stream is one request).

Gateway API has no request body size field: `spec.limits.maxRequestBytes` is enforced by
the server behind the route (413), and per-implementation policies can add a proxy limit.
Session persistence (`rules[].sessionPersistence`, a session cookie named like the
Ingress's affinity cookie) brings a resumed stream (`streaming.resume.graceSeconds`) back to
the pod that kept it. The field is in Gateway API's Experimental channel (v1.x), so it is
set only when `gateway.sessionPersistence` asks for it: by default the route works on every
conformant implementation with the Standard CRDs.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import PORT, metadata
from .ingress import AFFINITY_COOKIE, TIMEOUT_MARGIN_SECONDS

API_VERSION = "gateway.networking.k8s.io/v1"


def route_timeout(model: StreamingModel) -> str:
    """Gateway API Duration ("930s"): the stream timeout plus the proxy margin."""
    return f"{model.spec.streaming.stream_timeout_seconds + TIMEOUT_MARGIN_SECONDS}s"


def desired_httproute(model: StreamingModel) -> dict[str, Any] | None:
    gw = model.spec.gateway
    if gw is None:
        return None
    parents = [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway"}
        | p.model_dump(by_alias=True, exclude_none=True)
        for p in gw.parent_refs
    ]
    timeout = route_timeout(model)
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": gw.path}}],
        "backendRefs": [{"name": model.name, "port": PORT}],
        "timeouts": {"request": timeout, "backendRequest": timeout},
    }
    if gw.session_persistence and model.spec.streaming.resume.grace_seconds:
        # Experimental channel: a session cookie, gone when the browser session ends.
        rule["sessionPersistence"] = {
            "sessionName": AFFINITY_COOKIE,
            "type": "Cookie",
            "cookieConfig": {"lifetimeType": "Session"},
        }
    spec: dict[str, Any] = {"parentRefs": parents, "rules": [rule]}
    if gw.hostnames:
        spec["hostnames"] = list(gw.hostnames)
    return {
        "apiVersion": API_VERSION,
        "kind": "HTTPRoute",
        "metadata": metadata(model),
        "spec": spec,
    }


def route_url(model: StreamingModel) -> str | None:
    gw = model.spec.gateway
    if gw is None:
        return None
    host = gw.hostnames[0] if gw.hostnames else "<gateway-address>"
    return f"{gw.scheme}://{host}{gw.path.rstrip('/')}"
