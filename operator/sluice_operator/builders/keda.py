"""KEDA ScaledObject (keda.sh/v1alpha1): the alternative to our HPA (autoscaling.backend: keda).

KEDA runs one Prometheus query and feeds the result to an HPA it makes itself
(keda-hpa-<name>) as an External metric. With metricType AverageValue that HPA wants
ceil(value / threshold) replicas, so the query returns the SUM over this model's pods of the
per-pod TTFT quantile (idle pods 0) and the threshold is the per-pod target: the same
decision as our HPA's Pods metric, whose average over pods is compared with the target.
The per-pod query is the chart's prometheus-adapter rule (builders/metrics.py).

KEDA's cooldownPeriod only applies to scaling to zero, so scale-down above one replica is
governed by the HPA behavior below, identical to our own HPA's.

Scale to zero (autoscaling.minReplicas 0): KEDA owns 0 <-> 1 and the operator never scales
(it only switches the route to the activator and back, scaletozero.py), so the two never
fight. minReplicaCount 0 (no idleReplicaCount: that is for a floor above 0), cooldownPeriod
= scaleToZero.idleSeconds (KEDA goes to 0 once no trigger has been active that long: the
TTFT query is 0 without streams), and a second trigger on the activator's held-requests
gauge, clamped to 1: it wakes the model (activation above 0) and never asks for more than
one replica; the TTFT trigger scales beyond. Prometheus must scrape the activator pods (the
operator chart annotates them). Their series carry the model's namespace in a `namespace`
label, which most scrape configs rename to `exported_namespace` (the target's namespace, the
operator's, wins unless honor_labels): the query accepts either.
"""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .common import fmt_number, metadata
from .hpa import hpa_behavior
from .leaderworkerset import scale_target
from .metrics import ttft_metrics_query
from .weights import awaiting_weights

API_VERSION = "keda.sh/v1alpha1"
TRIGGER_NAME = "ttft"
HELD_TRIGGER_NAME = "held-requests"


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


def held_query(model: StreamingModel) -> str:
    """Requests the activator holds for this model, clamped to 1 (see the docstring)."""
    forms = [
        f'sum(sluice_activator_held_requests{{{label}="{model.namespace}",model="{model.name}"}})'
        for label in ("namespace", "exported_namespace")
    ]
    return f"clamp_max({forms[0]} or {forms[1]}, 1)"


def held_trigger(model: StreamingModel) -> dict[str, Any]:
    a = model.spec.autoscaling
    assert a is not None
    return {
        "type": "prometheus",
        "name": HELD_TRIGGER_NAME,
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": a.keda.server_address,
            "query": held_query(model),
            "threshold": "1",
            "activationThreshold": "0",
            "ignoreNullValues": "true",
        },
    }


def desired_scaled_object(model: StreamingModel) -> dict[str, Any] | None:
    spec = model.spec
    if spec.autoscaling_backend != "keda" or awaiting_weights(model):
        return None
    a = spec.autoscaling
    assert a is not None
    zero = spec.scale_to_zero
    out: dict[str, Any] = {
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
    if zero is not None:
        out["spec"]["cooldownPeriod"] = zero.idle_seconds
        out["spec"]["triggers"].append(held_trigger(model))
    return out
