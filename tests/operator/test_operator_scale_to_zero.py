"""Scale to zero (autoscaling.minReplicas 0): the API and its rules, the activator's Service
and models.json, the route switch, the signals read from /metrics pages, the pass that scales
0 <-> 1 (route first), the status and Events, KEDA's ScaledObject, and the poller."""

from __future__ import annotations

import copy
import dataclasses
import json

import jsonschema
import pytest
import yaml
from operator_helpers import (
    KEDA_SCHEMA,
    Events,
    FakeCluster,
    body_of,
    minimal,
    validate_manifest,
    with_status,
)
from sluice_operator.builders.activator import (
    UPSTREAM_VHOST,
    activator_entry,
    desired_models_config_map,
)
from sluice_operator.kinds import ACTIVATOR_SERVICE, CHILD_KINDS, SERVICE, desired_children
from sluice_operator.reconcile import converge
from sluice_operator.scaletozero import (
    DEMAND_PERIOD_SECONDS,
    Signals,
    Step,
    ZeroContext,
    decide,
    held_requests,
    idle_period,
    idle_verdict,
    pod_idle_for,
    unaware,
)
from sluice_operator.scaletozero_poller import ActivatorSettings, ScaleToZeroPoller
from sluice_operator.validation import SpecError, load_model
from testkit.repo import ROOT, shared_crd

NOW = "2026-12-01T06:00:00Z"
HOST = "sluice-activator.sluice-system.svc.cluster.local"
ZERO = {"minReplicas": 0, "maxReplicas": 3, "scaleToZero": {"idleSeconds": 60}}


def zero_body(**autoscaling) -> dict:
    spec = minimal(autoscaling={**ZERO, **autoscaling}, ingress={"enabled": True})
    return body_of(spec)


def model_of(body: dict, via: bool = False):
    return dataclasses.replace(load_model(body), via_activator=via)


# ---- API ---------------------------------------------------------------------------------


def test_min_replicas_zero_fills_in_defaults_and_the_hold_timeout_follows_the_startup_budget():
    m = load_model(minimal(autoscaling={"minReplicas": 0}, startup={"timeoutSeconds": 300}))
    zero = m.spec.scale_to_zero
    assert (zero.idle_seconds, zero.max_held) == (600, 100)
    assert m.spec.hold_timeout_seconds == 360  # startup budget + 60 s
    m = load_model(minimal(autoscaling={"minReplicas": 0, "scaleToZero": {
        "holdTimeoutSeconds": 42}}))  # fmt: skip
    assert m.spec.hold_timeout_seconds == 42
    assert load_model(minimal(autoscaling={})).spec.scale_to_zero is None
    assert load_model(minimal()).spec.scale_to_zero is None


@pytest.mark.parametrize(
    "autoscaling,says",
    [
        ({"enabled": False, "minReplicas": 0}, "needs autoscaling.enabled"),
        ({"minReplicas": 1, "scaleToZero": {}}, "only used with autoscaling.minReplicas 0"),
        ({"minReplicas": 0, "scaleToZero": {"idleSeconds": 10}}, "greater than or equal to 30"),
        ({"minReplicas": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_scale_to_zero_settings_are_rejected(autoscaling, says):
    with pytest.raises(SpecError, match=says):
        load_model(minimal(autoscaling=autoscaling))


# ---- builders ----------------------------------------------------------------------------


def test_activator_service_only_with_min_replicas_zero():
    assert desired_children(load_model(minimal()))["ActivatorService"] is None
    assert desired_children(load_model(minimal(autoscaling={})))["ActivatorService"] is None
    svc = desired_children(model_of(zero_body()))["ActivatorService"]
    assert svc["metadata"]["name"] == "m-activator"
    assert svc["spec"]["type"] == "ExternalName" and svc["spec"]["externalName"] == HOST
    assert "selector" not in svc["spec"]
    validate_manifest(svc, "1.33.0")
    # Applied before the Ingress that names it; one watch for both Services.
    assert CHILD_KINDS.index(ACTIVATOR_SERVICE) < [k.kind for k in CHILD_KINDS].index("Ingress")
    assert ACTIVATOR_SERVICE.index_id == SERVICE.index_id
    assert ACTIVATOR_SERVICE.owner_of("m-activator") == "m"


def test_models_json_entry_is_the_activators_contract():
    m = load_model(zero_body(scaleToZero={"idleSeconds": 60, "maxHeld": 7}))
    assert activator_entry(m) == {
        "host": "m.default.svc.cluster.local",
        "port": 8000,
        "holdTimeoutSeconds": 1860,
        "maxHeld": 7,
        "keepaliveSeconds": 10,
    }
    other = load_model(minimal())
    cm = desired_models_config_map("sluice-activator", "sluice-system", [m, other])
    assert cm["metadata"] == {
        "name": "sluice-activator-models", "namespace": "sluice-system",
        "labels": {"app.kubernetes.io/managed-by": "sluice-operator",
                   "app.kubernetes.io/component": "activator"},
    }  # fmt: skip
    assert json.loads(cm["data"]["models.json"]) == {"default/m": activator_entry(m)}
    validate_manifest(cm, "1.33.0")


def test_ingress_routes_through_the_activator_only_while_asked():
    up = desired_children(model_of(zero_body()))["Ingress"]
    path = up["spec"]["rules"][0]["http"]["paths"][0]
    assert path["backend"] == {"service": {"name": "m", "port": {"name": "http"}}}
    assert UPSTREAM_VHOST not in up["metadata"]["annotations"]
    down = desired_children(model_of(zero_body(), via=True))["Ingress"]
    path = down["spec"]["rules"][0]["http"]["paths"][0]
    assert path["backend"] == {"service": {"name": "m-activator", "port": {"number": 8000}}}
    assert down["metadata"]["annotations"][UPSTREAM_VHOST] == "m.default.svc.cluster.local"
    validate_manifest(down, "1.33.0")


def test_hpa_keeps_one_to_n_with_min_replicas_zero():
    hpa = desired_children(model_of(zero_body()))["HorizontalPodAutoscaler"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    validate_manifest(hpa, "1.33.0")


def test_model_network_policy_admits_the_operator_namespace():
    body = zero_body()
    body["spec"]["networkPolicy"] = {"enabled": True}
    peers = desired_children(model_of(body))["NetworkPolicy"]["spec"]["ingress"][0]["from"]
    names = [v for p in peers for e in (p.get("namespaceSelector") or {}).get(
        "matchExpressions", []) for v in e["values"]]  # fmt: skip
    assert "sluice-system" in names
    body["spec"]["autoscaling"] = {}
    peers = desired_children(model_of(body))["NetworkPolicy"]["spec"]["ingress"][0]["from"]
    assert "sluice-system" not in json.dumps(peers)


def test_keda_scaled_object_goes_to_zero_on_cooldown_and_wakes_on_held_requests():
    """KEDA owns 0 <-> 1: minReplicaCount 0, cooldownPeriod idleSeconds, and a trigger on
    the held gauge that never asks for more than one replica. Checked against our strict
    schema and KEDA's official CRD."""
    m = load_model(zero_body(backend="keda"))
    so = desired_children(m)["ScaledObject"]
    spec = so["spec"]
    assert spec["minReplicaCount"] == 0 and "idleReplicaCount" not in spec
    assert spec["cooldownPeriod"] == 60
    ttft, held = spec["triggers"]
    assert held["name"] == "held-requests" and held["metadata"]["threshold"] == "1"
    assert held["metadata"]["activationThreshold"] == "0"
    q = held["metadata"]["query"]
    assert q.startswith("clamp_max(") and q.endswith(", 1)")
    assert 'namespace="default",model="m"' in q and 'exported_namespace="default"' in q
    assert ttft["name"] == "ttft"
    jsonschema.Draft202012Validator(json.loads(KEDA_SCHEMA.read_text())).validate(so)
    path = shared_crd("keda/keda.sh_scaledobjects.yaml")
    if path is not None:
        crd = yaml.safe_load(path.read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        jsonschema.Draft7Validator(schema).validate(so)
        bad = copy.deepcopy(so)
        bad["spec"]["cooldownPeriod"] = "60"  # negative control: the CRD has teeth
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(schema).validate(bad)
    # Without scale to zero the ScaledObject is as before.
    plain = desired_children(load_model(minimal(autoscaling={"backend": "keda"})))["ScaledObject"]
    assert len(plain["spec"]["triggers"]) == 1 and "cooldownPeriod" not in plain["spec"]


def test_sample_renders_and_validates():
    body = yaml.safe_load_all((ROOT / "samples" / "scale-to-zero.yaml").read_text())
    (body,) = [b for b in body if b]
    children = desired_children(load_model(body))
    assert children["ActivatorService"] is not None
    for manifest in children.values():
        if manifest is not None:
            validate_manifest(manifest, "1.33.0")


# ---- signals -----------------------------------------------------------------------------


def page(last: float, active: int = 0) -> str:
    return (
        f'sluice_last_request_timestamp_seconds{{model="m"}} {last}\n'
        f'sluice_active_streams{{protocol="sse",model="m"}} {active}\n'
        f'sluice_active_streams{{protocol="openai",model="m"}} 0\n'
    )


def activator_page(held: dict, known: list) -> str:
    lines = [f'sluice_activator_held_requests{{namespace="{ns}",model="{n}"}} {v}'
             for (ns, n), v in held.items()]  # fmt: skip
    lines += [f'sluice_activator_models_known{{namespace="{ns}",model="{n}"}} 1' for ns, n in known]
    return "\n".join(lines) + "\n"


def test_pod_idle_time_from_its_page():
    assert pod_idle_for(page(1000.0), now=1100.0) == 100.0
    assert pod_idle_for(page(1000.0, active=1), now=1100.0) == 0.0  # in flight: not idle
    assert pod_idle_for(None, now=1100.0) is None
    assert pod_idle_for("sluice_active_streams 0\n", now=1100.0) is None  # an older server


def test_idle_needs_every_ready_pod_idle_and_readable():
    m = load_model(zero_body())  # idleSeconds 60
    assert idle_verdict(m, {"a": page(0.0), "b": page(10.0)}, now=100.0)[0]
    busy, why = idle_verdict(m, {"a": page(0.0), "b": page(50.0)}, now=100.0)
    assert not busy and "within the last 60s" in why
    assert not idle_verdict(m, {"a": page(0.0), "b": None}, now=100.0)[0]
    assert not idle_verdict(m, {}, now=100.0)[0]
    assert not idle_verdict(m, {"a": page(0.0, active=2)}, now=100.0)[0]
    # The message does not change from one check to the next (no status write per check).
    assert idle_verdict(m, {"a": page(50.0)}, 100.0) == idle_verdict(m, {"a": page(51.0)}, 101.0)


def test_held_requests_are_summed_over_activator_pods_per_model():
    pages = [activator_page({("default", "m"): 3, ("other", "m"): 5}, []),
             activator_page({("default", "m"): 2}, []), None]  # fmt: skip
    assert held_requests(pages, ("default", "m")) == 5
    assert held_requests(pages, ("default", "x")) == 0
    known = {"a": activator_page({}, [("default", "m")]), "b": activator_page({}, []), "c": None}
    assert unaware(known, ("default", "m")) == ["b", "c"]


def workload(replicas: int | None, ready: int) -> dict:
    spec = {} if replicas is None else {"replicas": replicas}
    return {"spec": spec, "status": {"readyReplicas": ready}}


@pytest.mark.parametrize(
    "dep,signals,want",
    [
        (workload(2, 2), Signals(), (False, Step.NONE)),
        (workload(2, 2), Signals(idle=True), (True, Step.TO_ZERO)),
        (workload(0, 0), Signals(), (True, Step.NONE)),
        (workload(0, 0), Signals(held=3), (True, Step.TO_ONE)),
        (workload(1, 0), Signals(held=3), (True, Step.NONE)),  # starting: wait for Ready
        (workload(None, 0), Signals(idle=True), (True, Step.NONE)),
        (None, Signals(), (True, Step.NONE)),  # being created
    ],
)
def test_decide(dep, signals, want):
    assert decide(load_model(zero_body()), dep, signals) == want


def test_keda_and_models_without_scale_to_zero_never_scale():
    keda = load_model(zero_body(backend="keda"))
    assert decide(keda, workload(1, 1), Signals(idle=True)) == (False, Step.NONE)
    assert decide(keda, workload(0, 0), Signals(held=4)) == (True, Step.NONE)
    plain = load_model(minimal(autoscaling={}))
    assert decide(plain, workload(0, 0), Signals(held=4, idle=True)) == (False, Step.NONE)


# ---- the pass ----------------------------------------------------------------------------


class Signalled:
    def __init__(self) -> None:
        self.now = Signals()

    def context(self) -> ZeroContext:
        return ZeroContext(activator_host=HOST, signals=lambda key: self.now)


def _backend(cluster) -> str:
    ing = cluster.objects[("Ingress", "default", "m")]
    return ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"]


def _calls_after(cluster, mark):
    return [c for c in cluster.calls[mark:] if c[0] in ("apply", "scale")]


def test_idle_model_is_routed_to_the_activator_then_scaled_to_zero_and_woken_by_demand():
    cluster, events, sig = FakeCluster(), Events(), Signalled()
    body = zero_body()
    out = converge(cluster, body, events, now=NOW, zero=sig.context())
    assert "ActivatorService" in out.applied
    svc = cluster.objects[("Service", "default", "m-activator")]
    assert svc["spec"]["externalName"] == HOST and svc["metadata"]["ownerReferences"]
    assert _backend(cluster) == "m-activator"  # nothing Ready yet: the activator holds
    # A replica becomes Ready: the route goes to the model's Service.
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    body = with_status(body, cluster)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    assert _backend(cluster) == "m"
    assert cluster.stored_status[("default", "m")]["phase"] == "Ready"
    cond = {c["type"]: c for c in cluster.stored_status[("default", "m")]["conditions"]}
    assert cond["ScaledToZero"]["status"] == "False"
    assert cluster.scaled == []

    # Idle: the route goes to the activator first, then the Deployment is scaled to 0.
    sig.now = Signals(idle=True, why="no request for 60s or more (idleSeconds)")
    body, mark = with_status(body, cluster), len(cluster.calls)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    assert _calls_after(cluster, mark) == [("apply", "Ingress"), ("scale", "Deployment")]
    assert cluster.scaled == [("Deployment", "default", "m", 0)]
    assert _backend(cluster) == "m-activator"
    st = cluster.stored_status[("default", "m")]
    assert st["phase"] == "ScaledToZero" and st["heldRequests"] == 0
    cond = {c["type"]: c for c in st["conditions"]}
    assert (cond["ScaledToZero"]["status"], cond["ScaledToZero"]["reason"]) == ("True", "Idle")
    assert ("Normal", "ScaledToZero") in [(t, r) for t, r, _ in events]

    # The pods are gone; the next passes change nothing (the idle signal is stale now).
    cluster.set_deployment_status("default", "m", replicas=0)
    body = with_status(body, cluster)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    sig.now = Signals()
    body = with_status(body, cluster)
    mark = len(cluster.calls)
    out = converge(cluster, body, events, now=NOW, zero=sig.context())
    assert not _calls_after(cluster, mark) and not out.status_written

    # Demand: 3 requests held -> scaled to 1, phase Activating with the count.
    sig.now = Signals(held=3)
    body = with_status(body, cluster)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    assert cluster.scaled[-1] == ("Deployment", "default", "m", 1)
    st = cluster.stored_status[("default", "m")]
    assert st["phase"] == "Activating" and st["heldRequests"] == 3 and "3 request" in st["message"]
    assert _backend(cluster) == "m-activator"
    activating = [m for t, r, m in events if r == "Activating"]
    assert len(activating) == 1 and "3 request(s)" in activating[0]

    # Ready: route back, Event Activated; the HPA was never touched (it keeps 1..N).
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    sig.now = Signals()
    body = with_status(body, cluster)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    assert _backend(cluster) == "m"
    assert cluster.stored_status[("default", "m")]["phase"] == "Ready"
    assert [r for _, r, _ in events].count("Activated") == 1
    hpa = cluster.objects[("HorizontalPodAutoscaler", "default", "m")]
    assert hpa["spec"]["minReplicas"] == 1 and len(cluster.scaled) == 2


def test_no_idle_signal_no_scale_and_models_without_it_unchanged():
    """Negative control: the same model, Ready, with no idle signal (or no poller at all)
    is never scaled; a model without minReplicas 0 gets no activator Service."""
    cluster, events = FakeCluster(), Events()
    body = zero_body()
    converge(cluster, body, events, now=NOW)
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    for _ in range(2):
        body = with_status(body, cluster)
        converge(cluster, body, events, now=NOW)
    assert cluster.scaled == [] and _backend(cluster) == "m"
    plain = FakeCluster()
    out = converge(plain, body_of(minimal(autoscaling={})), Events(), now=NOW)
    assert "ActivatorService" not in out.applied
    assert ("Service", "default", "m-activator") not in plain.objects


def test_min_replicas_back_above_zero_deletes_the_activator_service():
    cluster, events = FakeCluster(), Events()
    body = zero_body()
    converge(cluster, body, events, now=NOW)
    assert ("Service", "default", "m-activator") in cluster.objects
    body = with_status(body_of(minimal(autoscaling={"maxReplicas": 3},
                                       ingress={"enabled": True})), cluster)  # fmt: skip
    out = converge(cluster, body, events, now=NOW)
    assert "ActivatorService" in out.deleted
    assert ("Service", "default", "m-activator") not in cluster.objects
    assert ("Service", "default", "m") in cluster.objects
    assert _backend(cluster) == "m"


def test_keda_model_is_never_scaled_by_the_operator_only_routed():
    cluster, events, sig = FakeCluster(), Events(), Signalled()
    body = zero_body(backend="keda")
    converge(cluster, body, events, now=NOW, zero=sig.context())
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    sig.now = Signals(idle=True)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    assert cluster.scaled == [] and _backend(cluster) == "m"
    # KEDA scaled it to 0: the route follows.
    cluster.objects[("Deployment", "default", "m")]["spec"]["replicas"] = 0
    cluster.set_deployment_status("default", "m", replicas=0)
    sig.now = Signals(held=2)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    assert cluster.scaled == [] and _backend(cluster) == "m-activator"
    assert cluster.stored_status[("default", "m")]["phase"] == "Activating"


# ---- the poller --------------------------------------------------------------------------


def _ready_pod(name, namespace, ip, labels):
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class PollCluster(FakeCluster):
    def __init__(self) -> None:
        super().__init__()
        self.activators: list[dict] = []

    def list_pods(self, namespace, selector):
        self.calls.append(("list", "Pod"))
        if namespace == "sluice-system":
            return copy.deepcopy(self.activators)
        return copy.deepcopy(self.pods)


def test_poller_keeps_models_json_and_signals_idle_only_when_every_activator_knows_it():
    cluster = PollCluster()
    body = zero_body()
    cluster.store(body)
    converge(cluster, body, Events(), now=NOW)
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1)
    labels = {"app.kubernetes.io/instance": "m", "app.kubernetes.io/managed-by": "sluice-operator"}
    cluster.pods = [_ready_pod("m-abc-1", "default", "10.0.0.5", labels)]
    cluster.activators = [_ready_pod("act-1", "sluice-system", "10.0.1.1", {}),
                          _ready_pod("act-2", "sluice-system", "10.0.1.2", {})]  # fmt: skip
    pages = {"10.0.0.5": page(0.0), "10.0.1.1": activator_page({}, [("default", "m")]),
             "10.0.1.2": activator_page({}, [])}  # fmt: skip
    woken: list = []
    scaler = ScaleToZeroPoller(cluster, cluster.memory,
                        ActivatorSettings("sluice-activator", "sluice-system", "x=y"),
                        wake=woken.extend, page=lambda p: pages.get(p["status"]["podIP"]),
                        clock=lambda: 1000.0)  # fmt: skip
    assert scaler.run_once() == idle_period(load_model(body))  # serving: the idle period
    cm = cluster.objects[("ConfigMap", "sluice-system", "sluice-activator-models")]
    assert json.loads(cm["data"]["models.json"]) == {"default/m": activator_entry(load_model(body))}
    s = scaler.signals(("default", "m"))
    assert not s.idle and "act-2" in s.why  # one activator pod has not loaded it yet
    assert woken == [("default", "m")]
    # Every activator pod knows it now: idle (the next check is due after the period).
    pages["10.0.1.2"] = pages["10.0.1.1"]
    scaler.clock = lambda: 1020.0
    applies = len([c for c in cluster.calls if c == ("apply", "ConfigMap")])
    # Idle: the next round comes a demand period later, not an idle period (the pass scales
    # it to zero now, and a request may arrive at once).
    assert scaler.run_once() == DEMAND_PERIOD_SECONDS < idle_period(load_model(body))
    assert scaler.signals(("default", "m")).idle and woken[-1] == ("default", "m")
    # models.json is applied only when it changes.
    assert len([c for c in cluster.calls if c == ("apply", "ConfigMap")]) == applies
    # At zero: held requests are the signal, read every round.
    cluster.set_deployment_status("default", "m", replicas=0)
    cluster.objects[("Deployment", "default", "m")]["spec"]["replicas"] = 0
    pages["10.0.1.1"] = activator_page({("default", "m"): 2}, [("default", "m")])
    assert scaler.run_once() == 1.0
    assert scaler.signals(("default", "m")) == Signals(held=2)
    # The model goes: its entry leaves models.json (the activator answers 404 for it then).
    del cluster.objects[("StreamingModel", "default", "m")]
    scaler.run_once()
    cm = cluster.objects[("ConfigMap", "sluice-system", "sluice-activator-models")]
    assert json.loads(cm["data"]["models.json"]) == {}
    assert scaler.signals(("default", "m")) == Signals()


def test_poller_without_an_activator_never_signals_idle():
    cluster = PollCluster()
    body = zero_body()
    cluster.store(body)
    converge(cluster, body, Events(), now=NOW)
    cluster.calls.clear()
    scaler = ScaleToZeroPoller(cluster, cluster.memory, None, wake=lambda k: None,
                        page=lambda p: page(0.0), clock=lambda: 1e9)  # fmt: skip
    scaler.run_once()
    assert scaler.signals(("default", "m")) == Signals()
    assert not [c for c in cluster.calls if c[0] in ("apply", "list")]


# ---- the route switch (routing.route_backend, one decision for both routes) ----------------


def test_httproute_names_the_activator_service_with_the_models_host_while_none_is_ready():
    """Gateway API: the same ExternalName Service as the Ingress, and a URLRewrite of the
    Host only (the path is unchanged); checked against our strict schema and the official
    Standard-channel CRD."""
    gw = {"parentRefs": [{"name": "public", "namespace": "gateways"}]}
    body = body_of(minimal(autoscaling=ZERO, gateway=gw))
    up = desired_children(model_of(body))["HTTPRoute"]["spec"]["rules"][0]
    assert up["backendRefs"] == [{"name": "m", "port": 8000}] and "filters" not in up
    route = desired_children(model_of(body, via=True))["HTTPRoute"]
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"name": "m-activator", "port": 8000}]
    assert rule["filters"] == [
        {"type": "URLRewrite", "urlRewrite": {"hostname": "m.default.svc.cluster.local"}}
    ]
    validate_manifest(route, "1.33.0")
    path = shared_crd("gateway-api/standard/gateway.networking.k8s.io_httproutes.yaml")
    if path is not None:
        crd = yaml.safe_load(path.read_text())
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        jsonschema.Draft7Validator(v1["schema"]["openAPIV3Schema"]).validate(route)
        bad = copy.deepcopy(route)  # negative control: the CRD has teeth
        bad["spec"]["rules"][0]["filters"][0]["type"] = "Rewrite"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(v1["schema"]["openAPIV3Schema"]).validate(bad)
    # The pool loses the route to the activator while no replica is Ready, and gets it back.
    pooled = body_of(minimal(autoscaling=ZERO, gateway=gw, routing={"inferencePool": {
        "enabled": True}}))  # fmt: skip
    assert desired_children(model_of(pooled))["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][
        0]["kind"] == "InferencePool"  # fmt: skip
    rule = desired_children(model_of(pooled, via=True))["HTTPRoute"]["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"name": "m-activator", "port": 8000}]


def test_route_backend_condition_follows_the_switch():
    cluster, events, sig = FakeCluster(), Events(), Signalled()
    body = zero_body()
    converge(cluster, body, events, now=NOW, zero=sig.context())
    cond = {c["type"]: c for c in cluster.stored_status[("default", "m")]["conditions"]}
    assert cond["RouteBackend"]["reason"] == "Activator"
    assert "Service m-activator" in cond["RouteBackend"]["message"]
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    cond = {c["type"]: c for c in cluster.stored_status[("default", "m")]["conditions"]}
    assert cond["RouteBackend"]["reason"] == "Service"
    assert cond["RouteBackend"]["message"] == "the Ingress sends requests to Service m"
    # Models without scale to zero and without a Gateway have no such condition.
    plain = FakeCluster()
    converge(plain, body_of(minimal(ingress={"enabled": True})), Events(), now=NOW)
    assert "RouteBackend" not in {c["type"] for c in plain.statuses[-1]["conditions"]}


def test_operator_metrics_count_transitions_and_time_the_activation():
    from prometheus_client import generate_latest
    from sluice_operator.opmetrics import OperatorMetrics

    now = [100.0]
    metrics = OperatorMetrics(clock=lambda: now[0])
    cluster, events = FakeCluster(), Events()
    signals = [Signals()]
    ctx = ZeroContext(activator_host=HOST, signals=lambda key: signals[0], metrics=metrics)
    body = zero_body()
    converge(cluster, body, events, now=NOW, zero=ctx)
    up = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1}
    cluster.set_deployment_status("default", "m", **up)
    signals[0] = Signals(idle=True)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=ctx)
    cluster.set_deployment_status("default", "m", replicas=0)
    signals[0] = Signals(held=1)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=ctx)  # scale to 1 at t=100
    now[0] = 142.0
    cluster.set_deployment_status("default", "m", **up)
    signals[0] = Signals()
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=ctx)  # Ready at t=142
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=ctx)  # nothing new
    text = generate_latest(metrics.registry).decode()
    labels = 'model="m",namespace="default"'
    assert f'sluice_operator_scale_to_zero_transitions_total{{{labels},to="zero"}} 1.0' in text
    assert f'sluice_operator_scale_to_zero_transitions_total{{{labels},to="one"}} 1.0' in text
    assert f"sluice_operator_activation_seconds_count{{{labels}}} 1.0" in text
    assert f"sluice_operator_activation_seconds_sum{{{labels}}} 42.0" in text


def test_multi_node_model_scales_its_leaderworkerset_through_the_scale_subresource():
    """parallelism.nodes > 1: the workload is the LeaderWorkerSet (not watched: read through
    the cluster), scaled in groups like the Deployment."""
    cluster, events, sig = FakeCluster(), Events(), Signalled()
    spec = minimal(autoscaling=ZERO, ingress={"enabled": True}, resources={"gpus": 8},
                   parallelism={"tensor": 8, "pipeline": 2, "nodes": 2})  # fmt: skip
    body = body_of(spec)
    converge(cluster, body, events, now=NOW, zero=sig.context())
    lws = cluster.objects[("LeaderWorkerSet", "default", "m")]
    lws["spec"]["replicas"] = 1
    lws["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    assert _backend(cluster) == "m" and cluster.scaled == []
    sig.now = Signals(idle=True)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    assert cluster.scaled == [("LeaderWorkerSet", "default", "m", 0)]
    assert _backend(cluster) == "m-activator"
    assert cluster.stored_status[("default", "m")]["phase"] == "ScaledToZero"
    lws["status"] = {"replicas": 0}
    sig.now = Signals(held=1)
    converge(cluster, with_status(body, cluster), events, now=NOW, zero=sig.context())
    assert cluster.scaled[-1] == ("LeaderWorkerSet", "default", "m", 1)
