"""Declaring metric families on one registry: a name, a help text, the label names and, for
a histogram its buckets, for a gauge how worker processes combine (multiprocess mode).

The server's metrics (metrics.py) and the router's (router/metrics.py) each keep their own
registry (tests build many apps in one process) and declare every family through this one
shape, so a family is one call and the registry is said once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# How prometheus_client's multiprocess mode combines a gauge over worker processes.
GaugeMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent",
    "livemostrecent",
]  # fmt: skip


class Families:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(
        self, name: str, doc: str, labels: Sequence[str] = (), mode: GaugeMode = "all"
    ) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode=mode)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
