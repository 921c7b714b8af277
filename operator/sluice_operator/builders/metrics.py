"""The per-pod TTFT query, in one place for both autoscaler backends (docs/design.md).

The chart's prometheus-adapter rule (charts/sluice-operator/files/prometheus-adapter-rules.yaml)
is this template with the adapter's `<<.GroupBy>>` and `<<.LabelMatchers>>` placeholders; a
test checks the file equals `ttft_metrics_query(p, ADAPTER_GROUP_BY, ADAPTER_LABEL_MATCHERS)`
for every percentile. The KEDA trigger fills the same template with `pod` and this model's
pods, so both backends scale on exactly the same number.

Why three branches: an idle pod has no samples in the rate window, so its quantile is NaN
(and a pod scraped once has no rate at all). `> 0` drops the NaN; the `or` branches report 0
instead for a pod whose _count series exists (the server pre-creates it), else for a pod
whose last scrape succeeded (`up == 1`). Idle pods then count as 0 in the average, as they
should. A pod Prometheus cannot scrape (`up == 0`: a server too loaded to answer /metrics,
a crashed container) gets no value rather than 0, so the HPA treats it as missing (at the
target when it considers scaling down) instead of as idle.
"""

from __future__ import annotations

ADAPTER_GROUP_BY = "<<.GroupBy>>"
ADAPTER_LABEL_MATCHERS = "<<.LabelMatchers>>"
RATE_WINDOW = "1m"


# The server's histograms the adapter turns into per-pod quantiles: time to first token
# (every model's HPA, a disaggregated model's prefill pool) and inter-token latency (a
# disaggregated model's decode pool).
TTFT_HISTOGRAM = "sluice_ttft_seconds"
ITL_HISTOGRAM = "sluice_inter_token_latency_seconds"
METRIC_PREFIX = {TTFT_HISTOGRAM: "sluice_ttft", ITL_HISTOGRAM: "sluice_itl"}


def ttft_metric_name(percentile: float) -> str:
    return latency_metric_name(TTFT_HISTOGRAM, percentile)


def latency_metric_name(histogram: str, percentile: float) -> str:
    """sluice_ttft_p90_seconds, sluice_itl_p90_seconds: the adapter's custom metric names."""
    return f"{METRIC_PREFIX[histogram]}_p{round(percentile * 100)}_seconds"


def ttft_metrics_query(
    percentile: float, group_by: str, label_matchers: str, histogram: str = TTFT_HISTOGRAM
) -> str:
    """One quantile of `histogram` per `group_by` group (the pod), 0 for pods with no recent
    streams."""
    q = f"{percentile:g}"
    sel = f"{{{label_matchers}}}"
    return (
        f"(histogram_quantile({q}, sum by (le, {group_by}) "
        f"(rate({histogram}_bucket{sel}[{RATE_WINDOW}]))) > 0) "
        f"or (0 * sum by ({group_by}) (rate({histogram}_count{sel}[{RATE_WINDOW}]))) "
        f"or (0 * max by ({group_by}) (up{sel} == 1))"
    )
