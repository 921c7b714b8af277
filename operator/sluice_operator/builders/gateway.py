"""The optional Gateway API HTTPRoute (`spec.gateway`), the Ingress's successor.

Written against the `gateway.networking.k8s.io/v1` HTTPRoute of the Standard channel
(Gateway API v1.2 and later, where `rules[].timeouts` is standard):

- `parentRefs`, `hostnames` as given; one rule: `PathPrefix` on `spec.gateway.path` to the
  model's backend (`routing.backend_ref`: its Service port, its InferencePool, or while a
  model at zero has no Ready replica its activator Service, with a URLRewrite of the Host
  only), the path passed on unchanged, as with the Ingress;
- `timeouts.request` and `timeouts.backendRequest`: the stream timeout plus the same margin
  the Ingress gives nginx, so the gateway never cuts a stream the server would still serve
  (implementations default to 15 s or so for a whole request, and a stream is one request).

Gateway API has no request body size field: `spec.limits.maxRequestBytes` is enforced by
the server behind the route (413), and per-implementation policies can add a proxy limit.
Session persistence (`rules[].sessionPersistence`, a session cookie named like the
Ingress's affinity cookie) brings a resumed stream (`streaming.resume.graceSeconds`) back to
the pod that kept it. The field is in Gateway API's Experimental channel (v1.x), so it is
set only when `gateway.sessionPersistence` asks for it: by default the route works on every
conformant implementation with the Standard CRDs. Where the Standard CRD is installed anyway,
the API server refuses a server-side apply that carries the field ("field not declared in
schema", a 500: `schema_lacks_session_persistence`), and a CRD swapped to the Standard one
later prunes it from stored routes. Either way the operator applies the route without it,
compares the route without it from then on (`session_persistence_dropped`: no re-apply on
every pass), and the `GatewayRoute` condition says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..models.resource import StreamingModel
from .common import HASH_ANNOTATION, metadata
from .ingress import AFFINITY_COOKIE, TIMEOUT_MARGIN_SECONDS
from .routing import backend_ref, route_filters

API_VERSION = "gateway.networking.k8s.io/v1"


def route_timeout(model: StreamingModel) -> str:
    """Gateway API Duration ("930s"): the stream timeout plus the proxy margin."""
    return f"{model.spec.streaming.stream_timeout_seconds + TIMEOUT_MARGIN_SECONDS}s"


def wants_session_persistence(model: StreamingModel) -> bool:
    gw = model.spec.gateway
    return bool(gw and gw.session_persistence and model.spec.streaming.resume.grace_seconds)


def session_persistence_dropped(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """The route as applied (same applied-hash annotation) lost its rules' sessionPersistence:
    the API server pruned it (a Standard-channel CRD)."""
    if live is None or desired.get("kind") != "HTTPRoute":
        return False
    applied = (live["metadata"].get("annotations") or {}).get(HASH_ANNOTATION)
    if applied != desired["metadata"]["annotations"][HASH_ANNOTATION]:
        return False
    rules = (live.get("spec") or {}).get("rules") or []
    if len(rules) != len(desired["spec"]["rules"]):
        return False
    pairs = zip(desired["spec"]["rules"], rules, strict=True)
    return any(
        "sessionPersistence" in want and "sessionPersistence" not in have for want, have in pairs
    )


def schema_lacks_session_persistence(exc: Exception) -> bool:
    """The API server refused the route because its HTTPRoute CRD has no sessionPersistence
    (server-side apply: "failed to create typed patch object ...: .spec.rules[0].
    sessionPersistence: field not declared in schema")."""
    body = str(getattr(exc, "body", "") or "")
    return "sessionPersistence" in body and "not declared in schema" in body


def without_session_persistence(desired: dict[str, Any]) -> dict[str, Any]:
    """The route as a Standard-channel CRD stores it."""
    rules = [
        {k: v for k, v in r.items() if k != "sessionPersistence"} for r in desired["spec"]["rules"]
    ]
    return {**desired, "spec": {**desired["spec"], "rules": rules}}


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
        "backendRefs": [backend_ref(model)],
        "timeouts": {"request": timeout, "backendRequest": timeout},
    }
    if filters := route_filters(model):  # the activator's Host (scale to zero)
        rule["filters"] = filters
    if wants_session_persistence(model):
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


SESSION_PERSISTENCE_DROPPED = (
    "the HTTPRoute CRD installed has no rules[].sessionPersistence (Gateway API's Standard "
    "channel), so the route is applied without it: install the Experimental channel CRDs, or "
    "turn gateway.sessionPersistence off. Until then a resumed stream may reach another pod "
    "and get a 404"
)


def route_verdict(
    route: Mapping[str, Any] | None, persistence: bool = False
) -> tuple[bool | None, str, str]:
    """(status, reason, message) of the GatewayRoute condition: whether every parent Gateway
    accepted the HTTPRoute (its status.parents), and, with `persistence` asked for, whether
    the stored route kept its sessionPersistence."""
    rules = ((route or {}).get("spec") or {}).get("rules") or []
    if persistence and rules and not any("sessionPersistence" in r for r in rules):
        return False, "SessionPersistenceDropped", SESSION_PERSISTENCE_DROPPED
    parents = ((route or {}).get("status") or {}).get("parents") or []
    refused = []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        for c in parent.get("conditions") or []:
            if c.get("type") == "Accepted" and c.get("status") != "True":
                who = f"{ref.get('namespace', '')}/{ref.get('name', '?')}".lstrip("/")
                refused.append(f"Gateway {who}: {c.get('reason', '')} {c.get('message', '')}")
    if refused:
        return False, "NotAccepted", "; ".join(refused)[:1024]
    if not parents:
        return None, "Pending", "waiting for a Gateway controller to accept the route"
    return True, "Accepted", "the HTTPRoute is accepted by its Gateways"
