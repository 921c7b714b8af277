"""PodDisruptionBudget: voluntary evictions (node drains) take few replicas at a time.

Its maxUnavailable is the rollout's (`spec.rollout.maxUnavailable`), but at least 1: a budget
of 0 would block every node drain forever. A model that can run at most one replica gets no
budget: it would either block every drain (minAvailable 1) or protect nothing; such a model
is down while its node drains whatever the rollout setting (run 2 replicas to avoid that).

With parallelism.nodes > 1 the budget counts every pod of every group (leaders and workers):
one evicted pod recreates its whole group, whose pods are then all unavailable, so no
further eviction is allowed until that group is back: drains take a group at a time.
"""

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
            "maxUnavailable": max(1, model.spec.rollout.max_unavailable),
            "selector": {"matchLabels": selector_labels(model)},
            # A pod stuck loading (never Ready) must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
