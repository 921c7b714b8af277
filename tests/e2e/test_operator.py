"""Items 1, 2, 5, 6, 7 and 9: the operator turns StreamingModels into working children."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time

import pytest
import yaml
from e2e_harness.control_plane import is_write
from e2e_harness.expect import CHECKS, TTFT_METRIC, children_present, expected_kinds
from e2e_harness.kube import GROUP, PLURAL, SAMPLES, VERSION, eventually, load_sample
from e2e_harness.operator_process import find_kubectl
from kubernetes import client
from testkit.repo import ROOT

from .conftest import TIMINGS

SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.yaml"))
_latencies: list[float] = []


def converge(models, namespace: str, name: str, timeout: float = 20.0) -> tuple[dict, dict]:
    """Wait until exactly the expected children exist; return (model, children)."""

    def ready():
        model = models.get(namespace, name)
        children = models.children(namespace, name)
        return children_present(children, model["spec"]) and (model, children)

    return eventually(ready, timeout=timeout, message=f"children of {namespace}/{name}")


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_sample_children_appear_with_expected_fields(operator, models, namespace, sample):
    body = load_sample(sample, namespace)
    name = body["metadata"]["name"]
    started = time.monotonic()
    models.create(body)
    model, children = converge(models, namespace, name)
    _latencies.append(time.monotonic() - started)
    TIMINGS["apply -> all children present, per sample (s)"] = (
        f"median {statistics.median(_latencies):.2f}, worst {max(_latencies):.2f} (n={len(_latencies)})"
    )
    for kind in expected_kinds(model["spec"]):
        CHECKS[kind](children[kind], model)


def settle(models, namespace: str, name: str, quiet: float = 4.0, timeout: float = 45.0) -> None:
    """Wait until the StreamingModel has not changed for `quiet` seconds."""
    seen = {"version": None, "since": time.monotonic()}

    def quiet_for_long_enough() -> bool:
        version = models.get(namespace, name)["metadata"]["resourceVersion"]
        if version != seen["version"]:
            seen.update(version=version, since=time.monotonic())
            return False
        return time.monotonic() - seen["since"] >= quiet

    eventually(quiet_for_long_enough, timeout=timeout, interval=0.2,
               message=f"{namespace}/{name} to stop changing for {quiet:g} s")  # fmt: skip


def _table(admin: client.ApiClient, namespace: str) -> dict:
    """What `kubectl get streamingmodels` shows: the server-side Table with the printer columns."""
    method, url, headers, body, _ = admin.param_serialize(
        "GET",
        f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )
    response = admin.call_api(method, url, header_params=headers, body=body)
    response.read()
    return json.loads(response.data)


def test_pods_run_on_the_gpu_node_and_status_turns_ready(
    operator, admin, models, namespace, gpu_node, control_plane
):
    # chat-small with 2 replicas x 2 GPUs behind an Ingress (the mistral sample's PVC has no
    # volume here, so its pods could not schedule).
    body = load_sample("chat-small.yaml", namespace, new_name="chat")
    body["spec"].update(
        {
            "replicas": 2,
            "resources": {"gpus": 2},
            "parallelism": {"tensor": 2},
            "ingress": {"enabled": True, "host": "chat.example.com", "path": "/chat"},
        }
    )
    name = body["metadata"]["name"]
    started = time.monotonic()
    models.create(body)

    def ready():
        status = models.get(namespace, name).get("status") or {}
        return status.get("phase") == "Ready" and status.get("readyReplicas") == 2 and status

    status = eventually(ready, timeout=30, message="status Ready with 2 ready replicas")
    TIMINGS["apply -> status Ready, 2 pods on the fake node (s)"] = round(
        time.monotonic() - started, 2
    )
    pods = models.pods(namespace, name)
    assert len(pods) == 2
    for pod in pods:
        assert pod.spec.node_name == gpu_node.name
        limits = pod.spec.containers[0].resources.limits
        assert limits["nvidia.com/gpu"] == "2"
    assert status["url"].startswith("http://chat.example.com/chat")
    assert set(status["endpoints"]) >= {"openai", "sse"}
    # Every endpoint hangs off the URL (WebSocket with ws:// instead of http://).
    base = status["url"].split("://", 1)[1].rstrip("/")
    for url in status["endpoints"].values():
        assert url.split("://", 1)[1].startswith(base), (url, base)
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "True" and conditions["Available"] == "True"

    table = _table(admin, namespace)
    columns = [c["name"] for c in table["columnDefinitions"]]
    row = dict(zip(columns, table["rows"][0]["cells"], strict=True))
    assert row["Name"] == name
    assert "2/2" in str(row.values()) and str(status["url"]) in row.values(), row
    kubectl = find_kubectl()
    if kubectl:  # the same through a real kubectl, for the eye
        out = subprocess.run(
            [
                kubectl,
                "--kubeconfig",
                str(control_plane.kubeconfigs["admin"]),
                "get",
                "streamingmodels",
                "-n",
                namespace,
                "-o",
                "wide",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        print(out)
        assert name in out and "2/2" in out


def test_edit_converges_and_observed_generation_follows(operator, models, namespace):
    body = load_sample("chat-small.yaml", namespace)
    body["spec"].update(
        {
            "resources": {"gpus": 2},
            "parallelism": {"tensor": 2},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
        }
    )
    name = body["metadata"]["name"]
    models.create(body)
    converge(models, namespace, name)
    models.patch(
        namespace,
        name,
        {
            "spec": {
                "resources": {"gpus": 4},
                "parallelism": {"tensor": 4},
                "streaming": {"protocols": ["websocket"]},
                "autoscaling": {"minReplicas": 2, "maxReplicas": 3},
            }
        },
    )

    def converged():
        model = models.get(namespace, name)
        children = models.children(namespace, name)
        dep, hpa = children["Deployment"], children["HorizontalPodAutoscaler"]
        server = dep.spec.template.spec.containers[0]
        args = " ".join((server.command or []) + (server.args or []))
        return (
            server.resources.limits.get("nvidia.com/gpu") == "4"
            and "websocket" in args
            and "sse" not in args.split("--protocols")[1].split("--")[0]
            and (hpa.spec.min_replicas, hpa.spec.max_replicas) == (2, 3)
            and model.get("status", {}).get("observedGeneration") == model["metadata"]["generation"]
            and (model, children)
        )

    model, children = eventually(converged, timeout=20, message="children to follow the edit")
    assert model["metadata"]["generation"] >= 2
    for kind in expected_kinds(model["spec"]):
        CHECKS[kind](children[kind], model)


def test_children_edited_or_deleted_by_hand_are_restored(operator, admin, models, namespace):
    body = load_sample("chat-small.yaml", namespace)
    name = body["metadata"]["name"]
    models.create(body)
    _, children = converge(models, namespace, name)
    old_uid = children["Service"].metadata.uid
    models.core.delete_namespaced_service(name, namespace)
    restored = eventually(
        lambda: (
            (s := models.children(namespace, name)["Service"]) and s.metadata.uid != old_uid and s
        ),
        timeout=15,
        message="the deleted Service to come back",
    )
    assert restored.spec.ports[0].port == 8000

    # A port edited by hand changes hands: server-side apply alone would keep it next to
    # ours, and the API server refuses two ports named "http". The operator replaces the list.
    edit = [{"op": "replace", "path": "/spec/ports/0/port", "value": 9999}]
    models.core.patch_namespaced_service(name, namespace, edit)  # a JSON patch
    eventually(
        lambda: (
            [p.port for p in models.core.read_namespaced_service(name, namespace).spec.ports]
            == [8000]
        ),
        timeout=15,
        message="the hand-edited Service port to be put back, alone",
    )
    assert (models.condition(namespace, name, "SpecValid") or {}).get("status") != "False"

    image = children["Deployment"].spec.template.spec.containers[0].image
    container = children["Deployment"].spec.template.spec.containers[0].name
    models.apps.patch_namespaced_deployment(
        name,
        namespace,
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [{"name": container, "image": "example.invalid/hijacked:1"}]
                    }
                }
            }
        },
    )
    eventually(
        lambda: (
            models.apps.read_namespaced_deployment(name, namespace)
            .spec.template.spec.containers[0]
            .image
            == image
        ),
        timeout=15,
        message="the hand-edited image to be put back",
    )


def test_resync_without_change_makes_no_calls(
    operator, models, namespace, control_plane, operator_user
):
    body = load_sample("chat-small.yaml", namespace)
    body["spec"].update(
        {
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
            "ingress": {"enabled": True, "host": "chat.example.com"},
        }
    )  # every child kind
    name = body["metadata"]["name"]
    models.create(body)
    converge(models, namespace, name)
    eventually(
        lambda: (models.get(namespace, name).get("status") or {}).get("phase") == "Ready",
        timeout=30,
        message="the model to be Ready",
    )
    # The HPA controller's first evaluation (within its 15 s sync period) changes the HPA's
    # status, which the operator mirrors: a real change. Wait for it, then for quiet.
    eventually(
        lambda: (
            models.autoscaling.read_namespaced_horizontal_pod_autoscaler(
                name, namespace
            ).status.conditions
        ),
        timeout=45,
        interval=1,
        message="the HPA controller's first evaluation",
    )
    settle(models, namespace, name)
    mark = control_plane.audit_mark()
    operator.restart()  # resume: a full reconcile of every existing StreamingModel
    time.sleep(8)
    calls = [
        e
        for e in control_plane.audit_events(operator_user, since=mark)
        if e.get("objectRef", {}).get("namespace") == namespace
    ]
    writes = [
        f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('subresource', '')}"
        for e in calls
        if is_write(e)
    ]
    reads = [e for e in calls if not is_write(e)]
    TIMINGS["resync after restart: writes / reads in the model's namespace"] = (
        f"{len(writes)} / {len(reads)}"
    )
    assert writes == [], writes
    # kopf fills the indexes from its initial listing before any handler runs, so the
    # resumed passes read nothing either.
    assert reads == [], [f"{e['verb']} {e['objectRef'].get('resource')}" for e in reads]


def test_delete_garbage_collects_every_child(operator, models, namespace):
    body = load_sample("llama-70b-tp4.yaml", namespace)
    name = body["metadata"]["name"]
    models.create(body)
    converge(models, namespace, name)
    models.delete(namespace, name)
    eventually(
        lambda: all(v is None for v in models.children(namespace, name).values()),
        timeout=30,
        message="the garbage collector to remove every child",
    )
    assert models.apps.list_namespaced_replica_set(namespace).items == []


def test_hpa_is_accepted_and_targets_the_server_metric(operator, models, namespace):
    body = load_sample("chat-small.yaml", namespace)
    body["spec"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetTTFTMilliseconds": 800,
        "ttftPercentile": 0.95,
    }
    name = body["metadata"]["name"]
    models.create(body)
    _, children = converge(models, namespace, name)
    hpa = children["HorizontalPodAutoscaler"]
    target = hpa.spec.metrics[0].pods
    assert (target.metric.name, target.target.average_value) == (TTFT_METRIC.format(nn=95), "800m")

    # The name is one the chart's prometheus-adapter rules serve, computed from a histogram
    # the server registers: the HPA can only ever get a value if all three agree.
    rules = yaml.safe_load(
        (ROOT / "charts/sluice-operator/files/prometheus-adapter-rules.yaml").read_text()
    )
    (rule,) = [r for r in rules["rules"] if r["name"]["as"] == target.metric.name]
    source = re.match(r"\^?(\w+?)_(count|bucket|sum)\$?", rule["name"]["matches"]).group(1)
    server_metrics = pytest.importorskip("sluice_server.core.telemetry.metrics")
    exported = {m.name for m in server_metrics.Metrics("probe").registry.collect()}
    assert source in exported, (source, sorted(exported))

    # The HPA controller has picked it up and asked the custom metrics API for that name (no
    # adapter runs here, so it reports that it cannot get it: the pods are Running).
    def controller_tried():
        got = models.autoscaling.read_namespaced_horizontal_pod_autoscaler(name, namespace)
        return [
            c
            for c in got.status.conditions or []
            if c.type == "ScalingActive" and c.status == "False"
        ]

    (active,) = eventually(
        controller_tried, timeout=45, interval=1, message="the HPA controller to evaluate the HPA"
    )
    assert target.metric.name in active.message, active


def test_removed_endpoint_leaves_status_and_status_then_settles(
    operator, models, namespace, control_plane, operator_user
):
    """Status is written as a diff with nulls for what vanished: dropping WebSocket removes
    its endpoint from status (a whole-status merge patch kept it forever and re-wrote the
    status on every pass), and a resync afterwards writes nothing."""
    body = load_sample("chat-small.yaml", namespace)
    body["spec"]["streaming"] = {"protocols": ["sse", "websocket"]}
    name = body["metadata"]["name"]
    models.create(body)
    eventually(
        lambda: (
            "websocket"
            in ((models.get(namespace, name).get("status") or {}).get("endpoints") or {})
        ),
        timeout=20,
        message="the WebSocket endpoint in status",
    )
    models.patch(namespace, name, {"spec": {"streaming": {"protocols": ["sse"]}}})
    status = eventually(
        lambda: (
            (s := models.get(namespace, name).get("status") or {})
            and s.get("observedGeneration") == 2
            and "websocket" not in (s.get("endpoints") or {})
            and s
        ),
        timeout=20,
        message="the WebSocket endpoint to leave status",
    )
    assert set(status["endpoints"]) == {"openai", "sse"}
    settle(models, namespace, name)
    mark = control_plane.audit_mark()
    operator.restart()
    time.sleep(8)
    writes = [
        e
        for e in control_plane.audit_events(operator_user, since=mark)
        if e.get("objectRef", {}).get("namespace") == namespace and is_write(e)
    ]
    assert writes == [], [f"{e['verb']} {e['objectRef']}" for e in writes]


def test_network_policy_is_accepted_and_removed_when_turned_off(operator, admin, models, namespace):
    body = load_sample("chat-small.yaml", namespace, new_name="netpol")
    body["spec"]["networkPolicy"] = {
        "enabled": True,
        "proxyNamespaces": ["ingress-nginx"],
        "monitoringNamespaces": ["monitoring"],
    }
    models.create(body)
    net = client.NetworkingV1Api(admin)

    def policy():
        try:
            return net.read_namespaced_network_policy("netpol", namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    np = eventually(policy, timeout=20, message="the model's NetworkPolicy")
    assert np.spec.policy_types == ["Ingress"]
    (rule,) = np.spec.ingress
    assert [p.port for p in rule.ports] == [8000]
    names = [p.namespace_selector.match_expressions[0].values for p in rule._from[1:]]
    assert names == [["ingress-nginx"], ["monitoring"]]
    assert np.metadata.owner_references[0].kind == "StreamingModel"
    models.patch(namespace, "netpol", {"spec": {"networkPolicy": {"enabled": False}}})
    eventually(lambda: policy() is None, timeout=20, message="the NetworkPolicy to be deleted")
