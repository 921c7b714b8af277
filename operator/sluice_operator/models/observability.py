"""Monitoring objects and tracing (`observability`): a Prometheus Operator PodMonitor and
OpenTelemetry traces."""

from __future__ import annotations

from pydantic import Field

from .base import ApiModel, sub


class PodMonitorSpec(ApiModel):
    """A Prometheus Operator PodMonitor for the model's pods (clusters that run the Prometheus Operator)."""

    enabled: bool = Field(
        default=False,
        description=(
            "Make a monitoring.coreos.com/v1 PodMonitor that scrapes /metrics of every pod. "
            "Without the Prometheus Operator's CRD the rest of the model still converges and "
            "the status says why (condition PodMonitorReady)."
        ),
    )
    interval: str = Field(
        default="15s",
        pattern=r"^[0-9]+(ms|s|m)$",
        description="Scrape interval (Prometheus duration, e.g. 15s).",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Extra labels on the PodMonitor, e.g. the `release` label a kube-prometheus-stack "
            "Prometheus selects monitors by."
        ),
    )


class TracingSpec(ApiModel):
    """OpenTelemetry traces of every request (server and engine)."""

    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description=(
            "OTLP/HTTP traces endpoint, e.g. http://otel-collector.monitoring:4318/v1/traces; "
            "unset: no tracing."
        ),
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of new traces sampled (a sampled caller's traceparent is always followed).",
    )


class ObservabilitySpec(ApiModel):
    """Monitoring objects and tracing."""

    pod_monitor: PodMonitorSpec = sub(PodMonitorSpec, "Prometheus Operator PodMonitor.")
    tracing: TracingSpec = sub(TracingSpec, "OpenTelemetry tracing.")
