"""HorizontalPodAutoscaler (autoscaling/v2) on per-pod time to first token.

The metric comes from the custom metrics API (prometheus-adapter with the operator chart's
rule, docs/design.md "Autoscaling metric"): `sluice_ttft_p<NN>_seconds` per pod.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..models.disaggregation import Role
from ..models.resource import StreamingModel
from .common import metadata
from .disaggregation import POOL_SUFFIX
from .leaderworkerset import scale_target
from .metrics import ITL_HISTOGRAM, TTFT_HISTOGRAM, latency_metric_name, ttft_metric_name
from .weights import awaiting_weights


def ttft_target(milliseconds: int) -> str:
    """500 ms -> '500m' (a quantity in seconds: milli-seconds are milli-units)."""
    return f"{milliseconds}m"


def desired_hpa(model: StreamingModel) -> dict[str, Any] | None:
    spec = model.spec
    if spec.autoscaling_backend != "hpa" or awaiting_weights(model):
        return None
    a = spec.autoscaling
    assert a is not None  # the backend is hpa only with autoscaling on
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(model),
        "spec": {
            # The LeaderWorkerSet's scale subresource selects its leaders (hpaPodSelector).
            "scaleTargetRef": scale_target(model),
            # The HPA cannot go below 1 (without the alpha HPAScaleToZero gate): with
            # minReplicas 0 it keeps 1..N and the operator owns 0 <-> 1 (builders/activator.py).
            # At 0 replicas the HPA stops acting (ScalingActive False, ScalingDisabled) until
            # the operator's scale to 1 re-enables it, so the two never fight.
            "minReplicas": max(1, a.min_replicas),
            "maxReplicas": a.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": ttft_metric_name(a.ttft_percentile)},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": ttft_target(a.target_ttft_milliseconds),
                        },
                    },
                }
            ],
            "behavior": hpa_behavior(model),
        },
    }


def hpa_behavior(model: StreamingModel) -> dict[str, Any]:
    """Shared with the KEDA ScaledObject, which hands it to the HPA that KEDA makes."""
    a = model.spec.autoscaling
    assert a is not None
    return behavior(a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds)


def behavior(up_seconds: int, down_seconds: int) -> dict[str, Any]:
    """GPU pods take minutes to become ready: add capacity quickly, remove it slowly."""
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": up_seconds,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Pods", "value": 2, "periodSeconds": 60},
                {"type": "Percent", "value": 100, "periodSeconds": 60},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": down_seconds,
            "selectPolicy": "Min",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
        },
    }


# A disaggregated model's pools: prefill on time to first token (how long prompts wait for a
# prefill pod), decode on inter-token latency (how loaded its running streams are).
POOL_HISTOGRAM: dict[Role, str] = {"prefill": TTFT_HISTOGRAM, "decode": ITL_HISTOGRAM}


def desired_pool_hpa(role: Role) -> Callable[[StreamingModel], dict[str, Any] | None]:
    """The HPA `<name>-<role>` of a disaggregated model's pool with autoscaling, on its
    Deployment; None otherwise. The metric's pods are the pool's (the HPA reads the pods of
    its target's selector, which has the role)."""

    def build(model: StreamingModel) -> dict[str, Any] | None:
        d = model.spec.disaggregation
        if d is None or awaiting_weights(model):
            return None
        a = d.pool(role).autoscaling
        if a is None:
            return None
        name = model.name + POOL_SUFFIX[role]
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(model, name=name),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": a.min_replicas,
                "maxReplicas": a.max_replicas,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {
                                "name": latency_metric_name(POOL_HISTOGRAM[role], a.percentile)
                            },
                            "target": {
                                "type": "AverageValue",
                                "averageValue": ttft_target(a.target_milliseconds),
                            },
                        },
                    }
                ],
                "behavior": behavior(
                    a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds
                ),
            },
        }

    return build
