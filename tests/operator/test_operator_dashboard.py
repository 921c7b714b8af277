"""The Grafana dashboard's source (sluice_operator/generate/dashboard.py): the panels the
runbook relies on, both variables in every query, and Grafana's own model accepts the
generated JSON (grafana-foundation-sdk round trip). Its queries run on real data in
tests/server/test_dashboard_prometheus.py; the checked-in file is kept in step by
`crds --check` (test_operator_crd.py)."""

from __future__ import annotations

import json

import pytest
from operator_helpers import ROOT
from sluice_operator.generate import dashboard

FILE = ROOT / "charts/sluice-operator/files/grafana-dashboard.json"


def test_generated_file_is_in_step():
    assert FILE.read_text() == dashboard.render(), "regenerate with `make crds`"


def test_grafanas_model_accepts_the_json():
    """Parsed into the SDK's typed model and encoded again, the file comes back unchanged:
    nothing in it is outside Grafana's dashboard model."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads(FILE.read_text())
    model = Dashboard.from_json(data)
    assert model.uid == dashboard.UID and model.title == dashboard.TITLE
    assert len(model.panels) == len(dashboard.PANELS)
    assert json.loads(JSONEncoder(sort_keys=True).encode(model)) == data
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in data["panels"])
    # Negative control: a panel that is not an object is refused by the model.
    with pytest.raises(TypeError):
        Dashboard.from_json({**data, "panels": [42]})


def test_variables_and_panels():
    data = dashboard.build()
    names = [v["name"] for v in data["templating"]["list"]]
    assert names == ["datasource", "namespace", "model"]
    titles = {p.title for p in dashboard.PANELS}
    for needed in ("Time to first token vs target", "Inter-token latency", "Output tokens/s",
                   "Active streams", "Requests and rejections by reason",
                   "Client disconnects and aborts", "Stream errors after the 200",
                   "Time to the engine's first output", "Admission queue: wait by priority",
                   "Admission queue: waiting and shed", "Engine KV-cache usage",
                   "Engine running and waiting requests", "Replicas: desired and current",
                   "Autoscaler's reading: per-pod TTFT p90"):  # fmt: skip
        assert needed in titles
    for panel in dashboard.PANELS:
        for t in panel.targets:
            assert "$namespace" in t.expr and "$model" in t.expr, (panel.title, t.expr)
    # Grid: two panels a row, none overlapping.
    spots = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in data["panels"]]
    assert len(set(spots)) == len(spots)
