"""Rollout pacing: an operator release that changes pod templates rolls a few models at a time.

When a new operator release renders a different pod template for models nobody changed (a
new default flag, a probe), applying it everywhere at once would restart every model of the
fleet together: a burst of GPU demand and of model loading nobody asked for. So such a
change is *operator-caused* and paced: at most `--max-concurrent-model-rollouts` models roll
at a time, each holding its slot until its new pods are Ready; the others keep their old
pods, say so in their status (condition `TemplateCurrent=False`, reason
`WaitingForRolloutSlot`) and get one `RolloutWaiting` Event, and are converged again as soon
as a slot frees (first come, first served).

The workload is the model's Deployment, or its LeaderWorkerSet with
`spec.parallelism.nodes > 1`, whose pod templates are `spec.leaderWorkerTemplate` (leader and
worker, rolled by the LWS group by group); everything below holds for both, read from the
same status fields (`spec.replicas`, `status.observedGeneration`, `updatedReplicas`,
`readyReplicas`, `replicas`: groups for an LWS).

How a template change is told apart: every Deployment carries the label
`serving.sluice.dev/template-hash`, a hash of the pod template the operator applied, and the
model's `status.observedGeneration` is the `metadata.generation` the operator last converged
(it is written only after every child was applied for it). A desired template whose hash
differs from the live one is
- *spec-caused* when the model's generation moved past `observedGeneration` (the user
  changed the model, or the status is gone): applied at once, never held back, no slot;
- *operator-caused* when the generation is the one last converged: the model is unchanged,
  so the difference comes from the operator's release: paced, unless the workload has no
  Ready replica (`serving`): nothing serves that a slot would protect, and a model that
  cannot become Ready (a missing claim, no free GPU) would hold its slot for good and stall
  every other model's rollout. Such a model rolls at once and takes no slot.
A Deployment written by a release without the annotation is compared by its template
instead (every field the operator sets still has that value; a field a release stops
setting is not seen this way, only on later upgrades). A paced Deployment also carries the
label `serving.sluice.dev/paced-rollout` (the template hash it rolls to), so a new leader
counts the rollouts still under way from memory. Labels, not annotations: a Deployment's
annotations are copied to its ReplicaSets, so changing one bumps its `generation`; a label
does not. Neither label changes unless the template does, and neither enters the applied
manifest's hash (`reconcile`'s `applied-hash` annotation), so the upgrade that first adds
them rewrites no annotation and moves no generation.

The operator watches Deployments, so memory shows every one of them; it does not watch
LeaderWorkerSets (their CRD is optional, `kinds.LEADER_WORKER_SET`), so the pacer keeps the
last LWS each pass of a model read (`admit`, `observe`), while that LWS holds a claim or is
rolling: a new leader counts the LWS rollouts still under way once a pass read them (its
first resync round reads every model).

Pure: no kopf, no API client; memory and the workloads' status come in from the caller.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .status_from_cluster import deployment_settled

TEMPLATE_HASH = "serving.sluice.dev/template-hash"
PACED = "serving.sluice.dev/paced-rollout"

Key = tuple[str, str]  # (namespace, model name)
Cause = Literal["none", "spec", "operator"]


def pod_templates(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the workload's pods are made from: a Deployment's `spec.template`, a
    LeaderWorkerSet's `spec.leaderWorkerTemplate` (leader and worker templates, group size,
    restart policy: a change to any of it makes the LWS roll its groups)."""
    spec = workload.get("spec") or {}
    if "leaderWorkerTemplate" in spec:
        return spec["leaderWorkerTemplate"] or {}
    return spec.get("template") or {}


def template_hash(workload: Mapping[str, Any]) -> str:
    template = pod_templates(workload)
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:20]


def _labels(obj: Mapping[str, Any] | None) -> Mapping[str, str]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


def stamp(manifest: dict[str, Any], paced: bool) -> dict[str, Any]:
    """The Deployment manifest with the labels pacing reads back."""
    labels = manifest["metadata"].setdefault("labels", {})
    digest = template_hash(manifest)
    labels[TEMPLATE_HASH] = digest
    if paced:
        labels[PACED] = digest
    return manifest


def cause_of_change(
    desired: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    generation: int | None,
    observed_generation: int | None,
    template_contained: bool,
) -> Cause:
    """Why the pod template would change: not at all, the model's spec, or the operator.

    `template_contained`: every field of the desired template is in the live one (the check
    for Deployments from releases that wrote no template hash)."""
    if live is None:
        return "none"  # a new Deployment: nothing restarts
    have = _labels(live).get(TEMPLATE_HASH)
    changed = have != template_hash(desired) if have else not template_contained
    if not changed:
        return "none"
    if generation is None or observed_generation is None or observed_generation != generation:
        return "spec"
    return "operator"


def serving(workload: Mapping[str, Any] | None) -> bool:
    """Whether the workload has a Ready replica now (a LeaderWorkerSet: a Ready group)."""
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0) > 0


def rolling(deployment: Mapping[str, Any] | None) -> bool:
    """A paced rollout under way: the Deployment rolls to the template pacing let through,
    and its new pods are not all Ready yet."""
    if deployment is None:
        return False
    labels = _labels(deployment)
    paced = labels.get(PACED)
    return bool(paced) and paced == labels.get(TEMPLATE_HASH) and not deployment_settled(deployment)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    rolling: tuple[Key, ...]  # the paced rollouts under way (including this one if admitted)
    ahead: int = 0  # models waiting before this one

    def message(self, limit: int) -> str:
        now = ", ".join(f"{ns}/{n}" for ns, n in self.rolling[:5]) or "none"
        more = f" and {len(self.rolling) - 5} more" if len(self.rolling) > 5 else ""
        return (
            "the operator's release changes this model's pod template; models roll "
            f"{limit} at a time (operator.maxConcurrentModelRollouts), each until its new pods "
            f"are Ready; rolling now: {now}{more}; {self.ahead} model(s) ahead of this one. "
            "The old pods keep serving; a change to this model's spec rolls it at once"
        )


class RolloutPacer:
    """At most `limit` operator-caused rollouts at a time, in this process (the leader).

    A rollout is counted from when it is admitted (a claim, before the write is sent) until
    memory (for an LWS: the model's last pass) shows its workload settled on the new
    template, and also whenever it shows a paced workload not settled (rollouts a previous
    leader started). An LWS is read by its model's passes only, which its pods' events and
    the resync start: its slot may stay taken until the first pass after the LWS's status
    says its groups are Ready (at the latest the next resync round). Waiting models
    queue in arrival order; when a slot frees, `wake` is called with the next ones (the
    handlers converge them at once). Thread-safe; the tables hold only models that need a
    paced rollout now.
    """

    def __init__(
        self,
        limit: int,
        deployments: Callable[[], Iterable[tuple[Key, Mapping[str, Any] | None]]],
        wake: Callable[[list[Key]], None] = lambda keys: None,
        models: Callable[[], Iterable[Key]] | None = None,
    ) -> None:
        self.limit = limit
        self._deployments = deployments  # every model's Deployment, as memory has it
        self._wake = wake
        self._models = models  # every model memory knows (None: keep what passes read)
        self._guard = threading.Lock()
        # admitted model -> (template hash it rolls to, template hash it had when admitted)
        self._claims: dict[Key, tuple[str, str | None]] = {}
        self._waiting: list[Key] = []
        # The workload a pass last read, for kinds memory does not hold (LeaderWorkerSets):
        # only while it holds a claim or rolls.
        self._read: dict[Key, Mapping[str, Any]] = {}

    @property
    def waiting(self) -> list[Key]:
        with self._guard:
            return list(self._waiting)

    def _workloads(self) -> dict[Key, Mapping[str, Any] | None]:
        """The cluster view's Deployments, and where it has none, the workload a pass read."""
        seen = dict(self._deployments())
        if self._models is not None:
            known = set(self._models())
            for key in [k for k in self._read if k not in known]:
                del self._read[key]  # the model is gone
        for key, workload in self._read.items():
            if seen.get(key) is None:
                seen[key] = workload
        return seen

    def _remember(self, key: Key, workload: Mapping[str, Any] | None) -> None:
        if workload is not None and (key in self._claims or rolling(workload)):
            self._read[key] = workload
        else:
            self._read.pop(key, None)

    def _in_flight(self) -> list[Key]:
        seen = self._workloads()
        for key, (new, old) in list(self._claims.items()):
            dep = seen.get(key)
            live = _labels(dep).get(TEMPLATE_HASH)
            if dep is None or (live == new and deployment_settled(dep)) or live not in (new, old):
                # Gone, rolled out and Ready, or changed since by a spec change.
                del self._claims[key]
        flying = {k for k, dep in seen.items() if rolling(dep)} | set(self._claims)
        return sorted(flying)

    def admit(
        self, key: Key, new: str, old: str | None, live: Mapping[str, Any] | None = None
    ) -> Decision:
        """May `key` roll from template `old` to `new` now? Always when `limit` is 0.
        `live`: the workload as the pass read it (kept for kinds memory does not hold)."""
        with self._guard:
            if live is not None:
                self._read[key] = live
            if self.limit <= 0 or (key in self._claims and self._claims[key][0] == new):
                self._claims[key] = (new, old)
                return Decision(True, tuple(self._in_flight()))
            flying = [k for k in self._in_flight() if k != key]
            if key not in self._waiting:
                self._waiting.append(key)
            position = self._waiting.index(key)
            if position < self.limit - len(flying):
                self._waiting.remove(key)
                self._claims[key] = (new, old)
                return Decision(True, tuple(sorted({*flying, key})))
            return Decision(False, tuple(flying), ahead=position)

    def forget(self, key: Key) -> None:
        """`key` needs no paced rollout any more (its spec changed, or it is gone)."""
        with self._guard:
            if key in self._waiting:
                self._waiting.remove(key)

    def observe(self, key: Key, deployment: Mapping[str, Any] | None) -> None:
        """After a pass of `key` (`deployment`: its workload as the pass left it): when a
        paced rollout ended, wake the next waiting models."""
        with self._guard:
            self._remember(key, deployment)
            if not self._waiting:
                return
            paced = key in self._claims or bool(_labels(deployment).get(PACED))
            if not paced or rolling(deployment):
                return
            free = self.limit - len(self._in_flight())
            wake = self._waiting[: max(free, 0)]
        if wake:
            self._wake(wake)
