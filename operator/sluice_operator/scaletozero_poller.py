"""The scale-to-zero poller: reads the pages the decision needs and keeps the activator's
ConfigMap; a converging pass acts on what it found (scaletozero.py says what and why).

One background thread (like the resync) of the leader, acting only while some model has
autoscaling.minReplicas 0 or the router:

- keeps `<activator>-models` (key models.json) in the operator's namespace equal to the
  models with minReplicas 0 or the router (spec.routing.router), applied when its content
  changes (the activator's allowlist);
- about every second while a model is at zero, activating or found idle (about to go to
  zero), reads the ready activator pods' /metrics (found by label in the operator's
  namespace): held requests per model, and which models each pod has loaded;
- every min(idleSeconds / 4, 10 s) per serving model, reads its ready pods' /metrics: the
  newest admission and what is in flight;
- when a model's signals change, asks for a pass over it (`wake`), which scales and
  switches the route under the model's lock;
- for each owner of a split (spec.routing.router.split, builders/split.py), every
  SPLIT_WINDOW_SECONDS reads the ready pods' /metrics of the owner and its versions and
  keeps each version's numbers over the window (splitstats.py, for status.split); it asks
  for a pass over the owner when they or the checks of its versions change (a version
  created, deleted or edited), so condition TrafficSplit follows the versions within a
  round.

Without an activator (`run --activator-service` unset) nothing is polled and no model is
ever idle: scaling to zero with nothing to wake it would strand the model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .adapterstatus import ready
from .builders.activator import (
    activator_host_of,
    desired_models_config_map,
    in_activator,
    model_key,
)
from .builders.leaderworkerset import leader_selector
from .builders.split import check_versions
from .cluster import Cluster
from .cluster_view import ClusterView
from .kinds import DEPLOYMENT, LWS_KIND
from .models.resource import DEFAULT_ACTIVATOR_HOST, OperatorDefaults, StreamingModel
from .opmetrics import OperatorMetrics
from .scaletozero import (
    DEMAND_PERIOD_SECONDS,
    IDLE_PERIOD_SECONDS,
    Signals,
    ZeroContext,
    held_requests,
    idle_period,
    idle_verdict,
    unaware,
    workload_replicas,
)
from .splitstats import Reading, VersionStats, reading, window
from .validation import SpecError, load_model

log = logging.getLogger("sluice_operator.scaletozero_poller")

PageReader = Callable[[Mapping[str, Any]], str | None]

# The window of status.split's numbers: long enough to hold a few requests of a quiet
# version, short enough that a promotion's effect shows within a minute.
SPLIT_WINDOW_SECONDS = 15.0


@dataclass(frozen=True)
class ActivatorSettings:
    """Where the activator runs (`run --activator-*`, set by the operator chart)."""

    service: str  # its Service, also the prefix of the ConfigMap `<service>-models`
    namespace: str  # the operator's namespace
    selector: str  # label selector of its pods

    @property
    def host(self) -> str:
        return activator_host_of(self.service, self.namespace)


class ScaleToZeroPoller:
    def __init__(
        self,
        cluster: Cluster,
        memory: ClusterView,
        activator: ActivatorSettings | None,
        wake: Callable[[list[tuple[str, str]]], None],
        page: PageReader,
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        metrics: OperatorMetrics | None = None,
        defaults: Callable[[], OperatorDefaults] = OperatorDefaults,
    ) -> None:
        self.cluster, self.memory, self.activator = cluster, memory, activator
        self.metrics = metrics
        # The operator's configuration as of now (the continuation key, read each round:
        # a router model's entry says whether its streams migrate).
        self.defaults = defaults
        self.wake, self.page, self.leading, self.clock = wake, page, leading, clock
        self._signals: dict[tuple[str, str], Signals] = {}
        self._checked: dict[tuple[str, str], float] = {}  # last idle check per model
        self._written: str | None = None  # models.json as last applied
        # (namespace, name) -> (uid, generation, the parsed model or None): a spec is parsed
        # once per generation, not every round.
        self._parsed: dict[tuple[str, str], tuple[Any, Any, StreamingModel | None]] = {}
        # Splits: per version (namespace, name), its pods' last reading and when it was
        # taken, and its numbers over the last window; per owner, the checks last seen.
        self._readings: dict[tuple[str, str], tuple[float, dict[str, Reading]]] = {}
        self._stats: dict[tuple[str, str], VersionStats] = {}
        self._checks: dict[tuple[str, str], Any] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sluice-scale-to-zero", daemon=True)
        self.rounds = 0

    def context(self) -> ZeroContext:
        host = self.activator.host if self.activator else DEFAULT_ACTIVATOR_HOST
        return ZeroContext(
            activator_host=host,
            router=self.activator is not None,
            signals=self.signals,
            metrics=self.metrics,
            split_stats=self.split_stats,
        )

    def signals(self, key: tuple[str, str]) -> Signals:
        with self._guard:
            return self._signals.get(key, Signals())

    def split_stats(self, key: tuple[str, str]) -> VersionStats | None:
        """A version's numbers over the last window; None before two reads."""
        with self._guard:
            return self._stats.get(key)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                delay = self.run_once() if self.leading() else IDLE_PERIOD_SECONDS
            except Exception:  # a bug in one round must not end the later ones
                log.exception("scale-to-zero round failed")
                delay = IDLE_PERIOD_SECONDS
            self._stop.wait(delay)

    def _models(self) -> list[StreamingModel]:
        """Every model with a valid spec (the checks of a split look at all of them)."""
        out, seen = [], set()
        defaults = self.defaults()
        for namespace, name in self.memory.models():
            body = self.memory.model(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                continue
            key, meta = (namespace, name), body["metadata"]
            seen.add(key)
            cached = self._parsed.get(key)
            if cached is None or cached[:2] != (meta.get("uid"), meta.get("generation")):
                try:
                    parsed: StreamingModel | None = load_model(body)
                except SpecError:
                    parsed = None
                cached = self._parsed[key] = (meta.get("uid"), meta.get("generation"), parsed)
            model = cached[2]
            if model is not None:
                out.append(dataclasses.replace(model, defaults=defaults))
        for key in [k for k in self._parsed if k not in seen]:
            del self._parsed[key]
        return out

    def _workload(self, model: StreamingModel) -> dict[str, Any] | None:
        if model.multi_node:
            kind = LWS_KIND
            return self.cluster.get(kind.api_version, kind.kind, model.namespace, model.name)
        return self.memory.get(DEPLOYMENT, model.namespace, model.name)

    def _keep_config_map(self, models: list[StreamingModel]) -> None:
        assert self.activator is not None
        a = self.activator
        manifest = desired_models_config_map(a.service, a.namespace, models)
        data = manifest["data"]["models.json"]
        if data != self._written:
            self.cluster.apply(manifest)
            self._written = data
            known = sum(1 for m in models if in_activator(m))
            log.info(f"activator models: {known} with minReplicas 0 or the router")

    def _activator_pages(self) -> dict[str, str | None]:
        assert self.activator is not None
        pods = self.cluster.list_pods(self.activator.namespace, self.activator.selector)
        return {(p.get("metadata") or {}).get("name", "?"): self.page(p) for p in pods if ready(p)}

    def _model_pages(self, model: StreamingModel) -> dict[str, str | None]:
        want = leader_selector(model)
        out = {}
        for pod in self.memory.pods(model.namespace, model.name):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if ready(pod) and all(labels.get(k) == v for k, v in want.items()):
                out[(pod.get("metadata") or {}).get("name", "?")] = self.page(pod)
        return out

    def run_once(self) -> float:
        """One round; returns the seconds until the next."""
        self.rounds += 1
        everything = self._models()
        listed = [m for m in everything if in_activator(m)]
        if self.activator is not None:
            self._keep_config_map(everything)  # also when the last such model went: {}
        # Without the router no split applies: nothing to measure.
        split_delay = (
            self._splits(everything) if self.activator is not None else IDLE_PERIOD_SECONDS
        )
        models = [m for m in listed if m.spec.scale_to_zero is not None]
        if self.activator is None or not models:
            with self._guard:
                self._signals.clear()
            return min(IDLE_PERIOD_SECONDS, split_delay)
        activators = self._activator_pages()
        now = self.clock()
        changed, delay = [], IDLE_PERIOD_SECONDS
        for model in models:
            key = (model.namespace, model.name)
            old = self.signals(key)
            held = held_requests(activators.values(), key)
            replicas, ready_replicas = workload_replicas(self._workload(model))
            idle, why = old.idle, old.why
            if replicas == 0 or ready_replicas == 0:
                idle, why = False, ""
                delay = DEMAND_PERIOD_SECONDS
            elif now - self._checked.get(key, 0.0) >= idle_period(model):
                self._checked[key] = now
                idle, why = idle_verdict(model, self._model_pages(model), now)
                missing = unaware(activators, key) if activators else ["(no ready activator pod)"]
                if idle and missing:
                    idle = False
                    why = (
                        f"idle, but the activator has not loaded {model_key(model)} yet "
                        f"({', '.join(missing[:3])}): staying up"
                    )
            # Idle: the pass this wakes scales it to zero, and the next request may come at
            # once; waiting a whole idle period to look for it would add that to its start.
            delay = min(delay, DEMAND_PERIOD_SECONDS if idle else idle_period(model))
            new = Signals(idle=idle, held=held, why=why)
            if new != old:
                with self._guard:
                    self._signals[key] = new
                changed.append(key)
        known = {(m.namespace, m.name) for m in models}
        with self._guard:
            for key in [k for k in self._signals if k not in known]:
                del self._signals[key]
        for key in [k for k in self._checked if k not in known]:
            del self._checked[key]
        if changed:
            self.wake(changed)
        return min(delay, split_delay)

    def _pod_readings(self, namespace: str, name: str) -> dict[str, Reading]:
        out = {}
        for pod in self.memory.pods(namespace, name):
            if not ready(pod):
                continue
            page = self.page(pod)
            if page is not None:
                out[(pod.get("metadata") or {}).get("name", "?")] = reading(page)
        return out

    def _splits(self, models: list[StreamingModel]) -> float:
        """Status.split's numbers and the versions' checks of every owner of a split; wakes
        an owner when either changed. Returns the seconds until its next window."""
        owners = [m for m in models if m.routed and m.spec.routing.router.split]
        by_namespace: dict[str, dict[str, StreamingModel | None]] = {}
        for m in models:
            by_namespace.setdefault(m.namespace, {})[m.name] = m
        now = self.clock()
        wanted: set[tuple[str, str]] = set()
        changed, delay = [], IDLE_PERIOD_SECONDS
        for owner in owners:
            key = (owner.namespace, owner.name)
            versions = [key, *((owner.namespace, v.model) for v in owner.spec.routing.router.split)]
            wanted.update(versions)
            checks = check_versions(owner, by_namespace[owner.namespace])
            moved = self._checks.get(key) != checks
            self._checks[key] = checks
            for version in versions:
                taken, before = self._readings.get(version, (0.0, {}))
                if now - taken < SPLIT_WINDOW_SECONDS:
                    delay = min(delay, taken + SPLIT_WINDOW_SECONDS - now)
                    continue
                delay = min(delay, SPLIT_WINDOW_SECONDS)
                after = self._pod_readings(*version)
                stats = window(before, after, now - taken) if before else None
                self._readings[version] = (now, after)
                if stats is not None:
                    with self._guard:
                        moved = moved or self._stats.get(version) != stats
                        self._stats[version] = stats
            if moved:
                changed.append(key)
        for gone in [k for k in self._readings if k not in wanted]:
            del self._readings[gone]
        with self._guard:
            for gone in [k for k in self._stats if k not in wanted]:
                del self._stats[gone]
        for gone in [k for k in self._checks if k not in {(o.namespace, o.name) for o in owners}]:
            del self._checks[gone]
        if changed:
            self.wake(changed)
        return max(delay, DEMAND_PERIOD_SECONDS)
