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


def ttft_metric_name(percentile: float) -> str:
    return f"sluice_ttft_p{round(percentile * 100)}_seconds"


def ttft_metrics_query(percentile: float, group_by: str, label_matchers: str) -> str:
    """One TTFT quantile per `group_by` group (the pod), 0 for pods with no recent streams."""
    q = f"{percentile:g}"
    sel = f"{{{label_matchers}}}"
    return (
        f"(histogram_quantile({q}, sum by (le, {group_by}) "
        f"(rate(sluice_ttft_seconds_bucket{sel}[{RATE_WINDOW}]))) > 0) "
        f"or (0 * sum by ({group_by}) (rate(sluice_ttft_seconds_count{sel}[{RATE_WINDOW}]))) "
        f"or (0 * max by ({group_by}) (up{sel} == 1))"
    )
