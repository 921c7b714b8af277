"""The operator's own Prometheus metrics (`run --metrics-port`): scale to zero's transitions
and how long each activation took.

What the activator cannot see is counted here: the activator knows how long each request
waited, the operator knows when it scaled a model and when the model was serving again.

- `sluice_operator_scale_to_zero_transitions_total{namespace, model, to}`: `zero` (idle:
  the workload scaled to 0) and `one` (an activation: requests were held, scaled to 1);
- `sluice_operator_activation_seconds{namespace, model}`: from an activation's scale to 1 to
  the pass that found a replica Ready and routed the model back to its Service (the replica
  start, which bounds a held request's time to first token). Kept in memory: an activation
  under way when the operator restarts is not observed.

Neither kopf nor the Kubernetes client: a registry and two collectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds: a small model on a warm node starts in seconds, a 70B one in many minutes.
ACTIVATION_BUCKETS = (
    1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1200, 1800, 3600,
)  # fmt: skip


class OperatorMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.clock = clock
        self.transitions = Counter(
            "sluice_operator_scale_to_zero_transitions",
            "Scale-to-zero steps the operator took, by target: zero (idle), one (activation).",
            ("namespace", "model", "to"),
            registry=self.registry,
        )
        self.activation = Histogram(
            "sluice_operator_activation_seconds",
            "An activation's scale to 1 until a Ready replica took the route back.",
            ("namespace", "model"),
            buckets=ACTIVATION_BUCKETS,
            registry=self.registry,
        )
        self._guard = threading.Lock()
        self._since: dict[tuple[str, str], float] = {}  # activations under way

    def scaled(self, key: tuple[str, str], replicas: int) -> None:
        self.transitions.labels(*key, "zero" if replicas == 0 else "one").inc()
        with self._guard:
            if replicas == 0:
                self._since.pop(key, None)
            else:
                self._since[key] = self.clock()

    def serving(self, key: tuple[str, str]) -> None:
        """The model is routed to its Service again: an activation under way is done."""
        with self._guard:
            since = self._since.pop(key, None)
        if since is not None:
            self.activation.labels(*key).observe(self.clock() - since)
