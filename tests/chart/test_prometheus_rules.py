"""The chart's recording and alerting rules (charts/sluice-operator/files/prometheus-rules.yaml):
`promtool check rules`, and `promtool test rules` on synthetic series for each alert (TTFT p90
above target for 5 minutes, client disconnects over 5%, stream errors, pods not Ready), each
with a case that must stay silent. The optional PrometheusRule template ships the file
unchanged.

The adapter's per-pod query (idle pods at 0) is evaluated the same way in
test_prometheus_adapter_rules.py; here the model-level p90 is checked to weigh streams, not pods.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest
import yaml
from testkit.promtool import promtool, run_tests

from .chartlib import OPERATOR_CHART, Helm, by_kind

RULES_FILE = OPERATOR_CHART / "files" / "prometheus-rules.yaml"
TEMPLATE = OPERATOR_CHART / "templates" / "prometheusrule.yaml"
ALERTS = {
    "SluiceTTFTAboveTarget",
    "SluiceClientDisconnectRateHigh",
    "SluiceStreamErrorRateHigh",
    "SluicePodsNotReady",
    "SluiceActivationTimedOut",
}
LE = ("0.1", "0.3", "0.5", "0.75", "1", "+Inf")
STEPS = 100  # 15 s steps: 25 minutes of series
WHAT = "rules not checked"


def _groups() -> list[dict]:
    return yaml.safe_load(RULES_FILE.read_text())["groups"]


# ---- synthetic series -----------------------------------------------------------------------


def ttft(ns: str, pod: str, per_step: float, bucket: str, protocol: str = "sse") -> list:
    """A pod that serves `per_step` streams every 15 s, all with TTFT in the bucket ending at
    `bucket` (cumulative buckets: 0 below it, per_step at and above it)."""
    out = []
    for le in LE:
        inc = per_step if LE.index(le) >= LE.index(bucket) else 0
        out.append(
            (
                f'sluice_ttft_seconds_bucket{{namespace="{ns}",pod="{pod}",protocol="{protocol}",model="m",le="{le}"}}',
                f"0+{inc}x{STEPS}",
            )
        )
    out.append(
        (
            f'sluice_requests_total{{namespace="{ns}",pod="{pod}",protocol="{protocol}",model="m"}}',
            f"0+{per_step}x{STEPS}",
        )
    )
    return out


def counter(name: str, ns: str, pod: str, per_step: float) -> tuple[str, str]:
    return (
        f'{name}{{namespace="{ns}",pod="{pod}",protocol="sse",model="m"}}',
        f"0+{per_step}x{STEPS}",
    )


def hpa_target(ns: str, name: str, seconds: float, metric: str = "sluice_ttft_p90_seconds"):
    return (
        f'kube_horizontalpodautoscaler_spec_target_metric{{namespace="{ns}",horizontalpodautoscaler="{name}",'
        f'metric_name="{metric}",metric_target_type="average",job="kube-state-metrics"}}',
        f"{seconds}+0x{STEPS}",
    )


def pod_ready(ns: str, pod: str, values: str, instance: str | None, managed: bool = True):
    labels = f'namespace="{ns}",pod="{pod}",job="kube-state-metrics"'
    extra = ""
    if instance:
        extra += f',label_app_kubernetes_io_instance="{instance}"'
    if managed:
        extra += ',label_app_kubernetes_io_managed_by="sluice-operator"'
    return [
        (f'kube_pod_status_ready{{{labels},condition="true"}}', values),
        (f"kube_pod_labels{{{labels}{extra}}}", f"1+0x{STEPS}"),
    ]


SERIES = [
    # "chat": two pods, target 0.3 s from its HPA; one pod's streams in (0.1, 0.3], the
    # other's in (0.3, 0.5]. Model p90 over the 20 streams per step: 0.3 + 8/10 * 0.2 = 0.46
    # (a mean of per-pod p90s would say 0.38). Above target: fires after 5 minutes.
    *ttft("llm", "chat-7c9d5b6f4-x2x9k", 10, "0.3"),
    *ttft("llm", "chat-7c9d5b6f4-q4w7z", 10, "0.5", protocol="websocket"),
    hpa_target("llm", "chat", 0.3),
    # "fast": p90 in (0.1, 0.3] = 0.28 against a 0.5 s target: silent.
    *ttft("llm", "fast-5f6d7c8b9-abcde", 10, "0.3"),
    hpa_target("llm", "fast", 0.5),
    # "relaxed": p90 0.725 (in (0.5, 0.75]) but its target is 1 s: above the 0.5 s fallback,
    # below its own target: silent (the fallback applies only without an HPA target).
    *ttft("llm", "relaxed-6b7c8d9f5-fghij", 10, "0.75"),
    hpa_target("llm", "relaxed", 1.0, metric="sluice_ttft_p99_seconds"),
    # "solo": no HPA series (kube-state-metrics absent), p90 0.725 > 0.5 fallback: fires.
    *ttft("llm", "solo-6b7c8d9f5-klmno", 10, "0.75"),
    # "quiet": slow but one stream every 5 minutes (under 3 a minute): silent.
    *ttft("llm", "quiet-6b7c8d9f5-pqrst", 0.05, "1"),
    hpa_target("llm", "quiet", 0.3),
    # Another namespace's "chat" with fast streams must not mix into llm/chat.
    *ttft("other", "chat-7c9d5b6f4-x2x9k", 100, "0.1"),
    hpa_target("other", "chat", 0.3),
    # Disconnects and stream errors: "chat" loses 1 client in 10 streams (10 %) and has 1 error
    # in 20 (5 %); "fast" 2 % disconnects and 0.5 % errors.
    counter("sluice_client_disconnects_total", "llm", "chat-7c9d5b6f4-x2x9k", 1),
    counter("sluice_client_disconnects_total", "llm", "chat-7c9d5b6f4-q4w7z", 1),
    counter("sluice_stream_errors_total", "llm", "chat-7c9d5b6f4-q4w7z", 1),
    counter("sluice_client_disconnects_total", "llm", "fast-5f6d7c8b9-abcde", 0.2),
    counter("sluice_stream_errors_total", "llm", "fast-5f6d7c8b9-abcde", 0.05),
    # Readiness (kube-state-metrics): chat has one Ready pod and one Pending for GPUs all
    # along; fast's second pod becomes Ready after 10 minutes (start-up, no alert); a pod of
    # something else that is not Ready is not ours.
    *pod_ready("llm", "chat-7c9d5b6f4-x2x9k", f"1+0x{STEPS}", "chat"),
    *pod_ready("llm", "chat-7c9d5b6f4-zzzzz", f"0+0x{STEPS}", "chat"),
    *pod_ready("llm", "fast-5f6d7c8b9-abcde", f"1+0x{STEPS}", "fast"),
    *pod_ready("llm", "fast-5f6d7c8b9-vwxyz", f"0+0x40 1+0x{STEPS - 40}", "fast"),
    *pod_ready("llm", "web-1", f"0+0x{STEPS}", "web", managed=False),
    # The activator (scale to zero), scraped in its own namespace: its `namespace` label was
    # renamed exported_namespace. llm/chat's held requests time out once, at 12 minutes;
    # llm/fast's are all forwarded; team/solo is scraped with honor_labels (its own
    # `namespace` label kept) and times out from the start.
    (
        'sluice_activator_requests_total{namespace="sluice-system",pod="sluice-activator-1",'
        'exported_namespace="llm",model="chat",outcome="timeout"}',
        f"0+0x48 1+0x{STEPS - 48}",
    ),
    (
        'sluice_activator_requests_total{namespace="sluice-system",pod="sluice-activator-1",'
        'exported_namespace="llm",model="fast",outcome="forwarded"}',
        f"0+1x{STEPS}",
    ),
    (
        'sluice_activator_requests_total{namespace="team",pod="sluice-activator-2",'
        'model="solo",outcome="timeout"}',
        f"0+1x{STEPS}",
    ),
]


def _without_annotations(groups: list[dict]) -> list[dict]:
    """promtool compares annotations too: the timing/label cases use a copy without them and
    one case below checks the rendered text."""
    groups = copy.deepcopy(groups)
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)
    return groups


def _run(tmp_path, groups, *, alert_cases=(), expr_cases=()) -> subprocess.CompletedProcess:
    return run_tests(tmp_path, SERIES, what=WHAT, rule_groups=groups, alert_cases=alert_cases,
                     expr_cases=expr_cases)  # fmt: skip


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def _alert(name: str, at: str, *alerts: dict) -> dict:
    return {
        "alertname": name,
        "eval_time": at,
        "exp_alerts": [{"exp_labels": a} for a in alerts],
    }


# ---- tests ----------------------------------------------------------------------------------


def test_promtool_check_rules():
    proc = subprocess.run(
        [promtool(WHAT), "check", "rules", str(RULES_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 13 rules found" in proc.stdout


def test_rule_set_shape():
    groups = {g["name"]: g for g in _groups()}
    assert set(groups) == {"sluice.recording", "sluice.alerts"}
    alerts = {r["alert"]: r for r in groups["sluice.alerts"]["rules"]}
    assert set(alerts) == ALERTS
    assert alerts["SluiceTTFTAboveTarget"]["for"] == "5m"
    for r in alerts.values():
        assert r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    # The target series name is the one the operator's HPA builder uses.
    hpa = pytest.importorskip("sluice_operator.builders.hpa")
    assert hpa.ttft_metric_name(0.9) == "sluice_ttft_p90_seconds"


def test_model_quantiles_weigh_streams_not_pods(tmp_path):
    expected = {
        "p90": {("llm", "chat"): 0.46, ("llm", "fast"): 0.28, ("llm", "relaxed"): 0.725,
                ("llm", "solo"): 0.725, ("llm", "quiet"): 0.975, ("other", "chat"): 0.09},
        "p50": {("llm", "chat"): 0.3, ("llm", "fast"): 0.2, ("llm", "relaxed"): 0.625,
                ("llm", "solo"): 0.625, ("llm", "quiet"): 0.875, ("other", "chat"): 0.05},
    }  # fmt: skip
    cases = [
        {
            # round(): compare at 0.1 ms; it also drops the metric name
            "expr": f"round(namespace_streamingmodel:sluice_ttft_seconds:{q}_rate5m, 0.0001)",
            "eval_time": "10m",
            "exp_samples": [
                {"labels": f'{{namespace="{ns}",streamingmodel="{m}"}}', "value": v}
                for (ns, m), v in values.items()
            ],
        }
        for q, values in expected.items()
    ]
    _ok(_run(tmp_path, _groups(), expr_cases=cases))


def test_ttft_above_target_fires_after_five_minutes(tmp_path):
    groups = _without_annotations(_groups())
    chat = {"severity": "warning", "namespace": "llm", "streamingmodel": "chat"}
    solo = {"severity": "warning", "namespace": "llm", "streamingmodel": "solo"}
    cases = [
        # pending, not firing, before the 5 minutes are up
        _alert("SluiceTTFTAboveTarget", "4m"),
        # then exactly chat (over its HPA target) and solo (over the fallback); not fast,
        # relaxed (own target 1 s), quiet (too little traffic), other/chat (fast)
        _alert("SluiceTTFTAboveTarget", "7m", chat, solo),
        _alert("SluiceTTFTAboveTarget", "20m", chat, solo),
    ]
    _ok(_run(tmp_path, groups, alert_cases=cases))


def test_ttft_alert_text(tmp_path):
    case = {
        "alertname": "SluiceTTFTAboveTarget",
        "eval_time": "7m",
        "exp_alerts": [
            {
                "exp_labels": {"severity": "warning", "namespace": "llm", "streamingmodel": m},
                "exp_annotations": {
                    "summary": f"llm/{m}: TTFT p90 above target for 5 minutes",
                    "description": (
                        f"Time to first token p90 is {d} over the last 5 minutes, above the "
                        "StreamingModel's target. Check the HPA (maxReplicas reached?), Pending "
                        "pods (no free GPUs: the StreamingModel status says why) and the custom "
                        "metrics API (kubectl get --raw /apis/custom.metrics.k8s.io/v1beta2)."
                    ),
                },
            }
            for m, d in (("chat", "460ms"), ("solo", "725ms"))
        ],
    }
    _ok(_run(tmp_path, _groups(), alert_cases=[case]))


def test_client_disconnects_over_five_percent(tmp_path):
    groups = _without_annotations(_groups())
    chat = {"severity": "warning", "namespace": "llm", "streamingmodel": "chat"}
    cases = [
        _alert("SluiceClientDisconnectRateHigh", "9m"),  # 10 % but not yet for 10 minutes
        _alert("SluiceClientDisconnectRateHigh", "12m", chat),  # fast (2 %) stays silent
    ]
    _ok(_run(tmp_path, groups, alert_cases=cases))


def test_stream_errors_over_one_percent(tmp_path):
    groups = _without_annotations(_groups())
    chat = {"severity": "critical", "namespace": "llm", "streamingmodel": "chat"}
    cases = [
        _alert("SluiceStreamErrorRateHigh", "4m"),
        _alert("SluiceStreamErrorRateHigh", "7m", chat),  # fast (0.5 %) stays silent
    ]
    _ok(_run(tmp_path, groups, alert_cases=cases))


def test_pods_not_ready_for_fifteen_minutes(tmp_path):
    groups = _without_annotations(_groups())
    cases = [
        _alert("SluicePodsNotReady", "14m"),
        # chat's Pending pod only: fast's pod got Ready at 10 m, web-1 is not ours
        _alert(
            "SluicePodsNotReady",
            "20m",
            {"severity": "warning", "namespace": "llm", "streamingmodel": "chat"},
        ),
    ]
    _ok(_run(tmp_path, groups, alert_cases=cases))


def test_activation_timeouts_fire_per_model(tmp_path):
    groups = _without_annotations(_groups())
    solo = {"severity": "warning", "namespace": "team", "streamingmodel": "solo"}
    chat = {"severity": "warning", "namespace": "llm", "streamingmodel": "chat"}
    cases = [
        _alert("SluiceActivationTimedOut", "5m", solo),  # fast's forwarded ones stay silent
        _alert("SluiceActivationTimedOut", "13m", chat, solo),
    ]
    _ok(_run(tmp_path, groups, alert_cases=cases))


def test_negative_control_a_broken_rule_fails(tmp_path):
    """The harness can fail: a threshold of 50 % instead of 5 % must not pass the test above."""
    groups = _without_annotations(_groups())
    for g in groups:
        for r in g["rules"]:
            if r.get("alert") == "SluiceClientDisconnectRateHigh":
                r["expr"] = r["expr"].replace(") > 0.05", ") > 0.5", 1)
                assert ") > 0.5 " in r["expr"]
    case = _alert(
        "SluiceClientDisconnectRateHigh",
        "12m",
        {"severity": "warning", "namespace": "llm", "streamingmodel": "chat"},
    )
    proc = _run(tmp_path, groups, alert_cases=[case])
    assert proc.returncode != 0 and "FAILED" in (proc.stdout + proc.stderr)


# ---- the optional PrometheusRule ----------------------------------------------------------


@pytest.fixture(scope="module")
def chart_with_value(tmp_path_factory, helm):
    """The chart as shipped; the values schema gets prometheusRules if it does not have it
    yet (the value is added to values.yaml/schema by the chart's owner)."""
    dst = tmp_path_factory.mktemp("chart") / "sluice-operator"
    shutil.copytree(OPERATOR_CHART, dst)
    schema_file = dst / "values.schema.json"
    schema = json.loads(schema_file.read_text())
    schema["properties"].setdefault(
        "prometheusRules",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "enabled": {"type": "boolean"},
                "namespace": {"type": "string", "maxLength": 63},
                "name": {"type": "string", "maxLength": 253},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    )
    schema_file.write_text(json.dumps(schema))
    return dst


def test_prometheusrule_not_rendered_by_default(h: Helm):
    assert not by_kind(h.template(OPERATOR_CHART), "PrometheusRule")


def test_prometheusrule_ships_the_rules_unchanged(h: Helm, chart_with_value):
    docs = h.template(
        chart_with_value,
        set_=[
            "prometheusRules.enabled=true",
            "prometheusRules.labels.release=kube-prometheus-stack",
            "prometheusRules.namespace=monitoring",
        ],
    )
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "sluice-sluice-operator-rules"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sluice"
    # Helm must not have touched the alert templates ({{ $labels.x }} is Prometheus's)
    assert rule["spec"] == {"groups": _groups()}
    docs = h.template(chart_with_value, set_=["prometheusRules.enabled=true"])
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "sluice-system"
    assert "release" not in rule["metadata"]["labels"]
