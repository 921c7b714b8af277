"""The activator's metrics: demand (held requests), outcomes, hold time, and which models
this pod has loaded (what the operator reads before it scales a model to zero).

- `sluice_activator_models_known{namespace,model}` 1 per entry of the models file now loaded
  (an entry removed from the file loses its series);
- `sluice_activator_held_requests{namespace,model}`: requests waiting for a ready replica
  now (the scale-up signal: the operator, or KEDA's prometheus trigger, reads it);
- `sluice_activator_requests_total{namespace,model,outcome}`: `forwarded` (a replica was
  ready and the request went to it), `timeout` (past the hold timeout), `rejected` (past
  `maxHeld`: 429; a body over `--max-body-bytes`: 413; a bad `X-Sluice-Session`: 400),
  `disconnected` (the client left while held);
- `sluice_activator_hold_seconds{namespace,model}`: arrival to forwarded or given up;
- `sluice_activator_unknown_model_total`: requests for no model in the file (404);
- `sluice_activator_models_reloads_total{result}`: models-file reloads, `ok` or `error`.

Placement, for the models with `pods` (podview.py):

- `sluice_router_picks_total{namespace,model,by}`: requests sent to a pod, by what decided
  the pod: `prefix` (it holds some of the request's leading blocks), `load` (no pod held
  any, or the prompt's blocks were unknown), `pin` (a `sluice-pin` cookie), `round-robin`
  (the model's `balance`: each pod in turn) or `follow` (a token stream's continuation,
  and a resume whose pinned pod is gone: the pod that ranks highest for the stream's id);
- `sluice_router_kv_feeds_live{namespace,model}`: pods whose KV-event feed is live now
  (their precise index in use);
- `sluice_router_load_scrapes_total{namespace,model,result}`: reads of the pods' /metrics:
  `ok`, `missing` (no load metric on the page) or `error` (no answer in time, not 200);
- `sluice_router_prefix_hasher_ready{namespace,model}`: 1 while the router can hash the
  model's prompts as its engine does (hashers.py: a pod's description read and usable), 0
  while it places by load alone;
- `sluice_router_prefix_hasher_fetch_failures_total{namespace,model,reason}`: failed
  reads of a pod's prefix-cache description or tokenizer files: `unreachable`, `status`,
  `invalid`, `storage` (hashers.py `failure_reason`).

Streams continued on another pod when theirs broke (models with `migration`, migration.py):

- `sluice_router_migrations_total{namespace,model,result}`: broken upstream streams, by
  what became of them: `continued` (another pod goes on with it), `refused` (the pod asked
  to continue refused: the protocol's error event with its message), `exhausted` (the
  stream was moved `maxMigrations` times already), `unavailable` (no other pod took it
  within the hold timeout), `unmarked` (nothing the client received could be placed: the
  protocol's error event);
- `sluice_router_migration_gap_seconds{namespace,model}`: the seam's added gap, from the
  last byte of the broken stream (or the moment a stalled one was given up) to the first
  byte of its continuation.

Versions sharing a model's traffic (models with `split`, split.py):

- `sluice_router_split_picks_total{namespace,model,version,by}`: conversations' requests
  that named the owner `model`, by the version chosen (its model name; the owner's own when
  the chosen version is not in the models file) and by what keyed the conversation:
  `header` (`X-Sluice-Session`), `user` (the body's `user` or `metadata.user_id`) or
  `fallback` (the credential and the first turn; a WebSocket without either goes to the
  owner). A `Last-Event-ID` resume goes back to the version its `sluice-pin` names and is
  not counted.

No series has a pod label: pods come and go with every rollout, the series would not.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest

from ..core.telemetry.families import Families
from .models import Models

# What became of a held request: the `outcome` label of sluice_activator_requests_total.
Outcome = Literal["forwarded", "timeout", "rejected", "disconnected"]
# 10 ms .. 30 min: a warm replica answers at once, a cold GPU node takes minutes.
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 240,
                300, 450, 600, 900, 1200, 1800)  # fmt: skip
# 5 ms .. 10 min: a killed pod's streams move at once, a silent one after its stall timeout.
GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300,
               600)  # fmt: skip


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        fam = Families(self.registry)
        labels = ("namespace", "model")
        self.known = fam.gauge(
            "sluice_activator_models_known",
            "1 for each model in the models file this activator has loaded.",
            labels,
        )
        self.held = fam.gauge(
            "sluice_activator_held_requests",
            "Requests waiting for a ready replica of their model now.",
            labels,
        )
        self.requests = fam.counter(
            "sluice_activator_requests",
            "Requests for a known model, by how their hold ended.",
            (*labels, "outcome"),
        )
        self.hold = fam.histogram(
            "sluice_activator_hold_seconds",
            "Arrival to forwarded (or given up) of held requests.",
            labels,
            buckets=HOLD_BUCKETS,
        )
        self.unknown = fam.counter(
            "sluice_activator_unknown_model",
            "Requests naming no model in the models file (404).",
        )
        self.reloads = fam.counter(
            "sluice_activator_models_reloads",
            "Models-file reloads by result (ok, error).",
            ("result",),
        )
        self.picks = fam.counter(
            "sluice_router_picks",
            "Requests sent to a pod, by what decided the pod (prefix, load, pin, round-robin).",
            (*labels, "by"),
        )
        self.kv_feeds = fam.gauge(
            "sluice_router_kv_feeds_live",
            "Pods of the model whose KV-event feed is live now.",
            labels,
        )
        self.scrapes = fam.counter(
            "sluice_router_load_scrapes",
            "Reads of the pods' /metrics for their load, by result (ok, missing, error).",
            (*labels, "result"),
        )
        self.hasher_ready = fam.gauge(
            "sluice_router_prefix_hasher_ready",
            "1 while the router hashes the model's prompts as its engine does, else 0.",
            labels,
        )
        self.hasher_failures = fam.counter(
            "sluice_router_prefix_hasher_fetch_failures",
            "Failed reads of a pod's prefix-cache description or tokenizer files, by reason "
            "(unreachable, status, invalid, storage).",
            (*labels, "reason"),
        )
        self.migrations = fam.counter(
            "sluice_router_migrations",
            "Broken upstream streams, by what became of them (continued, refused, exhausted, "
            "unavailable, unmarked).",
            (*labels, "result"),
        )
        self.migration_gap = fam.histogram(
            "sluice_router_migration_gap_seconds",
            "The seam's added gap: the broken stream's last byte to its continuation's first.",
            labels,
            buckets=GAP_BUCKETS,
        )
        self.split_picks = fam.counter(
            "sluice_router_split_picks",
            "Requests naming a model with versions, by the version chosen and by what keyed "
            "the conversation (header, user, fallback).",
            (*labels, "version", "by"),
        )
        self._known: set[tuple[str, str]] = set()

    def loaded(self, models: Models) -> None:
        """The series of `models_known` (and zeroed held gauges) for what is loaded now."""
        now = {(m.namespace, m.name) for m in models.by_key.values()}
        for gone in self._known - now:
            self.known.remove(*gone)
            self.kv_feeds.remove(*gone)  # a no-op for a model without `pods`
            self.hasher_ready.remove(*gone)
        for labels in now:
            self.known.labels(*labels).set(1)
            self.held.labels(*labels)  # a 0 series from the start: demand reads as 0, not absent
        self._known = now

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
