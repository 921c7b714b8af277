"""ClusterIP Service: HTTP, SSE, WebSocket and /metrics all on port 8000, named `http`."""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import PORT, PORT_NAME, metadata, selector_labels, serving_pods
from .leaderworkerset import leader_selector


def desired_service(model: StreamingModel) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(model),
        "spec": {
            "type": "ClusterIP",
            # With several nodes per replica only the leaders serve HTTP; a disaggregated
            # model's decode pool only (its prefill pods answer the router's first step).
            "selector": {
                **selector_labels(model),
                **leader_selector(model),
                **serving_pods(model),
            },
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def service_url(model: StreamingModel) -> str:
    return f"http://{model.name}.{model.namespace}.svc:{PORT}"
