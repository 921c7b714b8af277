"""Autoscaling on time to first token (`autoscaling`): an HPA or a KEDA ScaledObject, and
scale to zero with the operator's activator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ApiModel, Rule, sub

# The activator holds a request this long past the startup budget by default.
HOLD_TIMEOUT_MARGIN_SECONDS = 60


class KedaSpec(ApiModel):
    """Settings used only with autoscaling.backend: keda (the ScaledObject's Prometheus trigger)."""

    server_address: str = Field(
        default="http://prometheus-operated.monitoring.svc:9090",
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description=(
            "URL of the Prometheus that scrapes the model pods; KEDA runs the TTFT query "
            "there. The default is the Service the Prometheus Operator (kube-prometheus-stack) "
            "makes in namespace monitoring, the same Prometheus docs/helm.md points "
            "prometheus-adapter at; for the prometheus-community 'prometheus' chart use "
            "http://<release>-server.<namespace>.svc (port 80)."
        ),
    )
    polling_interval_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="How often KEDA runs the query, in seconds (KEDA's pollingInterval).",
    )


class ScaleToZeroSpec(ApiModel):
    """Scale to zero when idle and back on the first request (autoscaling.minReplicas: 0).

    The operator's activator (shipped by the sluice-operator chart) is in the model's route
    while it has no Ready replica: it holds each request, keeps streams alive, and the
    operator scales the workload to 1 on that demand (docs/autoscaling.md, "Scale to zero")."""

    idle_seconds: int = Field(
        default=600,
        ge=30,
        le=604800,
        description="Scale to zero once no request has been accepted for this long on any "
        "pod and none is in flight (each pod's sluice_last_request_timestamp_seconds and "
        "sluice_active_streams, read from its /metrics). With backend keda this is the "
        "ScaledObject's cooldownPeriod.",
    )
    hold_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description="How long the activator holds a request while a replica starts; past it "
        "a request that received nothing gets 503 model_starting with Retry-After, a stream "
        "already committed to 200 ends with its protocol's error event. Default: "
        "startup.timeoutSeconds + 60.",
    )
    max_held: int = Field(
        default=100,
        ge=1,
        le=100000,
        description="Most requests the activator holds for this model at once (per activator "
        "pod); past it 429 with Retry-After, before anything else is sent.",
    )


MIN_ZERO_NEEDS_AUTOSCALING = (
    "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.enabled: the operator scales "
    "0 <-> 1 and the autoscaler 1 <-> maxReplicas"
)


class AutoscalingSpec(ApiModel):
    """Horizontal autoscaling on time to first token: an HPA fed by prometheus-adapter with the chart's rule (backend hpa), or a KEDA ScaledObject running the same query (backend keda)."""

    RULES = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            holds=lambda a: a.min_replicas <= a.max_replicas,
            field=".minReplicas",
            detail=lambda a: f"got minReplicas {a.min_replicas}, maxReplicas {a.max_replicas}",
        ),
        Rule(
            "!has(self.minReplicas) || self.minReplicas > 0 || !has(self.enabled) || self.enabled",
            MIN_ZERO_NEEDS_AUTOSCALING,
            holds=lambda a: a.min_replicas > 0 or a.enabled,
            field=".minReplicas",
        ),
        Rule(
            "!has(self.scaleToZero) || (has(self.minReplicas) && self.minReplicas == 0)",
            "autoscaling.scaleToZero is only used with autoscaling.minReplicas 0: set "
            "minReplicas: 0, or remove scaleToZero",
            holds=lambda a: a.scale_to_zero is None or a.min_replicas == 0,
            field=".scaleToZero",
            detail=lambda a: f"got minReplicas {a.min_replicas}",
        ),
    )

    enabled: bool = Field(
        default=True,
        description="Create the autoscaler (see backend); false keeps the settings but uses spec.replicas.",
    )
    backend: Literal["hpa", "keda"] = Field(
        default="hpa",
        description=(
            "Who scales. hpa: the operator makes a HorizontalPodAutoscaler on the custom "
            "metric sluice_ttft_pNN_seconds (install prometheus-adapter with the operator "
            "chart's rule). keda: the operator makes a KEDA ScaledObject (keda.sh/v1alpha1) "
            "whose Prometheus trigger runs the same per-pod TTFT query against "
            "autoscaling.keda.serverAddress; KEDA then owns an HPA named keda-hpa-<name>. "
            "Needs KEDA in the cluster and the operator chart's keda.enabled=true."
        ),
    )
    keda: KedaSpec = sub(KedaSpec, "KEDA settings, used when backend is keda.")
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest replicas. 0: scale to zero when idle (see scaleToZero); the HPA "
        "(or KEDA's) then keeps 1..maxReplicas and the operator owns 0 <-> 1.",
    )
    scale_to_zero: ScaleToZeroSpec | None = Field(
        default=None,
        description="Scale-to-zero settings, used with minReplicas 0 (defaults apply when unset).",
    )
    max_replicas: int = Field(
        default=4, ge=1, le=1000, description="Most replicas (each needs resources.gpus GPUs)."
    )
    target_ttft_milliseconds: int = Field(
        default=500,
        ge=1,
        le=600000,
        alias="targetTTFTMilliseconds",
        description="Target time to first token per pod, in milliseconds, at ttftPercentile.",
    )
    # Float literals: pydantic validates them (an enum in the CRD); the typing spec has none.
    ttft_percentile: Literal[0.5, 0.75, 0.9, 0.95, 0.99] = Field(  # type: ignore[valid-type]
        default=0.9,
        description="Which TTFT percentile the target applies to (0.5, 0.75, 0.9, 0.95 or 0.99).",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="Scale-up stabilization window in seconds (of our HPA, or of the HPA KEDA makes).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="Scale-down stabilization window in seconds, for either backend (model start-up is slow; avoid flapping).",
    )
