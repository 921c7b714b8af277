"""The prometheus-adapter rules (charts/sluice-operator/files/prometheus-adapter-rules.yaml):
their shape, that the chart ships them unchanged, that the real Prometheus query engine
(promtool) turns a TTFT histogram into the right per-pod quantiles with idle pods at 0, and
that their metric names are the ones the operator's HPA asks for."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from testkit.promtool import run_tests
from testkit.repo import ROOT

from .chartlib import HERE, OPERATOR_CHART, by_kind, load_crd

RULES_FILE = OPERATOR_CHART / "files" / "prometheus-adapter-rules.yaml"
PERCENTILES = {"p50": 0.5, "p75": 0.75, "p90": 0.9, "p95": 0.95, "p99": 0.99}
# Metric family -> the server histogram it is made from: TTFT (every model's HPA, a
# disaggregated model's prefill pool) and inter-token latency (a decode pool's HPA).
FAMILIES = {"ttft": "sluice_ttft_seconds", "itl": "sluice_inter_token_latency_seconds"}


def _rules() -> list[dict]:
    return yaml.safe_load(RULES_FILE.read_text())["rules"]


def _by_name() -> dict[str, dict]:
    return {r["name"]["as"]: r for r in _rules()}


def test_one_rule_per_percentile_the_api_offers():
    crd = load_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    offered = spec["properties"]["autoscaling"]["properties"]["ttftPercentile"]["enum"]
    assert sorted(offered) == sorted(PERCENTILES.values())
    pools = spec["properties"]["disaggregation"]["properties"]["decode"]["properties"]
    assert sorted(pools["autoscaling"]["properties"]["percentile"]["enum"]) == sorted(offered)
    assert sorted(_by_name()) == sorted(
        f"sluice_{family}_{p}_seconds" for family in FAMILIES for p in PERCENTILES
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("label,quantile", PERCENTILES.items())
def test_rule_shape(family, label, quantile):
    histogram = FAMILIES[family]
    rule = _by_name()[f"sluice_{family}_{label}_seconds"]
    assert rule["seriesQuery"] == f'{histogram}_count{{namespace!="",pod!=""}}'
    assert rule["resources"] == {
        "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    }
    assert rule["name"]["matches"] == f"^{histogram}_count$"
    q = rule["metricsQuery"]
    assert q.startswith(f"(histogram_quantile({quantile}, sum by (le, <<.GroupBy>>) ")
    assert f"rate({histogram}_bucket{{<<.LabelMatchers>>}}[1m])" in q
    assert " > 0)" in q and q.count(" or ") == 2  # idle pods: 0, not NaN or missing
    assert "\n" not in q


def test_operator_hpa_asks_for_the_adapter_metrics():
    """Import the operator's HPA builder: every percentile maps onto an adapter metric."""
    hpa = pytest.importorskip("sluice_operator.builders.hpa")
    names = set(_by_name())
    for quantile in PERCENTILES.values():
        assert hpa.ttft_metric_name(quantile) in names
    render = pytest.importorskip("sluice_operator.render")
    seen = 0
    for sample in sorted((ROOT / "samples").glob("*.yaml")):
        for body in yaml.safe_load_all(sample.read_text()):
            if not body:
                continue
            for obj in render.render_objects(body):
                if obj["kind"] == "HorizontalPodAutoscaler":  # a model's or a pool's
                    (metric,) = obj["spec"]["metrics"]
                    assert metric["type"] == "Pods"
                    assert metric["pods"]["metric"]["name"] in names
                    assert metric["pods"]["target"]["type"] == "AverageValue"
                    seen += 1
    assert seen, "no sample renders an HPA"


def test_chart_ships_the_rules_unchanged(h):
    docs = h.template(OPERATOR_CHART, set_=["prometheusAdapter.rules.enabled=true"])
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "prometheus-adapter" in d["metadata"]["name"]]
    assert cm["metadata"]["name"] == "sluice-sluice-operator-prometheus-adapter-rules"
    assert cm["metadata"]["namespace"] == "sluice-system"
    assert cm["data"]["config.yaml"].strip() == RULES_FILE.read_text().strip()
    assert yaml.safe_load(cm["data"]["config.yaml"])["rules"] == _rules()

    docs = h.template(OPERATOR_CHART, values=[HERE / "values-all-on.yaml"])
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "prometheus-adapter" in d["metadata"]["name"]]
    assert cm["metadata"]["namespace"] == "monitoring"


def test_rules_not_rendered_by_default(h):
    docs = h.template(OPERATOR_CHART)
    assert not [
        d for d in by_kind(docs, "ConfigMap") if "prometheus-adapter" in d["metadata"]["name"]
    ]


# ---- the queries, evaluated by Prometheus's own engine -----------------------------------
#
# Three pods in namespace llm: "busy" served 10 SSE streams per 15 s with TTFT in
# (0.05, 0.1] s and 5 WebSocket streams in (0.1, 0.25] s; "idle" served before but nothing
# in the last minute; "fresh" is scraped (up == 1) but never served; "down" has a target that
# fails to scrape (up == 0) and no TTFT series in the window. histogram_quantile over
# the 15 streams per step interpolates inside the buckets (expected values below).

EXPECTED_BUSY = {0.5: 0.0875, 0.75: 0.1375, 0.9: 0.205, 0.95: 0.2275, 0.99: 0.2455}
LABEL_MATCHERS = 'namespace="llm",pod=~"busy|idle|fresh|down"'

SERIES = [
    *[
        (f'sluice_ttft_seconds_bucket{{namespace="llm",pod="busy",protocol="sse",le="{le}"}}', v)
        for le, v in (
            ("0.05", "0+0x40"),
            ("0.1", "0+10x40"),
            ("0.25", "0+10x40"),
            ("+Inf", "0+10x40"),
        )
    ],
    *[
        (
            f'sluice_ttft_seconds_bucket{{namespace="llm",pod="busy",protocol="websocket",le="{le}"}}',
            v,
        )
        for le, v in (("0.05", "0+0x40"), ("0.1", "0+0x40"), ("0.25", "0+5x40"), ("+Inf", "0+5x40"))
    ],
    ('sluice_ttft_seconds_count{namespace="llm",pod="busy",protocol="sse"}', "0+10x40"),
    ('sluice_ttft_seconds_count{namespace="llm",pod="busy",protocol="websocket"}', "0+5x40"),
    *[
        (
            f'sluice_ttft_seconds_bucket{{namespace="llm",pod="idle",protocol="sse",le="{le}"}}',
            "7+0x40",
        )
        for le in ("0.05", "0.1", "0.25", "+Inf")
    ],
    ('sluice_ttft_seconds_count{namespace="llm",pod="idle",protocol="sse"}', "7+0x40"),
    # another namespace's pod with the same name must not leak in
    (
        'sluice_ttft_seconds_bucket{namespace="other",pod="busy",protocol="sse",le="+Inf"}',
        "0+100x40",
    ),
    *[
        (f'up{{namespace="llm",pod="{p}",job="kubernetes-pods"}}', "1+0x40")
        for p in ("busy", "idle", "fresh")
    ],
    ('up{namespace="llm",pod="down",job="kubernetes-pods"}', "0+0x40"),
]


def adapter_expand(query: str) -> str:
    """What prometheus-adapter sends for pods busy/idle/fresh/down in namespace llm."""
    out = query.replace("<<.LabelMatchers>>", LABEL_MATCHERS).replace("<<.GroupBy>>", "pod")
    assert "<<" not in out and ">>" not in out
    return out


def _promtool_case(expr: str, expected: dict[str, float]) -> dict:
    return {
        # round(): compare at 0.1 ms, not in the last bits of a float
        "expr": f"round({expr}, 0.0001)",
        "eval_time": "5m",
        "exp_samples": [{"labels": f'{{pod="{pod}"}}', "value": v} for pod, v in expected.items()],
    }


def _run_promtool(tmp_path, cases: list[dict]) -> subprocess.CompletedProcess[str]:
    return run_tests(tmp_path, SERIES, what="adapter queries not evaluated", expr_cases=cases)


def test_queries_give_quantiles_for_busy_pods_and_zero_for_idle_ones(tmp_path):
    cases = [
        _promtool_case(
            adapter_expand(_by_name()[f"sluice_ttft_{label}_seconds"]["metricsQuery"]),
            {"busy": EXPECTED_BUSY[q], "idle": 0, "fresh": 0},
        )
        for label, q in PERCENTILES.items()
    ]
    proc = _run_promtool(tmp_path, cases)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_negative_control_plain_quantile_loses_idle_pods(tmp_path):
    """Without the `or` branches the idle pod is NaN and the fresh one missing: the same
    expectations must fail, which shows the test above can tell the difference."""
    plain = "histogram_quantile(0.9, sum by (le, <<.GroupBy>>) (rate(sluice_ttft_seconds_bucket{<<.LabelMatchers>>}[1m])))"
    proc = _run_promtool(
        tmp_path,
        [
            _promtool_case(
                adapter_expand(plain), {"busy": EXPECTED_BUSY[0.9], "idle": 0, "fresh": 0}
            )
        ],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    got = out.split("got:")[1]
    assert 'pod="idle"} NaN' in got
    assert "fresh" not in got


def test_docs_values_snippet_is_the_rules_file():
    """docs/helm.md's prometheus-adapter values (option B) are the rules file's."""
    doc = (ROOT / "docs" / "helm.md").read_text()
    block = (
        doc.split("<!-- prometheus-adapter-values -->", 1)[1]
        .split("```yaml", 1)[1]
        .split("```", 1)[0]
    )
    assert yaml.safe_load(block)["rules"]["custom"] == _rules()


def test_pod_that_cannot_be_scraped_has_no_value_not_zero(tmp_path):
    """`down` (up == 0) is absent from the result (the HPA counts it as missing, not idle);
    negative control: the `up` branch without `== 1` reports it as 0."""
    query = adapter_expand(_by_name()["sluice_ttft_p90_seconds"]["metricsQuery"])
    expected = {"busy": EXPECTED_BUSY[0.9], "idle": 0, "fresh": 0}
    proc = _run_promtool(tmp_path, [_promtool_case(query, expected)])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    assert " == 1))" in query
    lenient = query.replace(" == 1))", "))")
    proc = _run_promtool(tmp_path, [_promtool_case(lenient, expected)])
    assert proc.returncode != 0 and 'pod="down"' in proc.stdout + proc.stderr
