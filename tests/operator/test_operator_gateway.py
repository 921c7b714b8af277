"""Gateway API: the HTTPRoute builder, its schema, the GatewayRoute condition and reconcile."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import (
    HTTPROUTE_SCHEMA,
    ROOT,
    AbsentKind,
    Events,
    FakeCluster,
    body_of,
    load,
    minimal,
    validate_manifest,
    with_status,
)
from sluice_operator.builders.gateway import desired_httproute, route_url
from sluice_operator.builders.ingress import desired_ingress
from sluice_operator.kinds import CHILD_KINDS, GATEWAY_API, HTTPROUTE, desired_children
from sluice_operator.reconcile import converge
from sluice_operator.status_from_cluster import optional_condition
from sluice_operator.validation import SpecError, load_model

NOW = "2026-11-30T06:00:00Z"
GATEWAY = {"parentRefs": [{"name": "public", "namespace": "gateways"}]}


def model(**spec):
    return load_model(minimal(**spec))


@pytest.mark.parametrize("stream_timeout", [60, 600, 3600])
@pytest.mark.parametrize("hostnames", [[], ["chat.example.com", "*.chat.example.com"]])
@pytest.mark.parametrize("path", ["/", "/llm"])
def test_httproute_builder(stream_timeout, hostnames, path):
    m = model(
        streaming={"streamTimeoutSeconds": stream_timeout},
        gateway={**GATEWAY, "hostnames": hostnames, "path": path},
    )
    route = desired_httproute(m)
    validate_manifest(route, "1.35")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "public",
            "namespace": "gateways",
        }
    ]
    assert route["spec"].get("hostnames", []) == hostnames
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": path}}]
    assert rule["backendRefs"] == [{"name": "m", "port": 8000}]
    assert "filters" not in rule  # the path reaches the server unchanged, as with the Ingress
    # Streaming-safe: the gateway must not end a stream the server still serves.
    timeout = int(rule["timeouts"]["request"].removesuffix("s"))
    assert timeout == stream_timeout + 30
    assert rule["timeouts"]["backendRequest"] == rule["timeouts"]["request"]
    assert desired_ingress(m) is None and desired_children(m)["Ingress"] is None


@pytest.mark.parametrize(
    "grace,asked,pinned", [(30, True, True), (0, True, False), (30, False, False)]
)
def test_session_persistence_only_with_resume_and_when_asked(grace, asked, pinned):
    """Resumed streams must reach the pod that kept them: the rule gets the same session
    cookie the Ingress uses, but only when asked (the field is Experimental channel)."""
    m = model(
        streaming={"resume": {"graceSeconds": grace}},
        gateway={**GATEWAY, "sessionPersistence": asked},
    )
    route = desired_httproute(m)
    validate_manifest(route, "1.35")
    (rule,) = route["spec"]["rules"]
    if pinned:
        assert rule["sessionPersistence"] == {
            "sessionName": "sluice-affinity",
            "type": "Cookie",
            "cookieConfig": {"lifetimeType": "Session"},
        }
        ingress = desired_ingress(model(streaming={"resume": {"graceSeconds": grace}},
                                        ingress={"enabled": True}))  # fmt: skip
        assert "sluice-affinity" in ingress["metadata"]["annotations"].values()
    else:
        assert "sessionPersistence" not in rule


def test_route_url_and_no_route_without_gateway():
    m = model(gateway={**GATEWAY, "hostnames": ["chat.example.com"], "path": "/chat/"})
    assert route_url(m) == "http://chat.example.com/chat"
    m = model(gateway={**GATEWAY, "scheme": "https"})
    assert route_url(m) == "https://<gateway-address>"
    assert desired_httproute(model()) is None and route_url(model()) is None


def test_schema_has_teeth():
    route = desired_httproute(model(gateway=GATEWAY))
    schema = json.loads(HTTPROUTE_SCHEMA.read_text())
    for breakage in (
        lambda r: r["spec"]["rules"][0]["timeouts"].update(request="10 minutes"),
        lambda r: r["spec"]["rules"][0].update(timeout="630s"),
        lambda r: r["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix"),
        lambda r: r["spec"].update(hostnames=["Chat.Example.com"]),
        lambda r: r["spec"]["rules"][0].update(sessionPersistence={"type": "Sticky"}),
        lambda r: r["spec"]["rules"][0].update(sessionPersistence={"cookieName": "x"}),
    ):
        bad = copy.deepcopy(route)
        breakage(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(schema).validate(bad)


def test_gateway_and_ingress_are_exclusive():
    with pytest.raises(SpecError, match="exclusive"):
        model(gateway=GATEWAY, ingress={"enabled": True})


def test_gateway_sample_renders_a_route_and_no_ingress():
    m = load_model(load(ROOT / "samples/gateway.yaml"))
    children = {k: v for k, v in desired_children(m).items() if v}
    assert set(children) >= {"HTTPRoute", "Service", "Deployment"} and "Ingress" not in children
    for manifest in children.values():
        validate_manifest(manifest, "1.35")


def _route_status(*accepted):
    return {
        "parents": [
            {
                "parentRef": {"name": f"gw{i}", "namespace": "gateways"},
                "conditions": [
                    {"type": "Accepted", "status": s, "reason": r, "message": "because"}
                ],
            }
            for i, (s, r) in enumerate(accepted)
        ]
    }


@pytest.mark.parametrize(
    "route,problem,status,reason",
    [
        (None, None, "Unknown", "Pending"),
        ({"status": {}}, None, "Unknown", "Pending"),
        ({"status": _route_status(("True", "Accepted"))}, None, "True", "Accepted"),
        (
            {"status": _route_status(("True", "Accepted"), ("False", "NotAllowedByListeners"))},
            None,
            "False",
            "NotAccepted",
        ),
        (None, 404, "False", "GatewayAPIUnavailable"),
        (None, 403, "False", "GatewayAPIUnavailable"),
    ],
)
def test_gateway_condition(route, problem, status, reason):
    refused = GATEWAY_API.unavailable(ApiException(status=problem)) if problem else None
    cond = optional_condition(GATEWAY_API, model(gateway=GATEWAY), route, refused)
    assert (cond["type"], cond["status"], cond["reason"]) == ("GatewayRoute", status, reason)
    if reason == "NotAccepted":
        assert "gateways/gw1: NotAllowedByListeners because" in cond["message"]


# ---- reconcile ---------------------------------------------------------------------------


def test_route_is_applied_and_status_url_comes_from_it():
    cluster = FakeCluster()
    body = body_of(minimal(gateway={**GATEWAY, "hostnames": ["chat.example.com"]}))
    out = converge(cluster, body, Events(), now=NOW)
    assert "HTTPRoute" in out.applied and ("Ingress", "default", "m") not in cluster.objects
    route = cluster.objects[("HTTPRoute", "default", "m")]
    assert route["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    status = cluster.statuses[-1]
    assert status["url"] == "http://chat.example.com"
    assert status["endpoints"]["sse"] == "http://chat.example.com/v1/stream"
    cond = {c["type"]: c for c in status["conditions"]}["GatewayRoute"]
    assert cond["status"] == "Unknown"
    # The Gateway accepts it: one status write, then a settled resync writes nothing.
    route["status"] = _route_status(("True", "Accepted"))
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["GatewayRoute"][
        "status"
    ] == "True"
    cluster.calls.clear()
    out = converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert cluster.writes() == [] and not out.status_written


def test_switch_ingress_to_gateway_and_back_never_leaves_both():
    cluster = FakeCluster()
    body = body_of(minimal(ingress={"enabled": True, "host": "chat.example.com"}))
    converge(cluster, body, Events(), now=NOW)
    assert ("Ingress", "default", "m") in cluster.objects
    body = with_status(body, cluster)
    body["spec"]["ingress"] = {"enabled": False}
    body["spec"]["gateway"] = GATEWAY
    cluster.calls.clear()
    out = converge(cluster, body, Events(), now=NOW)
    assert out.deleted == ["Ingress"] and "HTTPRoute" in out.applied
    writes = cluster.writes()
    assert writes.index(("delete", "Ingress")) < writes.index(("apply", "HTTPRoute"))
    body = with_status(body, cluster)
    del body["spec"]["gateway"]
    body["spec"]["ingress"] = {"enabled": True, "host": "chat.example.com"}
    cluster.calls.clear()
    out = converge(cluster, body, Events(), now=NOW)
    assert out.deleted == ["HTTPRoute"] and "Ingress" in out.applied
    writes = cluster.writes()
    assert writes.index(("apply", "Ingress")) < writes.index(("delete", "HTTPRoute"))
    body = with_status(body, cluster)
    assert not any(c["type"] == "GatewayRoute" for c in body["status"]["conditions"])
    # Once back on the Ingress the operator stops looking for routes.
    cluster.calls.clear()
    converge(cluster, body, Events(), now=NOW)
    assert ("get", "HTTPRoute") not in cluster.calls


def test_models_without_a_gateway_never_touch_httproutes():
    cluster = AbsentKind("HTTPRoute", 403)
    converge(cluster, body_of(minimal()), Events(), now=NOW)
    assert not [c for c in cluster.calls if c[1] == "HTTPRoute"]
    assert HTTPROUTE not in CHILD_KINDS  # not watched either


@pytest.mark.parametrize(
    "refuse,says", [(404, "Gateway API is not installed"), (403, "may not manage")]
)
def test_missing_gateway_api_is_a_condition_the_rest_converges_and_it_retries(refuse, says):
    cluster = AbsentKind("HTTPRoute", refuse)
    body = body_of(minimal(gateway=GATEWAY))
    events = Events()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert ("Deployment", "default", "m") in cluster.objects
    assert ("Service", "default", "m") in cluster.objects
    cond = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["GatewayRoute"]
    assert cond["status"] == "False" and cond["reason"] == "GatewayAPIUnavailable"
    assert says in cond["message"]
    assert [(t, r) for t, r, _ in events if r != "Reconciled"] == [
        ("Warning", "GatewayAPIUnavailable")
    ]
    # The retry: same problem, no second Event and no status write.
    events.clear()
    cluster.calls.clear()
    with pytest.raises(ApiException):
        converge(cluster, with_status(body, cluster), events, now=NOW)
    assert events == [] and not [w for w in cluster.writes() if w[0] == "patch_status"]
    # Installed: the route appears and the condition turns over.
    cluster.refuse = 0
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert ("HTTPRoute", "default", "m") in cluster.objects
    cond = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["GatewayRoute"]
    assert cond["reason"] == "Pending"


class StandardChannelCluster(FakeCluster):
    """The Standard-channel HTTPRoute CRD, which has no `rules[].sessionPersistence`: a
    server-side apply carrying it is refused (as the real API server does: a 500), and with
    `installed_later` the route was stored under the Experimental CRD and reads back pruned."""

    def __init__(self, installed_later: bool = False) -> None:
        super().__init__()
        self.installed_later = installed_later

    def apply(self, manifest):
        rules = manifest["spec"]["rules"] if manifest["kind"] == "HTTPRoute" else []
        if any("sessionPersistence" in r for r in rules):
            if not self.installed_later:
                self.calls.append(("apply", "HTTPRoute"))
                exc = ApiException(status=500, reason="Internal Server Error")
                exc.body = ("failed to create typed patch object (default/m; gateway.networking."
                            "k8s.io/v1, Kind=HTTPRoute): .spec.rules[0].sessionPersistence: "
                            "field not declared in schema")  # fmt: skip
                raise exc
            stored = super().apply(manifest)
            for rule in self.objects[("HTTPRoute", "default", "m")]["spec"]["rules"]:
                rule.pop("sessionPersistence")  # the CRD is swapped: reads come back pruned
            return stored
        return super().apply(manifest)


@pytest.mark.parametrize("cluster,reason", [
    (StandardChannelCluster(), "SessionPersistenceDropped"),
    (StandardChannelCluster(installed_later=True), "SessionPersistenceDropped"),
    (FakeCluster(), "Accepted"),
], ids=["standard", "standard-later", "experimental"])  # fmt: skip
def test_session_persistence_the_crd_lacks_is_reported_and_not_reapplied(cluster, reason):
    body = body_of(minimal(gateway={**GATEWAY, "sessionPersistence": True},
                           streaming={"resume": {"graceSeconds": 30}}))  # fmt: skip
    events = Events()
    converge(cluster, body, events, now=NOW)
    route = cluster.objects[("HTTPRoute", "default", "m")]  # applied, with or without it
    route["status"] = _route_status(("True", "Accepted"))
    if isinstance(cluster, StandardChannelCluster) and not cluster.installed_later:
        assert "sessionPersistence" not in route["spec"]["rules"][0]
        assert ("Warning", "SessionPersistenceUnsupported") in [e[:2] for e in events]
    for _ in range(3):
        cluster.calls.clear()
        out = converge(cluster, with_status(body, cluster), Events(), now=NOW)
        assert out.applied == [], cluster.calls
    cond = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["GatewayRoute"]
    assert cond["reason"] == reason
    if reason == "SessionPersistenceDropped":
        assert cond["status"] == "False" and "Experimental channel" in cond["message"]
    # A spec change is still applied (the hash differs).
    body = with_status(body, cluster)
    body["spec"]["gateway"]["hostnames"] = ["chat.example.com"]
    assert "HTTPRoute" in converge(cluster, body, Events(), now=NOW).applied
    assert cluster.objects[("HTTPRoute", "default", "m")]["spec"]["hostnames"] == [
        "chat.example.com"
    ]


def test_gateway_condition_says_when_session_persistence_was_dropped():
    kept = {"spec": {"rules": [{"sessionPersistence": {}}]}, "status": _route_status(("True", "A"))}
    dropped = {"spec": {"rules": [{}]}, "status": _route_status(("True", "A"))}
    persistent = model(gateway={**GATEWAY, "sessionPersistence": True},
                       streaming={"resume": {"graceSeconds": 30}})  # fmt: skip
    plain = model(gateway=GATEWAY)
    assert optional_condition(GATEWAY_API, persistent, kept)["reason"] == "Accepted"
    assert optional_condition(GATEWAY_API, plain, dropped)["reason"] == "Accepted"
    cond = optional_condition(GATEWAY_API, persistent, dropped)
    assert (cond["status"], cond["reason"]) == ("False", "SessionPersistenceDropped")
