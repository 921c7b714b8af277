"""Scale to zero and back: what the operator reads from pages, and what a pass decides.

Signals come from `/metrics` pages, read with no credential as for adapters
(adapterstatus.py says why that is the way; `scaletozero_poller.py` does the reading):

- every ready model pod: `sluice_last_request_timestamp_seconds` (unix time of the last
  request the pod admitted, set to the process start when it starts; the newest over its
  label sets) and `sluice_active_streams` (summed). The model is idle when every ready pod
  has admitted nothing for `idleSeconds` and has nothing in flight; a page that cannot be
  read means "not idle" (a model is never scaled down on missing data).
- every ready activator pod: `sluice_activator_held_requests{namespace,model}` (the demand,
  summed over pods) and `sluice_activator_models_known{namespace,model}` (the model is in
  that pod's models.json). A model goes to zero only once every activator pod knows it:
  otherwise the first request after would be answered 404.

The decision (`decide`), made inside the model's converging pass from the workload as
stored and the latest signals:

- workload at 0 and requests held -> scale to 1 (`Step.TO_ONE`);
- at least one replica Ready and idle -> route to the activator, then scale to 0
  (`Step.TO_ZERO`): the route is applied first in the same pass (children before scaling);
- the route names the activator while no replica is Ready (at 0, starting, or just
  idled), and the model's Service again once one is: requests already inside the activator
  finish there.

With `autoscaling.backend: keda`, KEDA owns 0 <-> 1 (minReplicaCount 0, a trigger on the
held gauge, cooldownPeriod = idleSeconds) and the operator never scales: only the route
follows the workload.

Pure: pages come in as text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .models.resource import StreamingModel
from .models.status import ConditionType
from .opmetrics import OperatorMetrics
from .splitstats import VersionStats

LAST_REQUEST = "sluice_last_request_timestamp_seconds"
ACTIVE_STREAMS = "sluice_active_streams"
HELD = "sluice_activator_held_requests"
KNOWN = "sluice_activator_models_known"
# How often the activator pods are read while some model is at zero or activating.
DEMAND_PERIOD_SECONDS = 1.0
# The longest wait between two idle checks of a model (shorter for a short idleSeconds).
IDLE_PERIOD_SECONDS = 10.0

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)", re.M
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name` on a Prometheus text page."""
    out = []
    for m in _SAMPLE.finditer(text):
        if m.group("name") != name:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out.append((dict(_LABEL.findall(m.group("labels") or "")), value))
    return out


def idle_period(model: StreamingModel) -> float:
    zero = model.spec.scale_to_zero
    assert zero is not None
    return min(zero.idle_seconds / 4, IDLE_PERIOD_SECONDS)


def pod_idle_for(text: str | None, now: float) -> float | None:
    """Seconds since the pod last admitted a request, 0.0 while one is in flight; None
    when the page is missing or lacks the gauge (an older server: never idle)."""
    if text is None:
        return None
    last = [v for _, v in samples(text, LAST_REQUEST)]
    if not last:
        return None
    if sum(v for _, v in samples(text, ACTIVE_STREAMS)) > 0:
        return 0.0
    return max(0.0, now - max(last))


def idle_verdict(
    model: StreamingModel, pages: Mapping[str, str | None], now: float
) -> tuple[bool, str]:
    """(idle, why) over the ready pods' pages (pod name -> text, None: unreadable). The
    message stays the same from one check to the next (no status write per check)."""
    zero = model.spec.scale_to_zero
    assert zero is not None
    if not pages:
        return False, "no ready pod to read"
    quiet = []
    for pod, text in sorted(pages.items()):
        seconds = pod_idle_for(text, now)
        if seconds is None:
            return False, f"pod {pod}'s /metrics could not be read (or has no {LAST_REQUEST})"
        if seconds < zero.idle_seconds:
            return False, (f"serving: a request within the last {zero.idle_seconds}s (idleSeconds)")
        quiet.append(seconds)
    return True, f"no request for {zero.idle_seconds}s or more (idleSeconds)"


def _for(labels: Mapping[str, str], key: tuple[str, str]) -> bool:
    return (labels.get("namespace"), labels.get("model")) == key


def held_requests(pages: Iterable[str | None], key: tuple[str, str]) -> int:
    """Requests the activator pods hold for model `key` (namespace, name), summed."""
    return int(sum(v for t in pages if t for labels, v in samples(t, HELD) if _for(labels, key)))


def unaware(pages: Mapping[str, str | None], key: tuple[str, str]) -> list[str]:
    """Activator pods that have not loaded model `key` (or could not be read)."""
    out = []
    for pod, text in sorted(pages.items()):
        known = text is not None and any(
            _for(labels, key) and v >= 1 for labels, v in samples(text, KNOWN)
        )
        if not known:
            out.append(pod)
    return out


@dataclass(frozen=True)
class Signals:
    """What the poller last saw for one model (`scaletozero_poller.py`); the pass decides on it."""

    idle: bool = False  # every ready pod idle for idleSeconds, every activator pod knows it
    held: int = 0  # requests held by the activator pods now
    why: str = ""  # why not idle, or since when idle (the ScaledToZero condition's message)


@dataclass(frozen=True)
class ZeroContext:
    """What a pass needs from the operator for scale to zero and the router: where the
    activator answers (the ExternalName's target), whether it runs at all (`router`: the
    chart's activator.enabled, seen as `run --activator-service`), the poller's latest
    signals per (namespace, name), the operator's metrics (opmetrics.py), which count
    what the pass does, and the numbers of a split's versions over the poller's last window
    (status.split)."""

    activator_host: str
    router: bool = True
    signals: Callable[[tuple[str, str]], Signals] = lambda key: Signals()
    metrics: OperatorMetrics | None = None
    split_stats: Callable[[tuple[str, str]], VersionStats | None] = lambda key: None


class Step(StrEnum):
    NONE = "none"
    TO_ZERO = "to-zero"
    TO_ONE = "to-one"


def workload_replicas(workload: Mapping[str, Any] | None) -> tuple[int, int]:
    """(spec.replicas, status.readyReplicas) of the Deployment or LeaderWorkerSet."""
    if workload is None:
        return 1, 0
    replicas = (workload.get("spec") or {}).get("replicas")
    ready = (workload.get("status") or {}).get("readyReplicas") or 0
    return (1 if replicas is None else int(replicas)), int(ready)


def decide(
    model: StreamingModel, workload: Mapping[str, Any] | None, signals: Signals
) -> tuple[bool, Step]:
    """(route via the activator, the scaling step) for this pass."""
    if model.spec.scale_to_zero is None:
        return False, Step.NONE
    replicas, ready = workload_replicas(workload)
    keda = model.spec.autoscaling_backend == "keda"
    if workload is None or keda:
        return replicas == 0 or ready == 0, Step.NONE
    if replicas == 0:
        return True, Step.TO_ONE if signals.held > 0 else Step.NONE
    if ready == 0:
        return True, Step.NONE  # starting: the activator holds until a replica is Ready
    if signals.idle:
        return True, Step.TO_ZERO
    return False, Step.NONE


def with_replicas(workload: Mapping[str, Any], replicas: int, resource_version: Any) -> dict:
    """The workload as stored after a scale (the scale subresource answers a Scale, whose
    resourceVersion is the workload's)."""
    out = dict(workload)
    out["spec"] = {**(workload.get("spec") or {}), "replicas": replicas}
    meta = dict(workload.get("metadata") or {})
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    out["metadata"] = meta
    return out


ZERO_CONDITION: ConditionType = "ScaledToZero"


def zero_status(
    model: StreamingModel,
    workload: Mapping[str, Any] | None,
    signals: Signals,
    via_activator: bool,
) -> tuple[str | None, str | None, dict[str, str], int]:
    """(phase, message, condition ScaledToZero, held) for a model with minReplicas 0; the
    phase and message are None where the usual ones stand (serving, or starting with no
    request held)."""
    replicas, ready = workload_replicas(workload)
    zero = model.spec.scale_to_zero
    assert zero is not None
    held = signals.held
    if workload is not None and replicas == 0:
        message = (
            "scaled to zero: the activator holds the next request while a replica starts "
            "(the first request waits for the model to load)"
        )
        if held:
            message = f"{held} request(s) held by the activator; scaling to 1"
            return "Activating", message, _cond(True, "Activating", message), held
        return "ScaledToZero", message, _cond(True, "Idle", message), held
    if via_activator and held:
        message = f"{held} request(s) held by the activator while a replica starts ({ready}/{replicas} ready)"
        return "Activating", message, _cond(False, "Activating", message), held
    if via_activator:
        message = "no Ready replica yet: the route goes through the activator"
        return None, None, _cond(False, "Starting", message), held
    why = signals.why or f"serving; scales to zero after {zero.idle_seconds}s without a request"
    return None, None, _cond(False, "Serving", why), held


def _cond(ok: bool, reason: str, message: str) -> dict[str, str]:
    return {
        "type": ZERO_CONDITION,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }
