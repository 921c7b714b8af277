"""Routing over replicas: the Ingress's balancing annotations per controller, the
InferencePool builder (against GAIE v1.6.0's official CRD schema where ../shared/crds is
present), the one backend switch of the HTTPRoute and its RouteBackend condition, and a
switch pool <-> Service through reconcile that never leaves both."""

from __future__ import annotations

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from operator_helpers import (
    AbsentKind,
    Events,
    FakeCluster,
    body_of,
    minimal,
    validate_manifest,
    with_status,
)
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.gateway import desired_httproute
from sluice_operator.builders.ingress import balance_annotations, desired_ingress
from sluice_operator.builders.leaderworkerset import desired_leaderworkerset
from sluice_operator.builders.routing import (
    Backend,
    backend_ref,
    desired_inference_pool,
    route_backend,
)
from sluice_operator.builders.service import desired_service
from sluice_operator.kinds import GATEWAY_API_INFERENCE_EXTENSION
from sluice_operator.reconcile import converge
from sluice_operator.status_from_cluster import reported
from sluice_operator.validation import SpecError, load_model
from testkit.repo import shared_crd

NOW = "2026-12-01T06:00:00Z"
GATEWAY = {"parentRefs": [{"name": "public"}]}
EPP = {"name": "m-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
EPP_LABELS = {"llm-d.ai/engine-type": "vllm", "llm-d.ai/role": "both"}
TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
POOL_CRD = shared_crd(
    "gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml"
)


def model(**spec):
    return load_model(minimal(**spec))


@pytest.mark.parametrize(
    ("ingress", "balance", "want"),
    [
        ({"className": "nginx-org"}, None, {"nginx.org/lb-method": "least_conn"}),
        ({"className": "nginx-org"}, "round-robin", {"nginx.org/lb-method": "round_robin"}),
        ({"controller": "f5-nginx"}, "least-loaded", {"nginx.org/lb-method": "least_conn"}),
        ({}, None, {"nginx.ingress.kubernetes.io/load-balance": "round_robin"}),
        ({}, "round-robin", {"nginx.ingress.kubernetes.io/load-balance": "round_robin"}),
    ],
)
def test_balance_maps_to_each_controllers_method(ingress, balance, want):
    routing = {"balance": balance} if balance else {}
    m = model(ingress={"enabled": True, **ingress}, routing=routing)
    assert balance_annotations(m) == want
    annotations = desired_ingress(m)["metadata"]["annotations"]
    assert want.items() <= annotations.items()
    # The other controller's key never leaks in.
    other = "nginx.ingress" if "nginx.org/lb-method" in want else "nginx.org/lb-method"
    assert not [k for k in annotations if k.startswith(other)]


def test_balance_keeps_the_affinity_cookie_with_resume_and_the_users_annotation_wins():
    m = model(
        ingress={
            "enabled": True,
            "annotations": {"nginx.ingress.kubernetes.io/load-balance": "ewma"},
        },
        streaming={"resume": {"graceSeconds": 30}},
    )
    annotations = desired_ingress(m)["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert annotations["nginx.ingress.kubernetes.io/load-balance"] == "ewma"
    f5 = desired_ingress(
        model(
            ingress={"enabled": True, "className": "nginx-org"},
            streaming={"resume": {"graceSeconds": 30}},
        )  # fmt: skip
    )["metadata"]["annotations"]
    assert "nginx.org/sticky-cookie-services" in f5 and f5["nginx.org/lb-method"] == "least_conn"


def test_unknown_balance_is_refused():
    with pytest.raises(SpecError, match="balance"):
        model(routing={"balance": "random"})


def test_no_pool_by_default():
    m = model(gateway=GATEWAY)
    assert desired_inference_pool(m) is None
    assert route_backend(m) is Backend.SERVICE


@pytest.mark.parametrize("epp", [EPP, None], ids=["epp", "no-epp"])
@pytest.mark.parametrize("protocol", ["http", "kubernetes.io/h2c"])
def test_pool_selects_exactly_the_models_pods(epp, protocol):
    pool_spec = {"enabled": True, "appProtocol": protocol}
    if epp:
        pool_spec["endpointPicker"] = epp
    m = model(routing={"inferencePool": pool_spec})
    pool = desired_inference_pool(m)
    validate_manifest(pool, "1.35")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool" and pool["metadata"]["name"] == "m"
    deployment = desired_deployment(m)
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "server"]  # fmt: skip
    ports = {p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == sorted(ports)
    assert pool["spec"]["appProtocol"] == protocol
    if epp:
        assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", **EPP}
    else:
        assert "endpointPickerRef" not in pool["spec"]
    if POOL_CRD is not None:  # the official schema (CEL aside: tests/e2e runs the API server)
        import jsonschema

        crd = yaml.safe_load(POOL_CRD.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        validator = jsonschema.Draft202012Validator(version["schema"]["openAPIV3Schema"])
        validator.validate(pool)
        # The schema check can fail: a pool with no target port is refused.
        with pytest.raises(jsonschema.ValidationError):
            validator.validate({**pool, "spec": {**pool["spec"], "targetPorts": []}})


def test_the_route_names_one_backend_the_switch_decides():
    service = model(gateway=GATEWAY)
    pooled = model(gateway=GATEWAY, routing={"inferencePool": {"enabled": True}})
    for m, want in ((service, {"name": "m", "port": 8000}),
                    (pooled, {"group": "inference.networking.k8s.io",
                              "kind": "InferencePool", "name": "m"})):  # fmt: skip
        (rule,) = desired_httproute(m)["spec"]["rules"]
        assert rule["backendRefs"] == [want] == [backend_ref(m)]


def _conditions(cluster):
    return {c["type"]: c for c in cluster.statuses[-1]["conditions"]}


def test_switch_pool_to_service_and_back_leaves_exactly_one_backend():
    cluster = FakeCluster()
    body = body_of(minimal(gateway=GATEWAY, routing={"inferencePool": {"enabled": True}}))
    converge(cluster, body, Events(), now=NOW)
    assert ("InferencePool", "default", "m") in cluster.objects
    route = cluster.objects[("HTTPRoute", "default", "m")]
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    backend = _conditions(cluster)["RouteBackend"]
    assert (backend["status"], backend["reason"]) == ("True", "InferencePool")
    assert _conditions(cluster)["InferencePoolReady"]["status"] == "True"

    body = with_status(body, cluster)
    body["spec"] = minimal(gateway=GATEWAY)["spec"]
    converge(cluster, body, Events(), now=NOW)
    assert ("InferencePool", "default", "m") not in cluster.objects
    route = cluster.objects[("HTTPRoute", "default", "m")]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "m", "port": 8000}]
    conditions = _conditions(cluster)
    assert (conditions["RouteBackend"]["status"], conditions["RouteBackend"]["reason"]) == (
        "True",
        "Service",
    )
    assert "InferencePoolReady" not in conditions

    body = with_status(body, cluster)
    body["spec"] = minimal(gateway=GATEWAY, routing={"inferencePool": {"enabled": True}})["spec"]
    converge(cluster, body, Events(), now=NOW)
    route = cluster.objects[("HTTPRoute", "default", "m")]
    assert [r["kind"] for r in route["spec"]["rules"][0]["backendRefs"]] == ["InferencePool"]


def test_pool_crd_missing_says_so_in_the_backend_condition_and_the_route_still_converges():
    cluster = AbsentKind("InferencePool", 404)
    body = body_of(minimal(gateway=GATEWAY, routing={"inferencePool": {"enabled": True}}))
    events = Events()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert ("HTTPRoute", "default", "m") in cluster.objects
    row = GATEWAY_API_INFERENCE_EXTENSION
    assert reported(row, cluster.statuses[-1]) == row.missing
    backend = _conditions(cluster)["RouteBackend"]
    assert (backend["status"], backend["reason"]) == ("False", "InferencePoolUnavailable")
    assert backend["message"] == row.missing
    assert [e[1] for e in events if e[0] == "Warning"] == [row.event]


def test_vllm_pods_of_a_pool_carry_the_labels_an_endpoint_picker_reads():
    pool = {"inferencePool": {"enabled": True}}

    def pod_labels(**spec):
        return desired_deployment(model(**spec))["spec"]["template"]["metadata"]["labels"]

    assert EPP_LABELS.items() <= pod_labels(routing=pool).items()
    role = pod_labels(routing=pool, podLabels={"llm-d.ai/role": "decode"})["llm-d.ai/role"]
    assert role == "decode"
    # Without a pool the pod template is what it was: an operator upgrade rolls no pod.
    assert not [k for k in pod_labels() if k.startswith("llm-d.ai/")]
    simulated = pod_labels(routing=pool, engine={"backend": "simulator"})
    assert not [k for k in simulated if k.startswith("llm-d.ai/")]


def test_a_multi_node_pool_selects_the_leaders_and_the_route_takes_the_same_switch():
    m = model(gateway=GATEWAY, routing={"inferencePool": {"enabled": True}}, **TWO_NODES)
    lws = desired_leaderworkerset(m)["spec"]["leaderWorkerTemplate"]
    leader, worker = lws["leaderTemplate"], lws["workerTemplate"]
    selector = desired_inference_pool(m)["spec"]["selector"]["matchLabels"]
    assert selector == desired_service(m)["spec"]["selector"]
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    assert EPP_LABELS.items() <= leader["metadata"]["labels"].items()
    assert not [k for k in worker["metadata"]["labels"] if k.startswith("llm-d.ai/")]
    assert route_backend(m) is Backend.INFERENCE_POOL
    (rule,) = desired_httproute(m)["spec"]["rules"]
    assert rule["backendRefs"] == [backend_ref(m)]
    assert backend_ref(m)["kind"] == "InferencePool"
