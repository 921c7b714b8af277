"""autoscaling.backend: keda: the ScaledObject builder, its query (the chart's adapter rule),
its schema, and the reconcile that swaps it with our HPA. KEDA itself cannot run here, so
the rendered object is checked against a schema written from KEDA's documented spec."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import typing

import jsonschema
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from operator_helpers import (
    KEDA_SCHEMA,
    AbsentKind,
    Events,
    FakeCluster,
    body_of,
    load,
    minimal,
    with_status,
)
from sluice_operator import handlers
from sluice_operator.builders.hpa import desired_hpa
from sluice_operator.builders.keda import (
    desired_scaled_object,
    keda_hpa_name,
    keda_query,
    pod_matchers,
)
from sluice_operator.builders.metrics import (
    ADAPTER_GROUP_BY,
    ADAPTER_LABEL_MATCHERS,
    ITL_HISTOGRAM,
    TTFT_HISTOGRAM,
    latency_metric_name,
    ttft_metric_name,
    ttft_metrics_query,
)
from sluice_operator.kinds import ALL_KINDS, CHILD_KINDS, KEDA_KIND, desired_children
from sluice_operator.models.resource import StreamingModel
from sluice_operator.models.scaling import AutoscalingSpec
from sluice_operator.reconcile import converge
from sluice_operator.render import render_objects
from sluice_operator.validation import load_model
from testkit.repo import ROOT

NOW = "2026-11-30T06:00:00Z"
SCHEMA = json.loads(KEDA_SCHEMA.read_text())
ADAPTER_RULES = ROOT / "charts/sluice-operator/files/prometheus-adapter-rules.yaml"
PERCENTILES = typing.get_args(AutoscalingSpec.model_fields["ttft_percentile"].annotation)


def validate(manifest: dict) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)


def keda_model(name="m", namespace="default", **autoscaling) -> StreamingModel:
    body = minimal(autoscaling={"backend": "keda", **autoscaling})
    body["metadata"] = {"name": name, "namespace": namespace}
    return load_model(body)


# ---- the query: one template, the chart's adapter rule ----------------------------------


def test_adapter_rule_file_is_the_operator_query_template():
    """Both backends scale on one number: each adapter rule's metricsQuery is the operator's
    template with the adapter's placeholders, one rule per percentile the API offers, for
    TTFT and for inter-token latency (a disaggregated model's decode pool)."""
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    by_name = {r["name"]["as"]: r["metricsQuery"] for r in rules}
    histograms = (TTFT_HISTOGRAM, ITL_HISTOGRAM)
    assert sorted(by_name) == sorted(
        latency_metric_name(h, p) for h in histograms for p in PERCENTILES
    )
    for h in histograms:
        for p in PERCENTILES:
            assert by_name[latency_metric_name(h, p)] == ttft_metrics_query(
                p, ADAPTER_GROUP_BY, ADAPTER_LABEL_MATCHERS, h
            )
    assert latency_metric_name(TTFT_HISTOGRAM, 0.9) == ttft_metric_name(0.9)


def test_query_comparison_has_teeth():
    # Negative control: a different window or a missing idle branch is a different query.
    rule = ttft_metrics_query(0.9, ADAPTER_GROUP_BY, ADAPTER_LABEL_MATCHERS)
    assert rule.replace("[1m]", "[2m]") != rule
    assert " or (0 * max by" in rule and rule.count(" or ") == 2


@pytest.mark.parametrize("percentile", PERCENTILES)
def test_keda_query_is_the_sum_of_the_per_pod_rule_for_this_models_pods(percentile):
    m = keda_model(name="chat", namespace="team-a", ttftPercentile=percentile)
    q = keda_query(m)
    matchers = 'namespace="team-a",pod=~"chat-[a-z0-9]+-[a-z0-9]+"'
    assert pod_matchers(m) == matchers
    assert q == f"sum({ttft_metrics_query(percentile, 'pod', matchers)})"
    assert f"histogram_quantile({percentile:g}," in q
    assert q.count("{" + matchers + "}") == 3  # bucket, count and up: same pods everywhere
    assert q.count("(") == q.count(")")


@pytest.mark.parametrize(
    "pod,ours",
    [
        ("chat-5d8f7c9b6-x2k4p", True),
        ("chat-7b9c4-abcde", True),
        ("chat-v2-5d8f7c9b6-x2k4p", False),  # a model named chat-v2
        ("chat", False),
        ("other-5d8f7c9b6-x2k4p", False),
        ("xchat-5d8f7c9b6-x2k4p", False),
    ],
)
def test_pod_matcher_selects_only_this_models_deployment_pods(pod, ours):
    # Prometheus regex matchers are fully anchored (RE2; this pattern means the same in re).
    pattern = re.search(r'pod=~"([^"]+)"', pod_matchers(keda_model(name="chat"))).group(1)
    assert bool(re.fullmatch(pattern, pod)) is ours


# ---- the builder ---------------------------------------------------------------------------

CASES = [
    dict(minReplicas=1, maxReplicas=4, targetTTFTMilliseconds=500),
    dict(minReplicas=2, maxReplicas=10, targetTTFTMilliseconds=250, ttftPercentile=0.5),
    dict(minReplicas=1, maxReplicas=1, targetTTFTMilliseconds=1, ttftPercentile=0.99),
    dict(
        maxReplicas=8,
        targetTTFTMilliseconds=1500,
        ttftPercentile=0.75,
        scaleUpStabilizationSeconds=30,
        scaleDownStabilizationSeconds=900,
        keda={"serverAddress": "https://thanos.obs:10902", "pollingIntervalSeconds": 5},
    ),
]


@pytest.mark.parametrize(
    "settings", CASES, ids=lambda c: f"max{c['maxReplicas']}-{c['targetTTFTMilliseconds']}ms"
)
def test_scaled_object(settings):
    m = keda_model(**settings)
    a = m.spec.autoscaling
    so = desired_scaled_object(m)
    validate(so)
    spec = so["spec"]
    assert so["metadata"]["name"] == "m" and so["metadata"]["namespace"] == "default"
    assert so["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice-operator"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "m"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (a.min_replicas, a.max_replicas)
    assert spec["pollingInterval"] == a.keda.polling_interval_seconds
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    md = trigger["metadata"]
    assert float(md["threshold"]) == pytest.approx(a.target_ttft_milliseconds / 1000)
    assert md["serverAddress"] == a.keda.server_address
    assert md["query"] == keda_query(m)
    assert all(isinstance(v, str) for v in md.values())  # KEDA trigger metadata is strings
    # The same behavior (stabilization windows, policies) our own HPA would get.
    hpa = desired_hpa(load_model(minimal(autoscaling={**settings, "backend": "hpa"})))
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    assert "name" not in spec["advanced"]["horizontalPodAutoscalerConfig"]  # keda-hpa-<name>
    assert keda_hpa_name(m) == "keda-hpa-m"


def test_default_server_address_and_polling():
    a = keda_model().spec.autoscaling
    assert a.keda.server_address == "http://prometheus-operated.monitoring.svc:9090"
    assert a.keda.polling_interval_seconds == 30


@pytest.mark.parametrize(
    "autoscaling,hpa,keda",
    [
        (None, False, False),
        ({"maxReplicas": 3}, True, False),  # backend defaults to hpa
        ({"maxReplicas": 3, "backend": "hpa"}, True, False),
        ({"maxReplicas": 3, "backend": "keda"}, False, True),
        ({"maxReplicas": 3, "backend": "keda", "enabled": False}, False, False),
    ],
)
def test_exactly_one_autoscaler_per_backend(autoscaling, hpa, keda):
    children = desired_children(load_model(minimal(autoscaling=autoscaling)))
    assert (children["HorizontalPodAutoscaler"] is not None) is hpa
    assert (children["ScaledObject"] is not None) is keda
    # The Deployment leaves replicas to whichever autoscaler there is.
    assert ("replicas" in children["Deployment"]["spec"]) is not (hpa or keda)


@pytest.mark.parametrize(
    "bad",
    [
        {"backend": "kedaa"},
        {"backend": "keda", "keda": {"serverAddress": "prometheus:9090"}},
        {"backend": "keda", "keda": {"pollingIntervalSeconds": 0}},
        {"backend": "keda", "keda": {"cooldownPeriod": 30}},
    ],
)
def test_bad_keda_settings_are_rejected(bad):
    from sluice_operator.validation import SpecError

    with pytest.raises(SpecError):
        load_model(minimal(autoscaling=bad))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda so: so["spec"].update(minReplicas=1),  # HPA's name, not KEDA's
        lambda so: so["spec"]["triggers"][0].update(metricType="averageValue"),
        lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=0.5),
        lambda so: so["spec"]["triggers"][0]["metadata"].pop("query"),
        lambda so: so["spec"]["triggers"][0]["metadata"].update(serverAdress="http://x"),
        lambda so: so["spec"]["advanced"]["horizontalPodAutoscalerConfig"].update(behaviour={}),
        lambda so: so["spec"].update(triggers=[]),
        lambda so: so.update(apiVersion="keda.sh/v1"),
    ],
)
def test_schema_negative_controls(mutate):
    so = desired_scaled_object(keda_model())
    validate(so)
    mutate(so)
    with pytest.raises(jsonschema.ValidationError):
        validate(so)


def test_keda_kind_is_separate_from_the_watched_children():
    # KEDA's CRD may be absent and the chart grants it only with keda.enabled: the operator
    # must neither watch it nor list it with the always-managed children.
    assert KEDA_KIND not in CHILD_KINDS and KEDA_KIND in ALL_KINDS
    assert all(plural != "scaledobjects" for _, _, plural in handlers.CHILD_RESOURCES)


# ---- sample and render ---------------------------------------------------------------------


def test_keda_sample_renders_a_valid_scaled_object_and_no_hpa():
    manifests = render_objects(load(ROOT / "samples/keda.yaml"))
    kinds = [m["kind"] for m in manifests]
    assert kinds == ["Service", "Deployment", "PodDisruptionBudget", "ScaledObject"]
    so = manifests[-1]
    validate(so)
    assert so["spec"]["triggers"][0]["metadata"]["threshold"] == "0.4"
    assert "histogram_quantile(0.95," in so["spec"]["triggers"][0]["metadata"]["query"]


def test_render_cli_shows_the_scaled_object():
    result = subprocess.run(
        [sys.executable, "-m", "sluice_operator", "render", "-f", "samples/keda.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert [d["kind"] for d in docs][-1] == "ScaledObject"
    validate(docs[-1])


# ---- reconcile -----------------------------------------------------------------------------


def test_keda_model_gets_a_scaled_object_and_no_hpa_then_noop_resync_writes_nothing():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"backend": "keda", "maxReplicas": 3}))
    events = Events()
    out = converge(cluster, body, events, now=NOW)
    assert out.applied == ["Service", "Deployment", "PodDisruptionBudget", "ScaledObject"]
    assert ("HorizontalPodAutoscaler", "default", "m") not in cluster.objects
    so = cluster.objects[("ScaledObject", "default", "m")]
    assert so["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert cluster.statuses[-1]["autoscaling"]["backend"] == "keda"
    # KEDA's HPA (not ours) is read for the status.
    assert ("get", "HorizontalPodAutoscaler") in cluster.calls
    body = with_status(body, cluster)
    cluster.calls.clear()
    for _ in range(3):
        out = converge(cluster, body, events, now="2026-11-30T07:00:00Z")
        assert not out.applied and not out.deleted and not out.status_written
    assert cluster.writes() == []
    assert {verb for verb, _ in cluster.calls} <= {"get", "list"}


def test_kedas_hpa_status_is_mirrored():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"backend": "keda", "maxReplicas": 3}))
    cluster.objects[("HorizontalPodAutoscaler", "default", "keda-hpa-m")] = {
        "metadata": {"name": "keda-hpa-m"},  # KEDA's, not owned by us: never deleted
        "status": {
            "currentReplicas": 1,
            "desiredReplicas": 2,
            "currentMetrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {"name": "s0-prometheus"},
                        "current": {"averageValue": "812m"},
                    },
                }
            ],
        },
    }
    converge(cluster, body, Events(), now=NOW)
    scaling = cluster.statuses[-1]["autoscaling"]
    assert (scaling["desiredReplicas"], scaling["currentTTFTMilliseconds"]) == (2, 812)
    assert ("HorizontalPodAutoscaler", "default", "keda-hpa-m") in cluster.objects


def test_hpa_models_never_touch_scaled_objects():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"maxReplicas": 3}))
    converge(cluster, body, Events(), now=NOW)
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    assert not [c for c in cluster.calls if c[1] == "ScaledObject"]


def _switch(cluster, body, autoscaling):
    body = with_status(body, cluster)
    body["metadata"]["generation"] += 1
    body["spec"]["autoscaling"] = autoscaling
    cluster.calls.clear()
    events = Events()
    out = converge(cluster, body, events, now=NOW)
    return body, out, [c for c in cluster.writes() if c[0] != "patch_status"]


def test_switching_backends_never_leaves_two_autoscalers():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"maxReplicas": 3}))
    converge(cluster, body, Events(), now=NOW)
    assert ("HorizontalPodAutoscaler", "default", "m") in cluster.objects

    # hpa -> keda: our HPA is deleted before the ScaledObject (KEDA's HPA) appears.
    body, out, writes = _switch(cluster, body, {"maxReplicas": 3, "backend": "keda"})
    assert writes == [("delete", "HorizontalPodAutoscaler"), ("apply", "ScaledObject")]
    assert out.deleted == ["HorizontalPodAutoscaler"] and out.applied == ["ScaledObject"]
    assert ("HorizontalPodAutoscaler", "default", "m") not in cluster.objects

    # keda -> hpa: the ScaledObject is deleted before our HPA is applied.
    body, out, writes = _switch(cluster, body, {"maxReplicas": 3, "backend": "hpa"})
    assert writes == [("delete", "ScaledObject"), ("apply", "HorizontalPodAutoscaler")]
    assert ("ScaledObject", "default", "m") not in cluster.objects
    assert cluster.statuses[-1]["autoscaling"]["backend"] == "hpa"

    # hpa -> keda -> off: the ScaledObject goes, replicas come back to the Deployment.
    body, out, writes = _switch(cluster, body, {"maxReplicas": 3, "backend": "keda"})
    body, out, writes = _switch(cluster, body, None)
    assert ("delete", "ScaledObject") in writes and (
        "ScaledObject",
        "default",
        "m",
    ) not in cluster.objects
    assert "autoscaling" not in cluster.statuses[-1]
    # ...and once the status forgot KEDA, later passes do not look for ScaledObjects again.
    cluster.calls.clear()
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert not [c for c in cluster.calls if c[1] == "ScaledObject"]


def test_scaled_object_not_owned_is_left_alone():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"maxReplicas": 3, "backend": "keda"}))
    converge(cluster, body, Events(), now=NOW)
    cluster.objects[("ScaledObject", "default", "m")]["metadata"]["ownerReferences"] = []
    _, out, writes = _switch(cluster, body, {"maxReplicas": 3})
    assert ("delete", "ScaledObject") not in writes


def test_scaled_object_hand_edit_is_put_back():
    cluster = FakeCluster()
    body = body_of(minimal(autoscaling={"maxReplicas": 3, "backend": "keda"}))
    converge(cluster, body, Events(), now=NOW)
    cluster.objects[("ScaledObject", "default", "m")]["spec"]["maxReplicaCount"] = 50
    cluster.calls.clear()
    out = converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert out.applied == ["ScaledObject"]
    assert cluster.objects[("ScaledObject", "default", "m")]["spec"]["maxReplicaCount"] == 3


@pytest.mark.parametrize(
    "status,says", [(404, "KEDA is not installed"), (403, "keda.enabled=true")]
)
def test_missing_keda_is_reported_the_rest_converges_and_the_pass_is_retried(status, says):
    cluster = AbsentKind("ScaledObject", status)
    body = body_of(minimal(autoscaling={"backend": "keda", "maxReplicas": 3}))
    events = Events()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert {k[0] for k in cluster.objects} == {"Service", "Deployment", "PodDisruptionBudget"}
    scaling = cluster.statuses[-1]["autoscaling"]
    assert scaling["backend"] == "keda" and says in scaling["message"]
    assert [e[:2] for e in events] == [("Normal", "Reconciled"), ("Warning", "KedaUnavailable")]
    # The retry (same failure) neither rewrites the status nor repeats the Warning.
    body = with_status(body, cluster)
    events.clear()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert events == [] and len(cluster.status_patches) == 1
    # The handler turns it into a retry with backoff, not a permanent failure.
    cluster.store(body)
    import kopf

    with pytest.raises(kopf.TemporaryError):
        cluster.runtime.passes.converge("default", "m", 0, __import__("logging").getLogger("t"))
    # KEDA installed (and granted) later: the next pass converges and clears the message.
    cluster.refuse = 0
    converge(cluster, body, Events(), now=NOW)
    assert ("ScaledObject", "default", "m") in cluster.objects
    assert "message" not in cluster.statuses[-1]["autoscaling"]


def test_other_api_errors_on_the_scaled_object_still_propagate():
    cluster = AbsentKind("ScaledObject", 500)
    body = body_of(minimal(autoscaling={"backend": "keda", "maxReplicas": 3}))
    with pytest.raises(ApiException):
        converge(cluster, body, Events(), now=NOW)
    assert cluster.status_patches == []


# ---- chart RBAC ----------------------------------------------------------------------------


def _helm() -> str | None:
    local = ROOT / ".tools/bin/helm"
    return str(local) if local.is_file() else shutil.which("helm")


@pytest.mark.skipif(not _helm(), reason="helm not found (.tools/bin/helm or PATH): make tools")
def test_chart_with_keda_enabled_grants_what_the_operator_calls_on_scaled_objects():
    """get (read before apply), patch (server-side apply; an apply that creates is authorized
    as create too) and delete (switch back, autoscaling off); no list/watch: the operator
    does not watch ScaledObjects (KEDA's CRD may be absent)."""
    out = subprocess.run(
        [
            _helm(),
            "template",
            "t",
            str(ROOT / "charts/sluice-operator"),
            "--set",
            "keda.enabled=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rules = [
        r
        for d in yaml.safe_load_all(out)
        if d
        and d["kind"] in ("ClusterRole", "Role")
        and not d["metadata"]["name"].endswith(("-edit", "-view"))
        for r in d["rules"]
    ]
    verbs = {
        v
        for r in rules
        if "keda.sh" in r["apiGroups"] and "scaledobjects" in r["resources"]
        for v in r["verbs"]
    }
    assert verbs == {"get", "create", "patch", "delete"}  # exactly what converge calls
    api_version, kind, optional = KEDA_KIND.api_version, KEDA_KIND.kind, KEDA_KIND.optional
    assert api_version.startswith("keda.sh/") and kind == "ScaledObject" and optional


def test_scaled_object_url_is_kedas_namespaced_collection():
    from sluice_operator.cluster import collection_path

    api_version, kind = KEDA_KIND.api_version, KEDA_KIND.kind
    assert (
        collection_path(api_version, kind, "team-a")
        == "/apis/keda.sh/v1alpha1/namespaces/team-a/scaledobjects"
    )
