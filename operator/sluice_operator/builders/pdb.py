"""PodDisruptionBudget: voluntary evictions (node drains) take one replica at a time."""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import metadata, selector_labels


def desired_pdb(model: StreamingModel) -> dict[str, Any] | None:
    # With at most one replica a budget would either block every drain or protect nothing.
    if model.spec.max_possible_replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(model),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(model)},
            # A pod stuck loading (never Ready) must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
