"""The Sluice router (spec.routing.router): the route names the router at every replica
count, the models file lists the model with the pods the router watches, and a model that
opts in while the operator runs no router keeps its Service and says why."""

from __future__ import annotations

import json

from operator_helpers import Events, FakeCluster, body_of, minimal, with_status
from sluice_operator.builders.activator import (
    UPSTREAM_VHOST,
    activator_entry,
    desired_activator_service,
)
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.kvevents import KV_EVENTS_PORT, KV_REPLAY_PORT
from sluice_operator.builders.routing import Backend, route_backend
from sluice_operator.builders.service import desired_service
from sluice_operator.kinds import desired_children
from sluice_operator.reconcile import converge
from sluice_operator.scaletozero import ZeroContext
from sluice_operator.scaletozero_poller import ActivatorSettings, ScaleToZeroPoller
from sluice_operator.validation import load_model

NOW = "2026-12-01T06:00:00Z"
HOST = "sluice-activator.sluice-system.svc.cluster.local"
ROUTER = {"router": {"enabled": True}}
TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
GATEWAY = {"parentRefs": [{"name": "public"}]}


def routed_body(**spec) -> dict:
    return body_of(minimal(replicas=3, ingress={"enabled": True}, routing=ROUTER, **spec))


def conditions(cluster) -> dict:
    return {c["type"]: c for c in cluster.stored_status[("default", "m")]["conditions"]}


def ingress_backend(cluster) -> tuple[str, dict]:
    ing = cluster.objects[("Ingress", "default", "m")]
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    return backend["name"], ing["metadata"]["annotations"]


def test_the_route_names_the_router_whatever_the_replica_count():
    cluster, events = FakeCluster(), Events()
    body = routed_body()
    converge(cluster, body, events, now=NOW, zero=ZeroContext(activator_host=HOST))
    name, annotations = ingress_backend(cluster)
    assert name == "m-activator"
    assert annotations[UPSTREAM_VHOST] == "m.default.svc.cluster.local"
    svc = cluster.objects[("Service", "default", "m-activator")]
    assert svc["spec"]["externalName"] == HOST
    # Every replica Ready: still the router (it places each request on one of them).
    cluster.set_deployment_status("default", "m", replicas=3, readyReplicas=3,
                                  updatedReplicas=3, availableReplicas=3)  # fmt: skip
    converge(cluster, with_status(body, cluster), events, now=NOW,
             zero=ZeroContext(activator_host=HOST))  # fmt: skip
    assert ingress_backend(cluster)[0] == "m-activator"
    cond = conditions(cluster)
    assert (cond["RouteBackend"]["status"], cond["RouteBackend"]["reason"]) == ("True", "Router")
    assert "Service m-activator" in cond["RouteBackend"]["message"]
    assert (cond["RouterReady"]["status"], cond["RouterReady"]["reason"]) == ("True", "Listed")


def test_the_httproute_names_the_router_with_the_models_host():
    m = load_model(body_of(minimal(gateway=GATEWAY, routing=ROUTER)))
    assert route_backend(m) is Backend.ROUTER
    rule = desired_children(m)["HTTPRoute"]["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"name": "m-activator", "port": 8000}]
    assert rule["filters"] == [
        {"type": "URLRewrite", "urlRewrite": {"hostname": "m.default.svc.cluster.local"}}
    ]
    # Negative control: the same model without the router names its Service.
    plain = load_model(body_of(minimal(gateway=GATEWAY)))
    assert desired_children(plain)["HTTPRoute"]["spec"]["rules"][0]["backendRefs"] == [
        {"name": "m", "port": 8000}
    ]


def test_without_the_charts_router_the_route_keeps_the_service_and_a_condition_says_why():
    cluster, events = FakeCluster(), Events()
    off = ZeroContext(activator_host=HOST, router=False)
    converge(cluster, routed_body(), events, now=NOW, zero=off)
    name, annotations = ingress_backend(cluster)
    assert name == "m" and UPSTREAM_VHOST not in annotations
    cond = conditions(cluster)
    assert (cond["RouterReady"]["status"], cond["RouterReady"]["reason"]) == (
        "False",
        "RouterDisabled",
    )
    assert "activator.enabled" in cond["RouterReady"]["message"]
    assert cond["RouteBackend"]["reason"] == "Service"


def test_models_file_entry_lists_the_pods_the_router_watches():
    m = load_model(routed_body())
    entry = activator_entry(m)
    assert entry is not None
    assert entry["pods"] == {
        "namespace": "default",
        "selector": desired_service(m)["spec"]["selector"],
        "port": 8000,
        # Where its vLLM pods publish their KV events (builders/kvevents.py's ports).
        "kvEvents": {"port": KV_EVENTS_PORT, "replayPort": KV_REPLAY_PORT},
    }
    # The simulator publishes no events: its entry names none.
    sim = load_model(routed_body(engine={"backend": "simulator"}))
    assert "kvEvents" not in (activator_entry(sim) or {})["pods"]
    assert entry["host"] == "m.default.svc.cluster.local" and entry["maxHeld"] == 100
    # The router applies spec.routing.balance itself; the pods' template ignores it.
    assert entry["balance"] == "least-loaded"
    rr = load_model(
        body_of(
            minimal(
                replicas=3, ingress={"enabled": True}, routing={**ROUTER, "balance": "round-robin"}
            )
        )
    )
    assert (activator_entry(rr) or {})["balance"] == "round-robin"
    assert desired_deployment(rr) == desired_deployment(m)
    assert desired_activator_service(m) is not None
    # Multi-node: leaders only (workers serve no HTTP).
    lws = load_model(body_of(minimal(routing=ROUTER, **TWO_NODES)))
    pods = (activator_entry(lws) or {})["pods"]
    assert pods["selector"]["serving.sluice.dev/role"] == "leader"
    assert pods["selector"] == desired_service(lws)["spec"]["selector"]
    # Negative controls: no router, no entry; scale to zero alone, no pods.
    assert activator_entry(load_model(body_of(minimal()))) is None
    zero = {"minReplicas": 0, "maxReplicas": 2, "scaleToZero": {}}
    assert "pods" not in (activator_entry(load_model(body_of(minimal(autoscaling=zero)))) or {})


def test_poller_lists_router_models_in_the_models_file():
    cluster = FakeCluster()
    body = routed_body()
    cluster.store(body)
    plain = body_of(minimal())
    plain["metadata"]["name"] = "other"
    cluster.store(plain)
    poller = ScaleToZeroPoller(
        cluster,
        cluster.memory,
        ActivatorSettings("sluice-activator", "sluice-system", "x=y"),
        wake=lambda keys: None,
        page=lambda pod: None,
    )
    poller.run_once()
    cm = cluster.objects[("ConfigMap", "sluice-system", "sluice-activator-models")]
    listed = json.loads(cm["data"]["models.json"])
    assert listed == {"default/m": activator_entry(load_model(body))}
    assert poller.context().router is True
    none = ScaleToZeroPoller(
        cluster, cluster.memory, None, wake=lambda k: None, page=lambda p: None
    )
    assert none.context().router is False


# ---- the KV events (builders/kvevents.py) -------------------------------------------------


def test_network_policy_opens_the_event_ports_to_the_routers_pods_only():
    spec = {"networkPolicy": {"enabled": True}}
    policy = desired_children(load_model(body_of(minimal(routing=ROUTER, **spec))))
    rules = policy["NetworkPolicy"]["spec"]["ingress"]
    events = [r for r in rules if {p["port"] for p in r["ports"]} == {5557, 5558}]
    assert len(events) == 1
    (peer,) = events[0]["from"]
    assert peer["podSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "sluice-activator",
            "app.kubernetes.io/component": "activator",
        }
    }
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["sluice-system"]
    # No other rule opens them: every other rule names the server port only.
    assert all([p["port"] for p in r["ports"]] == [8000] for r in rules if r is not events[0])
    # The router forwards to the pods: its namespace reaches the server port.
    served = rules[0]["from"]
    assert any(p.get("namespaceSelector", {}).get("matchExpressions", [{}])[0].get("values")
               == ["sluice-system"] for p in served)  # fmt: skip
    # Negative control: without the router, no events rule and no operator namespace.
    plain = desired_children(load_model(body_of(minimal(**spec))))["NetworkPolicy"]["spec"]
    assert [r for r in plain["ingress"] if r["ports"][0]["port"] != 8000] == []
    assert "sluice-system" not in str(plain)
