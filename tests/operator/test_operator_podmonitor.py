"""observability: the optional Prometheus Operator PodMonitor (builder, schema, reconcile when
the CRD is absent or not granted, chart RBAC) and tracing flags on the server's command line.
The Prometheus Operator cannot run here, so the rendered object is checked against a schema
written from its API reference (tests/operator/schemas/podmonitor.schema.json)."""

from __future__ import annotations

import copy
import json
import logging

import jsonschema
import kopf
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import (
    POD_MONITOR_SCHEMA,
    AbsentKind,
    Events,
    FakeCluster,
    body_of,
    minimal,
    with_status,
)
from sluice_operator import handlers
from sluice_operator.builders.args import server_args
from sluice_operator.builders.common import PORT_NAME, selector_labels
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.podmonitor import desired_pod_monitor
from sluice_operator.kinds import POD_MONITOR_KIND, WATCHED_KINDS
from sluice_operator.reconcile import converge
from sluice_operator.validation import SpecError, load_model

NOW = "2026-11-30T06:00:00Z"
SCHEMA = json.loads(POD_MONITOR_SCHEMA.read_text())


def model(observability=None, name="chat", namespace="team-a"):
    body = minimal(**({"observability": observability} if observability else {}))
    body["metadata"] = {"name": name, "namespace": namespace}
    return load_model(body)


def validate(manifest: dict) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)


# ---- the builder ---------------------------------------------------------------------------


def test_off_by_default():
    assert desired_pod_monitor(model()) is None
    assert desired_pod_monitor(model({"podMonitor": {"enabled": False}})) is None


@pytest.mark.parametrize(
    "pm",
    [{"enabled": True}, {"enabled": True, "interval": "5s", "labels": {"release": "kps"}}],
)
def test_pod_monitor_selects_the_deployments_pods_on_the_metrics_port(pm):
    m = model({"podMonitor": pm})
    obj = desired_pod_monitor(m)
    validate(obj)
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert obj["metadata"]["namespace"] == "team-a" and obj["metadata"]["name"] == "chat"
    assert obj["spec"]["selector"] == {"matchLabels": selector_labels(m)}
    assert obj["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    [ep] = obj["spec"]["podMetricsEndpoints"]
    assert ep == {"port": PORT_NAME, "path": "/metrics", "interval": pm.get("interval", "15s")}
    # The port name and the selector are the Deployment's own.
    pod = desired_deployment(m)["spec"]["template"]
    assert selector_labels(m).items() <= pod["metadata"]["labels"].items()
    ports = pod["spec"]["containers"][0]["ports"]
    assert any(p["name"] == PORT_NAME for p in ports)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == ep["path"]
    for k, v in pm.get("labels", {}).items():
        assert obj["metadata"]["labels"][k] == v


def test_extra_labels_never_replace_the_operators_own():
    obj = desired_pod_monitor(
        model({"podMonitor": {"enabled": True, "labels": {"app.kubernetes.io/managed-by": "me"}}})
    )
    assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice-operator"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"].update(podMetricEndpoints=[]),  # typo of podMetricsEndpoints
        lambda o: o["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
        lambda o: o["spec"].pop("selector"),
        lambda o: o.update(apiVersion="monitoring.coreos.com/v1alpha1"),
    ],
)
def test_schema_negative_controls(mutate):
    obj = copy.deepcopy(desired_pod_monitor(model({"podMonitor": {"enabled": True}})))
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


@pytest.mark.parametrize(
    "bad", [{"podMonitor": {"interval": "soon"}}, {"tracing": {"endpoint": "collector:4318"}},
            {"tracing": {"sampleRatio": 1.5}}, {"podMonitor": {"enable": True}}],
)  # fmt: skip
def test_bad_observability_settings_are_rejected(bad):
    with pytest.raises(SpecError):
        model(bad)


def test_pod_monitor_is_not_watched():
    from sluice_operator.kinds import CHILD_KINDS

    assert POD_MONITOR_KIND not in WATCHED_KINDS and POD_MONITOR_KIND.optional
    assert POD_MONITOR_KIND not in CHILD_KINDS
    assert all(plural != "podmonitors" for _, _, plural in handlers.CHILD_RESOURCES)


# ---- tracing on the server's command line ---------------------------------------------------


def test_tracing_flags():
    assert "--otlp-traces-endpoint" not in server_args(model())
    url = "http://otel-collector.monitoring:4318/v1/traces"
    args = server_args(model({"tracing": {"endpoint": url, "sampleRatio": 0.1}}))
    assert args[args.index("--otlp-traces-endpoint") + 1] == url
    assert args[args.index("--trace-sample-ratio") + 1] == "0.1"


# ---- reconcile -----------------------------------------------------------------------------


def test_models_without_a_pod_monitor_never_touch_pod_monitors():
    cluster = FakeCluster()
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert not [c for c in cluster.calls if c[1] == "PodMonitor"]


def test_pod_monitor_applied_condition_then_removed_when_turned_off():
    cluster = FakeCluster()
    body = body_of(minimal(observability={"podMonitor": {"enabled": True}}))
    out = converge(cluster, body, Events(), now=NOW)
    assert "PodMonitor" in out.applied
    pm = cluster.objects[("PodMonitor", "default", "m")]
    assert pm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    cond = {c["type"]: c for c in cluster.status_patches[-1]["conditions"]}["PodMonitorReady"]
    assert (cond["status"], cond["reason"]) == ("True", "Applied")
    # turned off: deleted, and the condition goes away
    body = with_status(body, cluster)
    body["metadata"]["generation"] += 1
    body["spec"]["observability"] = {"podMonitor": {"enabled": False}}
    out = converge(cluster, body, Events(), now=NOW)
    assert out.deleted == ["PodMonitor"]
    assert ("PodMonitor", "default", "m") not in cluster.objects
    types = {c["type"] for c in cluster.status_patches[-1]["conditions"]}
    assert "PodMonitorReady" not in types
    # and then it is not touched any more
    body = with_status(body, cluster)
    cluster.calls.clear()
    converge(cluster, body, Events(), now=NOW)
    assert not [c for c in cluster.calls if c[1] == "PodMonitor"]


@pytest.mark.parametrize(
    "status,reason,says",
    [(404, "CRDMissing", "Prometheus Operator is not installed"),
     (403, "Forbidden", "podMonitors.enabled=true")],
)  # fmt: skip
def test_missing_crd_is_a_condition_the_rest_converges_and_the_pass_is_retried(
    status, reason, says
):
    cluster = AbsentKind("PodMonitor", status)
    body = body_of(minimal(observability={"podMonitor": {"enabled": True}}))
    events = Events()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert {k[0] for k in cluster.objects} == {"Service", "Deployment"}
    cond = {c["type"]: c for c in cluster.status_patches[-1]["conditions"]}["PodMonitorReady"]
    assert (cond["status"], cond["reason"]) == ("False", reason) and says in cond["message"]
    assert [e[:2] for e in events] == [
        ("Normal", "Reconciled"),
        ("Warning", "PodMonitorUnavailable"),
    ]
    # The retry (same failure): no new status write, no repeated Warning.
    body = with_status(body, cluster)
    events.clear()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW)
    assert events == [] and len(cluster.status_patches) == 1
    # The handler retries with backoff: no permanent failure, no crash loop.
    cluster.store(body)
    with pytest.raises(kopf.TemporaryError):
        cluster.runtime.passes.converge("default", "m", 0, logging.getLogger("t"))
    # The CRD installed later: the next pass applies it and the condition turns True.
    cluster.refuse = 0
    converge(cluster, body, Events(), now=NOW)
    assert ("PodMonitor", "default", "m") in cluster.objects
    cond = {c["type"]: c for c in cluster.status_patches[-1]["conditions"]}["PodMonitorReady"]
    assert cond["status"] == "True"


def test_other_api_errors_on_the_pod_monitor_still_propagate():
    cluster = AbsentKind("PodMonitor", 500)
    body = body_of(minimal(observability={"podMonitor": {"enabled": True}}))
    with pytest.raises(ApiException):
        converge(cluster, body, Events(), now=NOW)
    assert cluster.status_patches == []


# ---- chart RBAC ----------------------------------------------------------------------------


def _podmonitor_verbs(*set_: str) -> set[str]:
    import shutil
    import subprocess

    import yaml
    from operator_helpers import ROOT

    local = ROOT / ".tools/bin/helm"
    helm = str(local) if local.is_file() else shutil.which("helm")
    if helm is None:
        pytest.skip("helm not found (.tools/bin/helm or PATH): make tools")
    args = [helm, "template", "t", str(ROOT / "charts/sluice-operator")]
    for s in set_:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    return {
        v
        for d in yaml.safe_load_all(out)
        if d and d["kind"] in ("ClusterRole", "Role")
        and not d["metadata"]["name"].endswith(("-edit", "-view"))
        for r in d["rules"]
        if "monitoring.coreos.com" in r["apiGroups"] and "podmonitors" in r["resources"]
        for v in r["verbs"]
    }  # fmt: skip


def test_chart_grants_exactly_what_the_operator_calls_on_pod_monitors_only_when_enabled():
    """get (read before apply), patch (server-side apply, also authorized as create) and
    delete (turned off); no list/watch: not watched, the CRD may be absent."""
    assert _podmonitor_verbs("podMonitors.enabled=true") == {"get", "create", "patch", "delete"}
    assert _podmonitor_verbs() == set()
