"""KEDA ScaledObject (keda.sh/v1alpha1): the alternative to our HPA (autoscaling.backend: keda).

KEDA runs one Prometheus query and feeds the result to an HPA it makes itself
(keda-hpa-<name>) as an External metric. With metricType AverageValue that HPA wants
ceil(value / threshold) replicas, so the query returns the SUM over this model's pods of the
per-pod TTFT quantile (idle pods 0) and the threshold is the per-pod target: the same
decision as our HPA's Pods metric, whose average over pods is compared with the target.
The per-pod query is the chart's prometheus-adapter rule (builders/metrics.py).

KEDA's cooldownPeriod only applies to scaling to zero, which minReplicas >= 1 rules out,
so scale-down is governed by the HPA behavior below, identical to our own HPA's.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import fmt_number, metadata
from .hpa import hpa_behavior
from .leaderworkerset import scale_target
from .metrics import ttft_metrics_query

API_VERSION = "keda.sh/v1alpha1"
TRIGGER_NAME = "ttft"


def keda_hpa_name(model: StreamingModel) -> str:
    """The HPA KEDA makes for a ScaledObject (its default; the status reads it)."""
    return f"keda-hpa-{model.name}"


def pod_matchers(model: StreamingModel) -> str:
    """This model's pods: the Deployment's <name>-<template hash>-<suffix> pod names.

    Names, not labels: the namespace and pod labels are the two every Prometheus pod
    scrape config sets (the adapter rule relies on them too); label copies are optional.
    Two dash-free segments after the name keep a model named <name>-x from matching. The
    name is a DNS-1035 label (validation.py), so it holds no regex metacharacters. With
    parallelism.nodes > 1 the leaders, <name>-<group index> (the workers,
    <name>-<group>-<index>, serve no metrics).
    """
    if model.multi_node:
        return f'namespace="{model.namespace}",pod=~"{model.name}-[0-9]+"'
    return f'namespace="{model.namespace}",pod=~"{model.name}-[a-z0-9]+-[a-z0-9]+"'


def keda_query(model: StreamingModel) -> str:
    a = model.spec.autoscaling
    assert a is not None
    return f"sum({ttft_metrics_query(a.ttft_percentile, 'pod', pod_matchers(model))})"


def ttft_threshold_seconds(milliseconds: int) -> str:
    """500 -> '0.5': KEDA trigger metadata values are strings; the metric is in seconds."""
    return fmt_number(milliseconds / 1000)


def desired_scaled_object(model: StreamingModel) -> dict[str, Any] | None:
    spec = model.spec
    if spec.autoscaling_backend != "keda":
        return None
    a = spec.autoscaling
    assert a is not None
    return {
        "apiVersion": API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata(model),
        "spec": {
            "scaleTargetRef": scale_target(model),
            "pollingInterval": a.keda.polling_interval_seconds,
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": hpa_behavior(model)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "name": TRIGGER_NAME,
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": a.keda.server_address,
                        "query": keda_query(model),
                        "threshold": ttft_threshold_seconds(a.target_ttft_milliseconds),
                        # No pods scraped yet (empty result) reads as 0, not as an error.
                        "ignoreNullValues": "true",
                    },
                }
            ],
        },
    }
