"""How each version of a split serves, from its pods' /metrics (status.split).

The pods' counters only grow, so a window's numbers are the differences between two reads
of the same pods: requests accepted (sluice_requests_total), streams ended by an error
event (sluice_stream_errors_total), tokens streamed (sluice_output_tokens_total) and the
time-to-first-token histogram (sluice_ttft_seconds), summed over protocols and pods. A pod
read once only (new) or whose counters went down (restarted) adds nothing to that window.
The median TTFT is read from the histogram as Prometheus' histogram_quantile reads it:
linear within the bucket that holds the middle observation.

Pure: pages in, numbers out; the scale-to-zero poller reads the pages and keeps the last
reading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Reading:
    """One pod's counters at one moment."""

    requests: float = 0.0
    errors: float = 0.0
    tokens: float = 0.0
    ttft: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count)

    def minus(self, before: Reading) -> Reading | None:
        """What happened between `before` and this reading; None when a counter went down
        (the pod restarted: its window is lost, not negative)."""
        bounds = dict(before.ttft)
        ttft = tuple((le, n - bounds.get(le, 0.0)) for le, n in self.ttft)
        deltas = (self.requests - before.requests, self.errors - before.errors)
        if min((*deltas, self.tokens - before.tokens, *(n for _, n in ttft)), default=0) < 0:
            return None
        return Reading(*deltas, self.tokens - before.tokens, ttft)

    def plus(self, other: Reading) -> Reading:
        bounds = dict(other.ttft)
        ttft = tuple((le, n + bounds.pop(le, 0.0)) for le, n in self.ttft)
        ttft = tuple(sorted(ttft + tuple(bounds.items())))
        return Reading(
            self.requests + other.requests,
            self.errors + other.errors,
            self.tokens + other.tokens,
            ttft,
        )


def reading(page: str) -> Reading:
    """The counters of one /metrics page (every protocol's samples summed)."""
    totals = {"sluice_requests": 0.0, "sluice_stream_errors": 0.0, "sluice_output_tokens": 0.0}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "sluice_ttft_seconds":
            for s in family.samples:
                if s.name == "sluice_ttft_seconds_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    return Reading(
        totals["sluice_requests"],
        totals["sluice_stream_errors"],
        totals["sluice_output_tokens"],
        tuple(sorted(buckets.items())),
    )


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) buckets; None when empty. In
    the +Inf bucket: the highest finite bound, as Prometheus answers."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class VersionStats:
    """One version's window: what status.split shows beside its weight."""

    ttft_milliseconds: int | None = None
    error_rate: str | None = None
    tokens_per_second: int | None = None
    window_seconds: int | None = None

    def fields(self) -> dict[str, int | str]:
        """The status.split fields it has (camelCase)."""
        out: dict[str, int | str | None] = {
            "ttftMilliseconds": self.ttft_milliseconds,
            "errorRate": self.error_rate,
            "tokensPerSecond": self.tokens_per_second,
            "windowSeconds": self.window_seconds,
        }
        return {k: v for k, v in out.items() if v is not None}


def window(
    before: Mapping[str, Reading], after: Mapping[str, Reading], seconds: float
) -> VersionStats:
    """The version's numbers between two reads of its pods (by pod name), `seconds` apart."""
    if seconds <= 0:
        return VersionStats()
    total = Reading()
    for pod, now in after.items():
        if pod in before and (delta := now.minus(before[pod])) is not None:
            total = total.plus(delta)
    p50 = quantile(0.5, total.ttft)
    rate = f"{total.errors / total.requests:.4f}" if total.requests > 0 else None
    return VersionStats(
        ttft_milliseconds=round(p50 * 1000) if p50 is not None else None,
        error_rate=rate,
        tokens_per_second=round(total.tokens / seconds),
        window_seconds=round(seconds),
    )
