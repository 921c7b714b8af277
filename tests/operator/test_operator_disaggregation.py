"""Disaggregated serving in the operator (spec.disaggregation): the pools it renders, their
connector settings, side-channel ports and NetworkPolicy, the autoscaler per pool, the
router's models-file entry, and the status per pool. The rules' messages (CEL and the
operator alike) are checked on samples/invalid/disaggregation-*.yaml by
test_operator_cel.py and test_operator_crd.py; the vLLM side by test_operator_vllm_flags.py."""

from __future__ import annotations

import json

import pytest
from operator_helpers import FakeCluster, body_of, minimal
from sluice_operator.builders.activator import activator_entry
from sluice_operator.kinds import desired_children
from sluice_operator.models.status import StreamingModelStatus
from sluice_operator.reconcile import converge
from sluice_operator.status_from_cluster import compute_status
from sluice_operator.validation import SpecError, load_model

ROLE = "serving.sluice.dev/role"
ROUTER = {"router": {"enabled": True}}
NOW = "2026-12-05T06:00:00Z"


def disaggregated(**disaggregation):
    return minimal(routing=ROUTER, disaggregation=disaggregation)


def children(body):
    return desired_children(load_model(body))


def pools(body):
    out = children(body)
    return out["PrefillDeployment"], out["DecodeDeployment"]


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args, name):
    return args[args.index(name) + 1]


# --- the API ----------------------------------------------------------------------------


def test_defaults_are_nixl_with_one_replica_per_pool():
    d = load_model(disaggregated()).spec.disaggregation
    assert d.connector.type == "nixl" and d.connector.shared_storage is None
    assert (d.prefill.replicas, d.decode.replicas) == (1, 1)
    assert d.prefill.autoscaling is None and d.decode.autoscaling is None


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"disaggregation": {}}, "disaggregation needs routing.router.enabled"),
        (
            {"routing": ROUTER, "autoscaling": {"minReplicas": 0}, "disaggregation": {}},
            "each pool scales on its own",
        ),
        (
            {
                "routing": ROUTER,
                "disaggregation": {"decode": {"autoscaling": {"minReplicas": 0}}},
            },
            "disaggregation.decode.autoscaling.minReplicas must be at least 1",
        ),
        (
            {"routing": ROUTER, "disaggregation": {"connector": {"type": "sharedStorage"}}},
            "a ReadWriteMany PersistentVolumeClaim",
        ),
        (
            {
                "routing": ROUTER,
                "disaggregation": {"connector": {"sharedStorage": {"claimName": "kv"}}},
            },
            "sharedStorage is only used with type sharedStorage",
        ),
        (
            {"routing": ROUTER, "disaggregation": {"decode": {"tensor": 2}}},
            "got tensor 2 x pipeline 1 = 2 and gpus 1; set tensor: 1",
        ),
    ],
)
def test_what_may_not_be_combined_is_refused_with_a_message(spec, message):
    with pytest.raises(SpecError) as info:
        load_model(minimal(**spec))
    assert message in str(info.value)


def test_pools_size_their_own_gpus_and_tensor_parallelism():
    body = disaggregated(prefill={"gpus": 4, "tensor": 4}, decode={"gpus": 2, "tensor": 2})
    prefill, decode = pools(body)
    for dep, gpus, tp in ((prefill, "4", "4"), (decode, "2", "2")):
        c = container(dep)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert flag(c["args"], "--tensor-parallel-size") == tp


# --- rendering ----------------------------------------------------------------------------


def test_two_deployments_with_disjoint_selectors_and_no_model_deployment():
    out = children(disaggregated(prefill={"replicas": 2}, decode={"replicas": 3}))
    prefill, decode = out["PrefillDeployment"], out["DecodeDeployment"]
    assert out["Deployment"] is None and out["HorizontalPodAutoscaler"] is None
    assert (prefill["metadata"]["name"], decode["metadata"]["name"]) == ("m-prefill", "m-decode")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    for dep, role in ((prefill, "prefill"), (decode, "decode")):
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector[ROLE] == role
        assert dep["spec"]["template"]["metadata"]["labels"][ROLE] == role
        assert dep["metadata"]["labels"][ROLE] == role
        args = container(dep)["args"]
        assert flag(args, "--disaggregation-role") == role
        config = json.loads(flag(args, "--kv-transfer-config"))
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        assert args.index("--kv-transfer-config") < args.index("--")  # a server flag
    # The model's Service (and the router's `pods`) are the decode pool: clients never
    # reach a prefill pod but through the router's first step.
    assert out["Service"]["spec"]["selector"][ROLE] == "decode"
    # One PDB over both pools (their pods carry the model's labels): drains take one pod of
    # the model at a time.
    assert ROLE not in out["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]


def test_nixl_side_channel_is_the_pods_own_address_and_a_named_port():
    prefill, decode = pools(disaggregated())
    for dep in (prefill, decode):
        c = container(dep)
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert {"name": "nixl-side", "containerPort": 5600, "protocol": "TCP"} in c["ports"]


def test_shared_storage_mounts_the_claim_read_write_on_both_pools_and_no_side_port():
    connector = {"type": "sharedStorage", "sharedStorage": {"claimName": "kv-share"}}
    out = children(disaggregated(connector=connector))
    for dep in (out["PrefillDeployment"], out["DecodeDeployment"]):
        c = container(dep)
        config = json.loads(flag(c["args"], "--kv-transfer-config"))
        assert config["kv_connector"] == "ExampleConnector"
        assert config["kv_connector_extra_config"] == {"shared_storage_path": "/mnt/kv-transfer"}
        assert {"name": "kv-transfer", "mountPath": "/mnt/kv-transfer"} in c["volumeMounts"]
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert {"name": "kv-transfer", "persistentVolumeClaim": {"claimName": "kv-share"}} in (
            volumes
        )
        assert 5600 not in [p["containerPort"] for p in c["ports"]]
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in {e["name"] for e in c["env"]}


def test_lora_adapters_are_loaded_on_both_pools():
    body = disaggregated()
    body["spec"]["adapters"] = [{"name": "support", "uri": "hf://org/support", "rank": 16}]
    out = children(body)
    assert out["ConfigMap"] is not None
    for dep in (out["PrefillDeployment"], out["DecodeDeployment"]):
        c = container(dep)
        assert flag(c["args"], "--adapters-file") == "/etc/sluice/adapters/adapters.json"
        assert "adapters" in {m["name"] for m in c["volumeMounts"]}


def test_models_file_entry_names_the_prefill_pool_for_the_router():
    model = load_model(disaggregated())
    entry = activator_entry(model)
    assert entry["pods"]["selector"][ROLE] == "decode"
    prefill = entry["disaggregation"]["prefill"]
    assert prefill["namespace"] == "default" and prefill["port"] == 8000
    assert prefill["selector"] == {
        "app.kubernetes.io/name": "sluice-server",
        "app.kubernetes.io/instance": "m",
        ROLE: "prefill",
    }
    assert prefill["kvEvents"] == {"port": 5557, "replayPort": 5558}
    # Negative control: a router model without disaggregation has neither.
    plain = activator_entry(load_model(minimal(routing=ROUTER)))
    assert "disaggregation" not in plain and ROLE not in plain["pods"]["selector"]


def test_pool_autoscalers_prefill_on_ttft_decode_on_itl_with_their_own_bounds():
    body = disaggregated(
        prefill={"autoscaling": {"maxReplicas": 6, "targetMilliseconds": 800}},
        decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 9, "targetMilliseconds": 40,
                                "percentile": 0.99}},
    )  # fmt: skip
    out = children(body)
    prefill, decode = out["PrefillHorizontalPodAutoscaler"], out["DecodeHorizontalPodAutoscaler"]
    assert prefill["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "m-prefill"}  # fmt: skip
    assert decode["spec"]["scaleTargetRef"]["name"] == "m-decode"
    assert (prefill["spec"]["minReplicas"], prefill["spec"]["maxReplicas"]) == (1, 6)
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (2, 9)
    (pm,), (dm,) = prefill["spec"]["metrics"], decode["spec"]["metrics"]
    assert pm["pods"]["metric"]["name"] == "sluice_ttft_p90_seconds"
    assert pm["pods"]["target"]["averageValue"] == "800m"
    assert dm["pods"]["metric"]["name"] == "sluice_itl_p99_seconds"
    assert dm["pods"]["target"]["averageValue"] == "40m"
    # The HPAs own the pools' replicas: the Deployments leave them out.
    assert "replicas" not in out["PrefillDeployment"]["spec"]
    assert "replicas" not in out["DecodeDeployment"]["spec"]
    # A pool without autoscaling keeps fixed replicas and gets no HPA.
    fixed = children(disaggregated(prefill={"replicas": 2}))
    assert fixed["PrefillHorizontalPodAutoscaler"] is None
    assert fixed["PrefillDeployment"]["spec"]["replicas"] == 2


# --- the NetworkPolicy, evaluated on the rendered output ---------------------------------


def _selects(selector, labels) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _port_matches(rule_ports, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def admits(policies, namespace, pod, source_ns, source_labels, port) -> bool:
    """Kubernetes' semantics for ingress: a pod selected by no policy admits everything;
    else a connection passes when some rule of a selecting policy admits its source and port
    (a peer with only a podSelector is the policy's own namespace)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"]["ingress"]:
            if not _port_matches(rule.get("ports"), port):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                ns_sel = peer.get("namespaceSelector")
                if ns_sel is None:
                    ns_ok = source_ns == namespace
                else:
                    ns_ok = _selects(ns_sel, {"kubernetes.io/metadata.name": source_ns})
                pod_ok = _selects(peer.get("podSelector") or {}, source_labels)
                if ns_ok and pod_ok:
                    return True
    return False


def _pod_labels(role=None, instance="m"):
    labels = {"app.kubernetes.io/name": "sluice-server", "app.kubernetes.io/instance": instance}
    return {**labels, ROLE: role} if role else labels


ROUTER_POD = {
    "app.kubernetes.io/name": "sluice-activator",
    "app.kubernetes.io/component": "activator",
}


@pytest.mark.parametrize("own_policy", [False, True])
def test_side_port_opens_between_the_two_pools_only(own_policy):
    body = disaggregated()
    body["spec"]["networkPolicy"] = {"enabled": own_policy}
    out = children(body)
    policies = [p for p in (out["NetworkPolicy"], out["KvEventsNetworkPolicy"]) if p]
    assert len(policies) == 1
    prefill, decode = _pod_labels("prefill"), _pod_labels("decode")
    # Decode pulls from prefill; the side channel's handshake goes both ways.
    assert admits(policies, "default", prefill, "default", decode, 5600)
    assert admits(policies, "default", decode, "default", prefill, 5600)
    # Nobody else: another model's pod, a plain pod of the namespace, the router, another
    # namespace's pod with the same labels.
    for src_ns, src in [
        ("default", _pod_labels("decode", instance="other")),
        ("default", {"app": "curl"}),
        ("sluice-system", ROUTER_POD),
        ("elsewhere", decode),
    ]:
        assert not admits(policies, "default", prefill, src_ns, src, 5600), (src_ns, src)
    # The server port stays reachable from the namespace and the router; the KV events
    # from the router only.
    assert admits(policies, "default", prefill, "default", {"app": "curl"}, 8000)
    assert admits(policies, "default", decode, "sluice-system", ROUTER_POD, 8000)
    assert admits(policies, "default", decode, "sluice-system", ROUTER_POD, 5557)
    assert not admits(policies, "default", decode, "default", prefill, 5557)


def test_negative_control_without_disaggregation_the_side_port_is_not_closed():
    """A router model without pools: 5600 is nobody's port and its policy leaves it as open
    as every other, so the test above tells a closed port from an open one."""
    out = children(minimal(routing=ROUTER))
    policies = [out["KvEventsNetworkPolicy"]]
    assert admits(policies, "default", _pod_labels(), "elsewhere", {"app": "x"}, 5600)
    assert "5600" not in json.dumps(out["KvEventsNetworkPolicy"]).replace('"port": 5600', "")


# --- status per pool ------------------------------------------------------------------------


def _dep(replicas, ready, current=None):
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas if current is None else current,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def _status(model, prefill, decode, hpas=None):
    out = compute_status(
        model, 1, None, pools={"prefill": prefill, "decode": decode}, pool_hpas=hpas, now=NOW
    )
    StreamingModelStatus.model_validate(out)  # the CRD's status schema takes it
    return out


def _ready(status):
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_status_reports_each_pool_and_one_ready():
    model = load_model(disaggregated(prefill={"replicas": 1}, decode={"replicas": 2}))
    both = _status(model, _dep(1, 1), _dep(2, 2))
    assert both["phase"] == "Ready" and _ready(both)["status"] == "True"
    assert both["pools"]["prefill"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}
    assert both["pools"]["decode"] == {"replicas": 2, "readyReplicas": 2, "ready": "2/2"}
    assert (both["readyReplicas"], both["ready"]) == (3, "3/3")
    assert "prefill 1/1, decode 2/2" in both["message"]


@pytest.mark.parametrize(
    "prefill,decode",
    [
        ((1, 0), (2, 2)),  # no prefill pod: no request can be served
        ((1, 1), (2, 1)),
        ((1, 1, 2), (2, 1)),  # a surge prefill pod does not make up for a missing decode pod
    ],
)
def test_the_model_is_not_ready_while_a_pool_is_short(prefill, decode):
    model = load_model(disaggregated(prefill={"replicas": 1}, decode={"replicas": 2}))
    status = _status(model, _dep(*prefill), _dep(*decode))
    assert _ready(status)["status"] == "False", status["message"]
    assert f"prefill {prefill[1]}/1, decode {decode[1]}/2" in status["message"]


def test_a_missing_pool_deployment_is_pending():
    model = load_model(disaggregated())
    status = _status(model, _dep(1, 1), None)
    assert status["phase"] == "Pending" and _ready(status)["status"] == "False"
    assert "prefill and decode Deployments" in status["message"]
    assert status["pools"]["decode"]["ready"] == "0/1"


def test_pool_status_carries_its_hpas_reading():
    model = load_model(
        disaggregated(prefill={"autoscaling": {}}, decode={"autoscaling": {"percentile": 0.5}})
    )

    def hpa(metric, value):
        reading = {"metric": {"name": metric}, "current": {"averageValue": value}}
        return {"status": {"currentMetrics": [{"type": "Pods", "pods": reading}]}}

    hpas = {"prefill": hpa("sluice_ttft_p90_seconds", "420m"),
            "decode": hpa("sluice_itl_p50_seconds", "35m")}  # fmt: skip
    status = _status(model, _dep(1, 1), _dep(1, 1), hpas)
    assert status["pools"]["prefill"]["metric"] == "sluice_ttft_p90_seconds"
    assert status["pools"]["prefill"]["currentMilliseconds"] == 420
    assert status["pools"]["decode"]["currentMilliseconds"] == 35


def test_a_converge_pass_applies_both_pools_and_reports_them():
    """Through the operator's pass against the fake API server: both Deployments and their
    HPAs applied, owned by the model; the status follows the pools' counts."""
    cluster = FakeCluster()
    body = body_of(disaggregated(decode={"autoscaling": {"maxReplicas": 3}}))
    converge(cluster, body, lambda *a: None, now=NOW)
    names = {(k, n) for (k, _, n) in cluster.objects}
    assert {("Deployment", "m-prefill"), ("Deployment", "m-decode")} <= names
    assert ("HorizontalPodAutoscaler", "m-decode") in names
    assert ("Deployment", "m") not in names
    for name in ("m-prefill", "m-decode"):
        owners = cluster.objects[("Deployment", "default", name)]["metadata"]["ownerReferences"]
        assert owners[0]["uid"] == body["metadata"]["uid"]
    cluster.set_deployment_status("default", "m-prefill", replicas=1, readyReplicas=1,
                                  updatedReplicas=1)  # fmt: skip
    cluster.set_deployment_status("default", "m-decode", replicas=1, readyReplicas=0,
                                  updatedReplicas=1)  # fmt: skip
    converge(cluster, body, lambda *a: None, now=NOW)
    status = cluster.stored_status[("default", "m")]
    assert status["pools"]["prefill"]["ready"] == "1/1"
    assert status["pools"]["decode"]["readyReplicas"] == 0
    assert _ready(status)["status"] == "False"
    cluster.set_deployment_status("default", "m-decode", replicas=1, readyReplicas=1,
                                  updatedReplicas=1)  # fmt: skip
    converge(cluster, body, lambda *a: None, now=NOW)
    status = cluster.stored_status[("default", "m")]
    assert _ready(status)["status"] == "True" and status["phase"] == "Ready"


def test_turning_disaggregation_on_and_off_replaces_the_workload():
    """On: the model's Deployment is deleted in the pass that applies the pools (what
    docs/disaggregation.md warns about); off: the pools and their HPAs go, `<name>` returns."""
    cluster = FakeCluster()
    plain = body_of(minimal(routing=ROUTER))
    converge(cluster, plain, lambda *a: None, now=NOW)
    deployments = lambda: sorted(n for (k, _, n) in cluster.objects if k == "Deployment")  # noqa: E731
    assert deployments() == ["m"]
    pooled = body_of(disaggregated(prefill={"autoscaling": {}}), generation=2)
    converge(cluster, pooled, lambda *a: None, now=NOW)
    assert deployments() == ["m-decode", "m-prefill"]
    assert ("HorizontalPodAutoscaler", "default", "m-prefill") in cluster.objects
    converge(cluster, body_of(minimal(routing=ROUTER), generation=3), lambda *a: None, now=NOW)
    assert deployments() == ["m"]
    assert ("HorizontalPodAutoscaler", "default", "m-prefill") not in cluster.objects
