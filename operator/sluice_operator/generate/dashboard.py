"""The Grafana dashboard for StreamingModels, built with grafana-foundation-sdk (Grafana's
own typed builders), written to charts/sluice-operator/files/grafana-dashboard.json: the
chart ships it as a ConfigMap for Grafana's dashboard sidecar, and the file imports by hand.

Variables: `namespace`, and `model` (the StreamingModel: the Deployment's pods are named
<model>-<replicaset hash>-<suffix>, so every query selects them by pod name, like the
recording rules and the KEDA query; only the `namespace` and `pod` labels every scrape
config sets are needed). "Autoscaler's reading" is the operator's own per-pod TTFT query
(builders/metrics.py, what the HPA and KEDA see); target and replicas come from
kube-state-metrics (the HPA is named after the model); KV cache and running/waiting
requests are vLLM's own `vllm:*` metrics on the same /metrics.

`model` takes several values: pick a split's owner and its versions
(spec.routing.router.split, docs/versions.md) and the "Versions:" panels draw each one's
TTFT, error rate and tokens/s side by side (the versions serve one model name, so they are
told apart by their pods' names, the `version` label the queries derive); the other panels
add the chosen models up.

`PANELS` is the one list: the builder reads it, and tests run each target against a real
Prometheus (tests/observability).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..builders.metrics import ttft_metrics_query

UID = "sluice-streamingmodels"
TITLE = "Sluice / StreamingModels"
PODS = 'namespace="$namespace",pod=~"$model-[a-z0-9]+-[a-z0-9]+"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""


def _quantiles(metric: str, qs: tuple[float, ...]) -> tuple[Target, ...]:
    return tuple(
        Target(
            f"histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{{{PODS}}}[{RATE}])))",
            f"p{round(q * 100)}",
        )
        for q in qs
    )


def _rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{PODS}}}[{RATE}]))"


HPA = 'namespace="$namespace",horizontalpodautoscaler=~"$model"'
# The StreamingModel a series' pod belongs to, as label `version` (versions of a split serve
# one model name, so the series' own `model` label does not tell them apart).
_VERSION = '"version", "$1", "pod", "(.+)-[a-z0-9]+-[a-z0-9]+"'


def _by_version(inner: str) -> str:
    return f"label_replace({inner}, {_VERSION})"


def _version_rate(metric: str) -> str:
    return f"sum by (version) ({_by_version(f'rate({metric}{{{PODS}}}[{RATE}])')})"


def _activator(template: str) -> str:
    """An activator query for this model (scale to zero). Its series carry the model's
    namespace in their own `namespace` label, which a scrape config without honor_labels
    renames `exported_namespace` (the activator pod's namespace wins): either form."""
    forms = [
        template.format(sel=f'{label}="$namespace",model=~"$model"')
        for label in ("exported_namespace", "namespace")
    ]
    return f"({forms[0]}) or ({forms[1]})"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Time to first token vs target",
        "s",
        (
            *_quantiles("sluice_ttft_seconds", (0.5, 0.9, 0.99)),
            Target(
                f'max(kube_horizontalpodautoscaler_spec_target_metric{{{HPA},metric_name=~"sluice_ttft_p[0-9]+_seconds"}})',
                "target",
            ),
        ),
        "Request received -> first token's bytes written, per model; target from the HPA "
        "(kube-state-metrics).",
    ),
    Panel(
        "Inter-token latency",
        "s",
        _quantiles("sluice_inter_token_latency_seconds", (0.5, 0.99)),
        "Gap between consecutive token writes.",
    ),
    Panel(
        "Output tokens/s",
        "short",
        (Target(_rate("sluice_output_tokens_total"), "tokens/s"),),
    ),
    Panel(
        "Active streams",
        "short",
        (Target(f"sum by (pod) (sluice_active_streams{{{PODS}}})", "{{pod}}"),),
    ),
    Panel(
        "Requests and rejections by reason",
        "reqps",
        (
            Target(_rate("sluice_requests_total"), "accepted"),
            Target(_rate("sluice_rejections_total", "reason"), "rejected: {{reason}}"),
        ),
    ),
    Panel(
        "Client disconnects and aborts",
        "reqps",
        (
            Target(_rate("sluice_client_disconnects_total"), "client disconnects"),
            Target(_rate("sluice_aborts_total"), "aborts (any cause)"),
        ),
    ),
    Panel(
        "Stream errors after the 200",
        "reqps",
        (Target(_rate("sluice_stream_errors_total"), "stream errors"),),
        "Streams ended by an error event: time limit, stalled reader, drain, engine error.",
    ),
    Panel(
        "Time to the engine's first output",
        "s",
        _quantiles("sluice_first_output_seconds", (0.5, 0.99)),
        "Request received -> the engine's first output: the admission queue, the engine's "
        "own queue and prefill.",
    ),
    Panel(
        "Admission queue: wait by priority",
        "s",
        tuple(
            Target(
                f"histogram_quantile({q:g}, sum by (le, priority) "
                f"(rate(sluice_queue_wait_seconds_bucket{{{PODS}}}[{RATE}])))",
                f"p{round(q * 100)} {{{{priority}}}}",
            )
            for q in (0.5, 0.99)
        ),
        "Time admitted requests waited for a stream slot (--queue-size), part of their TTFT; "
        "by tenant too in sluice_queue_wait_seconds.",
    ),
    Panel(
        "Admission queue: waiting and shed",
        "short",
        (
            Target(f"sum by (priority) (sluice_queue_depth{{{PODS}}})", "waiting {{priority}}"),
            Target(
                f"sum by (reason) (rate(sluice_queue_sheds_total{{{PODS}}}[{RATE}]))",
                "shed/s {{reason}}",
            ),
        ),
        "Requests waiting per priority class, and refusals per second by reason: queue_full, "
        "displaced (lower priority shed for a higher), timeout, draining.",
    ),
    Panel(
        "Engine KV-cache usage",
        "percentunit",
        (Target(f"max by (pod) (vllm:kv_cache_usage_perc{{{PODS}}})", "{{pod}}"),),
    ),
    Panel(
        "Engine running and waiting requests",
        "short",
        (
            Target(f"sum(vllm:num_requests_running{{{PODS}}})", "running"),
            Target(f"sum(vllm:num_requests_waiting{{{PODS}}})", "waiting"),
        ),
    ),
    Panel(
        "Replicas: desired and current",
        "short",
        (
            Target(
                f"max(kube_horizontalpodautoscaler_status_desired_replicas{{{HPA}}})", "desired"
            ),
            Target(
                f"max(kube_horizontalpodautoscaler_status_current_replicas{{{HPA}}})", "current"
            ),
        ),
        "From the model's HPA (kube-state-metrics); with KEDA the HPA is keda-hpa-<model>.",
    ),
    Panel(
        "Scale to zero: activator held requests and outcomes",
        "short",
        (
            Target(_activator("sum(sluice_activator_held_requests{{{sel}}})"), "held"),
            Target(
                _activator(
                    "sum by (outcome) (rate(sluice_activator_requests_total{{{sel}}}["
                    + RATE
                    + "]))"
                ),
                "{{outcome}}/s",
            ),
        ),
        "Models with autoscaling.minReplicas 0: requests the activator holds while a replica "
        "starts, and how held requests ended (forwarded, timeout, rejected, disconnected).",
    ),
    Panel(
        "Autoscaler's reading: per-pod TTFT p90",
        "s",
        (Target(ttft_metrics_query(0.9, "pod", PODS), "{{pod}}"),),
        "What the HPA (prometheus-adapter) and KEDA read: each pod's p90 over 1 m, 0 when idle.",
    ),
    Panel(
        "Versions: time to first token p50",
        "s",
        (
            Target(
                "histogram_quantile(0.5, sum by (le, version) ("
                + _by_version(f"rate(sluice_ttft_seconds_bucket{{{PODS}}}[{RATE}])")
                + "))",
                "{{version}}",
            ),
        ),
        "Each chosen StreamingModel on its own line: pick a split's owner and its versions "
        "in the model variable to compare them (status.split has the same per version).",
    ),
    Panel(
        "Versions: stream error rate",
        "percentunit",
        (
            Target(
                f"{_version_rate('sluice_stream_errors_total')} / "
                f"{_version_rate('sluice_requests_total')}",
                "{{version}}",
            ),
        ),
        "Streams ended by an error event / requests accepted, per chosen StreamingModel.",
    ),
    Panel(
        "Versions: output tokens/s",
        "short",
        (Target(_version_rate("sluice_output_tokens_total"), "{{version}}"),),
        "Tokens streamed to clients per second, per chosen StreamingModel.",
    ),
)


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    dash = (
        db.Dashboard(TITLE)
        .uid(UID)
        .tags(["sluice", "llm", "streaming"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("namespace")
            .label("Namespace")
            .datasource(ds)
            .query("label_values(sluice_requests_total, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        .with_variable(
            db.QueryVariable("model")
            .label("StreamingModel")
            .datasource(ds)
            .query('label_values(sluice_requests_total{namespace="$namespace"}, pod)')
            .regex("/^(.+)-[a-z0-9]+-[a-z0-9]+$/")
            .multi(True)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    )
    for panel in PANELS:
        ts = (
            timeseries.Panel()
            .title(panel.title)
            .description(panel.description)
            .unit(panel.unit)
            .datasource(ds)
            .height(8)
            .span(12)
            .min(0)
        )
        for i, t in enumerate(panel.targets):
            ts = ts.with_target(
                prometheus.Dataquery().expr(t.expr).legend_format(t.legend).ref_id("ABCDEFGH"[i])
            )
        dash = dash.with_panel(ts)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(dash.build()))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"
