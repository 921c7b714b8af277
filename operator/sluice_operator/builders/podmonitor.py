"""The optional Prometheus Operator PodMonitor (monitoring.coreos.com/v1):
`observability.podMonitor.enabled`.

It selects the model's pods by the Deployment's selector labels and scrapes the named
container port at /metrics, the same target the pods' `prometheus.io/*` annotations
describe for annotation-based scrape configs. The Prometheus Operator labels every series
with `namespace` and `pod`, which the chart's recording rules, the prometheus-adapter rule
and the KEDA query rely on.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import PORT_NAME, metadata, selector_labels

API_VERSION = "monitoring.coreos.com/v1"


def desired_pod_monitor(model: StreamingModel) -> dict[str, Any] | None:
    pm = model.spec.observability.pod_monitor
    if not pm.enabled:
        return None
    meta = metadata(model)
    meta["labels"] = {**pm.labels, **meta["labels"]}  # the operator's own labels win
    return {
        "apiVersion": API_VERSION,
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector_labels(model)},
            "namespaceSelector": {"matchNames": [model.namespace]},
            "podMetricsEndpoints": [
                {"port": PORT_NAME, "path": "/metrics", "interval": pm.interval}
            ],
        },
    }
