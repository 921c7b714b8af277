"""The Grafana dashboard in the operator chart: off by default; on, a ConfigMap with the
sidecar's label (configurable) holding files/grafana-dashboard.json byte for byte.
(tests/server/test_dashboard_prometheus.py runs its queries on real data.)"""

from __future__ import annotations

import json

from .chartlib import OPERATOR_CHART, by_kind

DASHBOARD = OPERATOR_CHART / "files" / "grafana-dashboard.json"


def _dashboards(docs):
    return [
        d for d in by_kind(docs, "ConfigMap") if "sluice-streamingmodels.json" in d.get("data", {})
    ]


def test_not_rendered_by_default(h):
    assert _dashboards(h.template(OPERATOR_CHART)) == []


def test_configmap_for_the_sidecar(h):
    [cm] = _dashboards(h.template(OPERATOR_CHART, set_=["grafanaDashboard.enabled=true"]))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["name"] == "sluice-sluice-operator-dashboard"
    assert cm["data"]["sluice-streamingmodels.json"] == DASHBOARD.read_text().rstrip("\n")
    assert json.loads(cm["data"]["sluice-streamingmodels.json"])["uid"] == "sluice-streamingmodels"


def test_label_namespace_and_annotations_are_configurable(h):
    docs = h.template(OPERATOR_CHART, set_=[
        "grafanaDashboard.enabled=true", "grafanaDashboard.label=my_dashboards",
        "grafanaDashboard.labelValue=yes", "grafanaDashboard.namespace=monitoring",
        "grafanaDashboard.annotations.grafana_folder=LLM",
    ])  # fmt: skip
    [cm] = _dashboards(docs)
    assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
