"""One converging pass: desired children vs live, apply only what drifted, then status.

Called by every handler (create, update, resume, child changed, resync). The model, its
watched children and pods are read from `reads`: in the operator the memory its watches
fill (`cluster_view.ClusterView`), so a pass makes write calls only, and a pass over an object whose
children match and whose status is current makes no call at all. Every write's result is
handed back to `reads`, so the next pass starts from what this one wrote. Children are compared by (a) a hash of the last applied manifest, kept in
an annotation, which catches spec changes including removed fields, and (b) "every field we
set still has our value", which catches hand edits, since the API server adds defaults we
must not fight over.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from .adapterstatus import adapters_status, ready, settling
from .builders.common import HASH_ANNOTATION
from .builders.continuation import MIGRATION_CONDITION, migration_verdict
from .builders.gateway import (
    SESSION_PERSISTENCE_DROPPED,
    schema_lacks_session_persistence,
    session_persistence_dropped,
    without_session_persistence,
)
from .builders.keda import keda_hpa_name
from .builders.split import check_versions, owner_weight, split_condition
from .builders.weights import (
    cache_of,
    desired_fetch_job,
    desired_remove_job,
    desired_weights_claim,
    fetch_job_name,
    repo_and_revision,
)
from .cluster import Cluster, LiveReads
from .cluster_view import ClusterView
from .kinds import (
    CHILD_KINDS,
    CONTINUATION_SECRET,
    DECODE_DEPLOYMENT,
    DECODE_HPA,
    DEPLOYMENT,
    HPA,
    INGRESS,
    JOB,
    LWS_KIND,
    OPTIONAL_KINDS,
    PERSISTENT_VOLUME_CLAIM,
    PREFILL_DEPLOYMENT,
    PREFILL_HPA,
    WATCHED_KINDS,
    Kind,
    OptionalKind,
    Unavailable,
    desired_children,
)
from .models import GROUP, KIND, VERSION
from .models.resource import OperatorDefaults, StreamingModel
from .pacing import (
    PACED,
    TEMPLATE_HASH,
    RolloutPacer,
    cause_of_change,
    pod_templates,
    serving,
    stamp,
    template_hash,
)
from .scaletozero import Signals, Step, ZeroContext, decide, with_replicas, zero_status
from .status_from_cluster import (
    combined_workload,
    compute_status,
    deployment_settled,
    invalid_status,
    key_forbidden,
    migrated,
    remembered,
    reported,
    status_patch,
    was_waiting,
    with_condition,
    with_template_wait,
)
from .validation import SpecError, load_model
from .weightsstate import JobView, WeightsVerdict, weights_users, weights_verdict

log = logging.getLogger("sluice_operator.reconcile")

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)
# What `compute_status` is told when the continuation key's Secret was refused (the
# condition's message is the builder's).
FORBIDDEN = Unavailable("Forbidden", "")


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    phase: str | None = None
    # An adapter is still loading on some pod: look again soon (passes.py retries).
    adapters_settling: bool = False
    # The LeaderWorkerSet's groups are not all updated and Ready. Its status is not watched
    # (the LWS kind is optional), so nothing else would show the change: look again soon.
    workload_settling: bool = False
    # A weights download runs (or its claim is missing): its Job is not watched, so look
    # again soon for its progress and its end (weightsstate.py).
    weights_settling: bool = False


PodMetrics = Callable[[Mapping[str, Any]], str | None]  # a pod's /metrics page, or None
# A weights download pod's GET /progress, or None.
WeightsProgress = Callable[[Mapping[str, Any]], Mapping[str, Any] | None]


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]


def _same_scalar(want: Any, have: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have  # True == 1 in Python, not in Kubernetes
    if want == have:
        return True
    if isinstance(want, int | float | str) and isinstance(have, int | float | str):
        if str(want) == str(have):
            return True
        try:  # quantities: the API server stores 0.5 CPU as "500m", 1024Mi as "1Gi"
            from kubernetes.utils import parse_quantity

            return parse_quantity(want) == parse_quantity(have)
        except (ValueError, TypeError):
            return False
    return False


def contains(want: Any, have: Any) -> bool:
    """Every field in `want` is in `have` with the same value (extra live fields are fine)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            k in have and contains(v, have[k]) for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(contains, want, have))
    return _same_scalar(want, have)


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    if live is None:
        return False
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    want_hash = desired["metadata"]["annotations"][HASH_ANNOTATION]
    return annotations.get(HASH_ANNOTATION) == want_hash and contains(desired, live)


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


def _adopt(manifest: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    # The owner's own labels (e.g. a GitOps tool's tracking label) must not spread to the
    # children, so adopt them to a label-less view of the owner.
    owner_view = copy.deepcopy(dict(owner))
    owner_view.setdefault("metadata", {})["labels"] = {}
    # kopf annotates its Body view, but only reads the owner as a mapping (metadata).
    kopf.adopt(manifest, owner=owner_view)  # type: ignore[arg-type]
    manifest["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = manifest_hash(manifest)
    return manifest


def _api_message(exc: Exception) -> str:
    body = getattr(exc, "body", None) or ""
    try:
        return json.loads(body).get("message") or body[:500]
    except (ValueError, AttributeError):
        return str(body)[:500] or str(exc)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_valid_message(status: Mapping[str, Any]) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "SpecValid" and c.get("status") == "False":
            return c.get("message")
    return None


def report_invalid(
    cluster: Cluster,
    body: Mapping[str, Any],
    message: str,
    post_event: PostEvent,
    now: str | None = None,
    reads: ClusterView | LiveReads | None = None,
) -> bool:
    """SpecValid=False + one Event, once per distinct message (no storm on resync)."""
    meta = body["metadata"]
    current = body.get("status") or {}
    # The rest of the status (replicas, URL) still describes the pods of the last valid spec.
    new = {**current, **invalid_status(message, meta.get("generation"), current, now or _now())}
    patch = status_patch(current, new)
    if patch:
        stored = cluster.patch_status(meta["namespace"], meta["name"], patch)
        if reads is not None:
            reads.wrote(stored)
    if _spec_valid_message(current) != message:
        post_event("Warning", "InvalidSpec", message)
    return bool(patch)


class _OwnerGone(Exception):
    """The StreamingModel is gone from the API server: the pass stops, creating nothing."""


def converge(
    cluster: Cluster,
    body: Mapping[str, Any],
    post_event: PostEvent,
    now: str | None = None,
    reads: ClusterView | LiveReads | None = None,
    owner_exists: Callable[[], bool] | None = None,
    pacer: RolloutPacer | None = None,
    pod_metrics: PodMetrics | None = None,
    zero: ZeroContext | None = None,
    defaults: OperatorDefaults | None = None,
    weights_progress: WeightsProgress | None = None,
) -> Outcome:
    """One pass (see `_converge`); a model found deleted before a create ends it quietly."""
    try:
        return _converge(
            cluster,
            body,
            post_event,
            now,
            reads,
            owner_exists,
            pacer,
            pod_metrics,
            zero,
            defaults,
            weights_progress,
        )
    except _OwnerGone:
        return Outcome()


def _converge(
    cluster: Cluster,
    body: Mapping[str, Any],
    post_event: PostEvent,
    now: str | None = None,
    reads: ClusterView | LiveReads | None = None,
    owner_exists: Callable[[], bool] | None = None,
    pacer: RolloutPacer | None = None,
    pod_metrics: PodMetrics | None = None,
    zero: ZeroContext | None = None,
    defaults: OperatorDefaults | None = None,
    weights_progress: WeightsProgress | None = None,
) -> Outcome:
    """Raises SpecError (after reporting it) for an invalid spec; API errors propagate.

    `reads`: where the watched children and pods come from (default: GETs through `cluster`).
    Kinds that are not watched (`kinds.OPTIONAL_KINDS`, KEDA's HPA) are read through
    `cluster`, and only by models that use them or, as their status says, last did.
    `owner_exists`: asked once, before the pass creates a child: False ends the pass. ClusterView
    may still hold a model the API server has deleted (its DELETED event not yet processed)
    while the garbage collector removes the children; without this the pass would create
    them again.
    `pacer`: operator-caused pod template changes wait for a rollout slot (`pacing.py`);
    without one they are applied at once.
    `pod_metrics`: reads a ready pod's /metrics, for status.adapters (models with LoRA on);
    None: adapters are reported Unknown.
    `zero`: the activator's address and the poller's signals, for models with minReplicas 0
    (scaletozero.py); None: the default address and no signals (never idle, nothing held).
    `defaults`: the operator's configuration the builders fall back to (the model image);
    None: the built-in defaults.
    `weights_progress`: reads a running weights download's progress (models with
    model.cache.weights); None: the status says "resolving" until the Job ends.
    """
    reads = reads if reads is not None else LiveReads(cluster)
    try:
        model = load_model(body, defaults=defaults)
    except SpecError as exc:
        report_invalid(cluster, body, str(exc), post_event, now, reads)
        raise
    run = _Pass(
        cluster,
        body,
        model,
        post_event,
        now or _now(),
        reads,
        owner_exists,
        pacer,
        pod_metrics,
        zero,
        weights_progress,
    )
    status = body.get("status") or {}
    touched = [row for row in OPTIONAL_KINDS if run.wants(row) or remembered(row, status)]
    # A kind no longer wanted goes before what it excludes is applied (never two HPAs).
    first = [row for row in touched if row.excludes is not None and not run.wants(row)]
    for row in first:
        run.optional(row)
    run.continuation_secret()  # before the pods that mount it
    for child in CHILD_KINDS:
        run.child(child)
    for row in touched:
        if row not in first:
            run.optional(row)
    run.drop_continuation_secret()  # after the workload (its pods' volume is optional)
    run.scale()  # after the route: to zero only once the route names the activator
    run.write_status()
    run.post_events()
    # A missing CRD or grant fails the pass after the rest converged: the handler retries
    # with backoff (passes.py), so the kind appears once it is installed.
    refused = [run.refused[row.name] for row in OPTIONAL_KINDS if row.name in run.refused]
    if refused:
        raise refused[0][1]
    if run.key_refused is not None:
        raise run.key_refused
    return run.outcome


class _Pass:
    """One pass over one model: the steps of `_converge` and what they found."""

    def __init__(
        self,
        cluster: Cluster,
        body: Mapping[str, Any],
        model: StreamingModel,
        post_event: PostEvent,
        now: str,
        reads: ClusterView | LiveReads,
        owner_exists: Callable[[], bool] | None,
        pacer: RolloutPacer | None = None,
        pod_metrics: PodMetrics | None = None,
        zero: ZeroContext | None = None,
        weights_progress: WeightsProgress | None = None,
    ) -> None:
        self.cluster, self.body, self.reads = cluster, body, reads
        self.weights_progress = weights_progress
        self.post_event, self.now, self.owner_exists = post_event, now, owner_exists
        self.pacer, self.pod_metrics = pacer, pod_metrics
        self.waiting: list[Any] = []  # the pacer's Decision when the workload waits for a slot
        meta = body["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta.get("uid")
        self.status = body.get("status") or {}
        self.workload_kind = LWS_KIND if model.multi_node else DEPLOYMENT
        # Scale to zero (scaletozero.py): the route and the step, from the workload as
        # stored and the poller's signals, before the children are built.
        self.signals, self.step = Signals(), Step.NONE
        self.metrics = zero.metrics if zero is not None else None
        self.zero = zero
        if zero is not None:  # where the activator (the router) answers, and whether it runs
            model = dataclasses.replace(
                model, activator_host=zero.activator_host, router_available=zero.router
            )
        if model.spec.scale_to_zero is not None:
            if zero is not None:
                self.signals = zero.signals((self.namespace, self.name))
            via, self.step = decide(model, self._workload(), self.signals)
            model = dataclasses.replace(model, via_activator=via)
        # The weights cache: which commit the pods mount (None: no pods yet), before the
        # children are built from it.
        self.weights: WeightsVerdict | None = None
        if cache_of(model) is not None:
            self.weights = self._weights(model)
            model = dataclasses.replace(model, weights_commit=self.weights.commit)
        self.model = model
        self.desired = desired_children(model)
        self.live: dict[str, dict[str, Any] | None] = {}
        # Optional kinds the cluster refused (403/404): kind -> (what it means, the error).
        self.refused: dict[str, tuple[Unavailable, Exception]] = {}
        # The continuation key's Secret refused (403): the model converges without it.
        self.key_refused: Exception | None = None
        self.outcome = Outcome()

    def _workload(self) -> dict[str, Any] | None:
        kind = self.workload_kind
        if kind in WATCHED_KINDS:
            return self.reads.get(kind, self.namespace, self.name)
        return self.cluster.get(kind.api_version, kind.kind, self.namespace, self.name)

    def scale(self) -> None:
        """The step `decide` chose: the workload's scale subresource to 0 or 1 (the HPA keeps
        1..N and stops acting at 0; the scale to 1 re-enables it)."""
        if self.step is Step.NONE:
            return
        kind = self.workload_kind
        workload = self.live.get(kind.kind)
        if workload is None:
            return
        replicas = 0 if self.step is Step.TO_ZERO else 1
        scale = self.cluster.scale(kind.api_version, kind.kind, self.namespace, self.name, replicas)
        version = ((scale or {}).get("metadata") or {}).get("resourceVersion")
        self.live[kind.kind] = self.reads.wrote(with_replicas(workload, replicas, version))
        if self.metrics is not None:
            self.metrics.scaled((self.namespace, self.name), replicas)
        log.info(f"{self.namespace}/{self.name}: scaled to {replicas} ({self.step.value})")

    def wants(self, row: OptionalKind) -> bool:
        return self.desired[row.name] is not None

    def confirm_owner(self) -> None:
        if self.owner_exists is not None:
            if not self.owner_exists():
                raise _OwnerGone
            self.owner_exists = None

    def pace_workload(self, manifest: dict[str, Any], current: dict[str, Any] | None) -> bool:
        """Label the Deployment or LeaderWorkerSet for pacing (after its applied-hash: the
        labels never change it); False: hold it (an operator-caused template change to a
        workload that serves, no slot free), keeping the live one."""
        generation = self.body["metadata"].get("generation")
        contained = contains(pod_templates(manifest), pod_templates(current or {}))
        observed = self.status.get("observedGeneration")
        cause = cause_of_change(manifest, current, generation, observed, contained)
        new = template_hash(manifest)
        old = ((current or {}).get("metadata") or {}).get("labels") or {}
        paced = old.get(PACED) == new
        key = (self.namespace, self.name)
        if cause == "operator" and self.pacer is not None and serving(current):
            decision = self.pacer.admit(key, new, old.get(TEMPLATE_HASH), current)
            if not decision.admitted:
                self.waiting.append(decision)
                return False
            paced = True
        elif self.pacer is not None:
            self.pacer.forget(key)
        stamp(manifest, paced)
        return True

    def apply_child(self, manifest: dict[str, Any], exists: bool) -> dict[str, Any]:
        """Server-side apply; for a child that exists and the API server refuses, replace
        its lists and apply once more. Server-side apply keeps list entries another manager
        added, and a Service port edited by hand is such an entry: it stays next to ours and
        the API server refuses two ports named `http`, whatever the spec says. A refusal
        after the lists were replaced (a merge patch) is the spec's own fault. Entries the
        API server accepts (a container patched in) are left alone: they are someone else's."""
        try:
            return self.cluster.apply(manifest)
        except Exception as exc:
            if not exists or getattr(exc, "status", None) not in (400, 422):
                raise
            message = _api_message(exc)
        kind = manifest["kind"]
        self.post_event(
            "Warning",
            "ChildRepaired",
            f"the API server refused the {kind} ({message}); its lists were replaced",
        )
        self.cluster.replace_lists(manifest)
        return self.cluster.apply(manifest)

    def apply(self, manifest: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
        """`apply_child`; a route the Standard-channel CRD refuses for its sessionPersistence
        is applied without it (same applied-hash, so later passes compare it without)."""
        try:
            return self.apply_child(manifest, current is not None)
        except Exception as exc:
            if not schema_lacks_session_persistence(exc):
                raise
        self.post_event("Warning", "SessionPersistenceUnsupported", SESSION_PERSISTENCE_DROPPED)
        return self.apply_child(without_session_persistence(manifest), current is not None)

    def child(self, child: Kind) -> None:
        kind, namespace, name = child.id, self.namespace, child.child_name(self.name)
        manifest = self.desired[kind]
        if child in WATCHED_KINDS:
            current = self.reads.get(child, namespace, name)
        else:
            current = self.cluster.get(child.api_version, child.kind, namespace, name)
        if manifest is None:
            if current is not None and _owned_by(current, self.uid):
                self.cluster.delete(child.api_version, child.kind, namespace, name)
                self.reads.deleted(child, namespace, name, current)
                self.outcome.deleted.append(kind)
            self.live[kind] = None
            return
        manifest = _adopt(manifest, self.body)
        if child in (DEPLOYMENT, LWS_KIND) and not self.pace_workload(manifest, current):
            self.live[kind] = current
            return
        if session_persistence_dropped(manifest, current):
            # A Standard-channel CRD has no such field: compare what the API server keeps
            # (status says so), or every pass would apply the route again.
            manifest = without_session_persistence(manifest)
        if in_sync(manifest, current):
            self.live[kind] = current
            return
        if current is None:
            self.confirm_owner()
        try:
            self.live[kind] = self.reads.wrote(self.apply(manifest, current))
        except Exception as exc:
            if getattr(exc, "status", None) not in (400, 422):
                raise
            # The API server refused what the spec produced (e.g. a bad affinity or env
            # valueFrom passed through): the spec's fault, so report it like one.
            message = f"the API server rejected the {kind}: {_api_message(exc)}"
            self.outcome.status_written = report_invalid(
                self.cluster, self.body, message, self.post_event, self.now, self.reads
            )
            raise SpecError(message) from None
        self.outcome.applied.append(kind)

    def continuation_secret(self) -> None:
        """The model's continuation key (kinds.CONTINUATION_SECRET), applied without reading
        it: only when what this process last applied differs (the master key rotated, the
        model is new, or the operator restarted)."""
        child = CONTINUATION_SECRET
        manifest = self.desired[child.id]
        if manifest is None:
            return
        manifest = _adopt(manifest, self.body)
        digest = manifest["metadata"]["annotations"][HASH_ANNOTATION]
        if self.reads.applied(child, self.namespace, self.name) == digest:
            return
        self.confirm_owner()
        try:
            self.cluster.apply(manifest)  # what it returns (the key) is not kept in memory
        except Exception as exc:
            if getattr(exc, "status", None) != 403:
                raise
            # An operator upgraded without its chart's RBAC: the model converges without
            # migration (no mount, no flag), the status says why, and the pass is retried.
            self.key_refused = exc
            keyless = dataclasses.replace(self.model.defaults, continuation_key=None)
            self.model = dataclasses.replace(self.model, defaults=keyless)
            self.desired = desired_children(self.model)
            return
        self.reads.remember_applied(child, self.namespace, self.name, digest)
        self.outcome.applied.append(child.id)

    def drop_continuation_secret(self) -> None:
        """Deleted when the model no longer migrates but the status says it did (a delete
        of one already gone is a no-op)."""
        child = CONTINUATION_SECRET
        if self.desired[child.id] is not None or not migrated(self.status):
            return
        if self.key_refused is not None:
            return  # the API server refuses this operator Secrets: nothing to do until granted
        self.cluster.delete(
            child.api_version, child.kind, self.namespace, child.child_name(self.name)
        )
        self.reads.remember_applied(child, self.namespace, self.name, None)
        self.outcome.deleted.append(child.id)

    def optional(self, row: OptionalKind) -> None:
        """`child` for an optional kind; a 403/404 is kept for the status and the Event."""
        try:
            self.child(row.kind)
        except Exception as exc:
            unavailable = row.unavailable(exc)
            if unavailable is None:
                raise
            self.live[row.name] = None
            if self.wants(row) or row.excludes is not None:
                self.refused[row.name] = (unavailable, exc)

    def write_status(self) -> None:
        # The workload: the Deployment, or the LeaderWorkerSet of a multi-node model (its
        # status has the same replica counts, in groups).
        deployment = self.live.get(self.workload_kind.kind)
        pools = pool_hpas = None
        if self.model.disaggregated:  # two Deployments: status.pools and one phase
            pools = {"prefill": self.live.get(PREFILL_DEPLOYMENT.id),
                     "decode": self.live.get(DECODE_DEPLOYMENT.id)}  # fmt: skip
            pool_hpas = {"prefill": self.live.get(PREFILL_HPA.id),
                         "decode": self.live.get(DECODE_HPA.id)}  # fmt: skip
            deployment = combined_workload(pools)
        # Pods are only read when something is missing or a rollout is under way: they explain
        # why (no GPUs for the new or the surge pod, crash loop); and for models with LoRA on,
        # whose pages say how they stand with each adapter (adapterstatus.py).
        lora = self.model.spec.lora_enabled
        pods = (
            self.reads.pods(self.namespace, self.name)
            if deployment is not None and (lora or not deployment_settled(deployment))
            else []
        )
        hpa = self.live.get(HPA.kind)
        if self.model.spec.autoscaling_backend == "keda":  # KEDA's HPA has the reading
            hpa = self.cluster.get(
                HPA.api_version, HPA.kind, self.namespace, keda_hpa_name(self.model)
            )
        new = compute_status(
            self.model,
            self.body["metadata"].get("generation"),
            deployment,
            pods,
            self.live.get(INGRESS.kind),
            self.status,
            self.now,
            hpa=hpa,
            optional=self.live,
            unavailable={
                **{kind: unavailable for kind, (unavailable, _) in self.refused.items()},
                **({MIGRATION_CONDITION: FORBIDDEN} if self.key_refused is not None else {}),
            },
            pools=pools,
            pool_hpas=pool_hpas,
        )
        generation = self.body["metadata"].get("generation")
        if self.waiting and self.pacer is not None:
            message = self.waiting[0].message(self.pacer.limit)
            new = with_template_wait(new, message, self.status, self.now, generation)
            if not was_waiting(self.status):
                self.post_event("Normal", "RolloutWaiting", message)
        if lora:
            new = _with_adapters(
                self.model,
                new,
                pods,
                self.status,
                self.pod_metrics,
                self.post_event,
                self.now,
                generation,
            )
            self.outcome.adapters_settling = settling(new.get("adapters"))
        if self.model.spec.scale_to_zero is not None:
            new = self.zero_status(new, deployment, generation)
        if self.weights is not None:
            new = self.weights_status(new, deployment, generation)
        if self.model.spec.routing.router.split:
            new = self.split_status(new, generation)
        if self.pacer is not None:
            self.pacer.observe((self.namespace, self.name), deployment)
        unwatched = self.workload_kind is LWS_KIND and deployment is not None
        self.outcome.workload_settling = unwatched and not deployment_settled(deployment or {})
        self.outcome.phase = new["phase"]
        patch = status_patch(self.status, new)
        if patch:
            log.info(f"status of {self.namespace}/{self.name} changed: {str(patch)[:2000]}")
            self.reads.wrote(self.cluster.patch_status(self.namespace, self.name, patch))
            self.outcome.status_written = True

    def zero_status(
        self, new: dict[str, Any], workload: dict[str, Any] | None, generation: int | None
    ) -> dict[str, Any]:
        """Phase ScaledToZero / Activating (held count), condition ScaledToZero, and an
        Event on each transition into or out of them."""
        phase, message, cond, held = zero_status(
            self.model, workload, self.signals, self.model.via_activator
        )
        new = with_condition(new, cond, self.status, self.now, generation)
        new["heldRequests"] = held
        before = self.status.get("phase")
        if phase is not None:
            new["phase"], new["message"] = phase, message
            for c in new["conditions"]:
                if c["type"] == "Ready":
                    c.update(reason=phase, message=message)
            if before != phase:
                self.post_event("Normal", phase, message or "")
        elif before in ("ScaledToZero", "Activating") and not self.model.via_activator:
            self.post_event(
                "Normal",
                "Activated",
                f"a replica is Ready: the route goes to Service {self.name} again",
            )
        if self.metrics is not None and not self.model.via_activator:
            self.metrics.serving((self.namespace, self.name))
        return new

    # --- the weights cache (builders/weights.py, weightsstate.py) ---------------------
    def _weights(self, model: StreamingModel) -> WeightsVerdict:
        """Nothing is read while the status records the wanted commit; else the claim and
        the download Job are read (and created), and the running pod asked for progress."""
        verdict = weights_verdict(model, self.status, None, self.now)
        if verdict.condition["status"] == "True":
            return verdict
        cache = cache_of(model)
        assert cache is not None
        ns, pvc = self.namespace, PERSISTENT_VOLUME_CLAIM
        claim = self.cluster.get(pvc.api_version, pvc.kind, ns, cache.claim_name)
        if claim is None:
            wanted = desired_weights_claim(model)
            if wanted is None:
                message = (
                    f"the claim {cache.claim_name} does not exist: create it (ReadWriteMany), "
                    "or set model.cache.weights.create to have the operator create it"
                )
                verdict.condition.update(reason="ClaimMissing", message=message)
                return verdict
            self.confirm_owner()
            self.cluster.apply(wanted)
            self.post_event(
                "Normal",
                "WeightsClaimCreated",
                f"created the claim {cache.claim_name} ({cache.create.size if cache.create else ''}"
                f", {cache.create.access_mode if cache.create else ''}) for the weights cache",
            )
        name = fetch_job_name(model)
        job = self.cluster.get(JOB.api_version, JOB.kind, ns, name)
        pods = self.cluster.list_pods(ns, f"job-name={name}") if job is not None else []
        progress = None
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        if running and self.weights_progress is not None:
            progress = self.weights_progress(running[0])
        verdict = weights_verdict(model, self.status, JobView(job, pods, progress), self.now)
        if verdict.create_job:
            self.confirm_owner()
            try:
                self.cluster.apply(desired_fetch_job(model))
            except Exception as exc:
                # Another model created it with another template (its image, its token
                # Secret): the Job is immutable, and sharing it is the point.
                if getattr(exc, "status", None) not in (409, 422):
                    raise
            repo, revision = repo_and_revision(model)
            self.post_event(
                "Normal", "WeightsDownloading", f"download Job {name} for {repo}@{revision}"
            )
        if verdict.delete_job:
            self.cluster.delete(JOB.api_version, JOB.kind, ns, name)
        return verdict

    def _neighbours(self) -> list[Mapping[str, Any]]:
        """The StreamingModels of this namespace as memory holds them (this one alone
        without memory: a one-off pass)."""
        models = getattr(self.reads, "models", None)
        if models is None:
            return [self.body]
        out = []
        for ns, name in models():
            body = self.reads.model(ns, name) if ns == self.namespace else None  # type: ignore[union-attr]
            if body is not None:
                out.append(body if name != self.name else self.body)
        return out

    def _clean_up(self, record: dict[str, Any], workload: Mapping[str, Any] | None) -> None:
        """Once the pods rolled onto the new commit: the old one is removed from the claim by
        a clean-up Job, keeping every commit a model of the namespace serves, still rolls
        from, or pins in its spec; not while any of them downloads this repository towards
        a commit not known yet, a model created a moment ago included
        (`weightsstate.weights_users`). `previousCommit` is dropped once decided."""
        old = record.get("previousCommit")
        if not old or workload is None or not deployment_settled(workload):
            return
        claim, repo = str(record.get("claimName")), str(record.get("repo"))
        others = [
            b for b in self._neighbours() if (b.get("metadata") or {}).get("name") != self.name
        ]
        users = weights_users(claim, repo, others)
        if users.busy:
            log.info(
                f"{self.namespace}/{self.name}: commit {old} of {repo} stays on claim {claim} "
                f"while model {users.busy} downloads the repository"
            )
            return  # a download of this repository runs: wait for it
        keep = users.keep | {str(record["commit"])}
        record.pop("previousCommit", None)
        if old in keep:
            return  # another model still serves it: it cleans up when it moves on
        generation = self.body["metadata"].get("generation")
        salt = f"{self.uid}/{generation}"
        manifest = desired_remove_job(self.model, sorted(keep), salt)
        meta = manifest["metadata"]
        if self.cluster.get(JOB.api_version, JOB.kind, self.namespace, meta["name"]) is None:
            self.cluster.apply(manifest)
        self.post_event(
            "Normal",
            "WeightsRemoving",
            f"removing commit {old} of {repo} from claim {claim} (Job {meta['name']}): "
            "no model of the namespace serves it",
        )

    def weights_status(
        self, new: dict[str, Any], workload: Mapping[str, Any] | None, generation: int | None
    ) -> dict[str, Any]:
        """WeightsReady and status.weights; without a ready commit the phase says why
        there are no pods."""
        verdict = self.weights
        assert verdict is not None
        record = dict(verdict.record) if verdict.record is not None else None
        if record is not None and verdict.commit is not None:
            self._clean_up(record, workload)
        new = with_condition(new, verdict.condition, self.status, self.now, generation)
        new["weights"] = record
        if verdict.commit is None:
            phase = "Failed" if verdict.failed else "Pending"
            message = verdict.condition["message"]
            new["phase"], new["message"] = phase, message
            for c in new["conditions"]:
                if c["type"] == "Ready":
                    c.update(reason="WeightsNotReady", message=message)
                elif c["type"] in ("Available", "Progressing") and c["status"] != "True":
                    c.update(message=message)
        for type_, reason, message in verdict.events:
            self.post_event(type_, reason, message)
        self.outcome.weights_settling = verdict.settling
        return new

    # --- a model version to a share of traffic (builders/split.py) ---------------------
    def _model_body(self, name: str) -> Mapping[str, Any] | None:
        model = getattr(self.reads, "model", None)
        if model is not None:
            return model(self.namespace, name)
        return self.cluster.get(f"{GROUP}/{VERSION}", KIND, self.namespace, name)

    def split_status(self, new: dict[str, Any], generation: int | None) -> dict[str, Any]:
        """Condition TrafficSplit (the versions checked against the objects they name) and
        status.split: each version's applied weight, ready pods and numbers over the
        poller's last window, this model first."""
        bodies: dict[str, Mapping[str, Any]] = {}
        models: dict[str, StreamingModel | None] = {}
        for v in self.model.spec.routing.router.split:
            body = self._model_body(v.model)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                continue
            bodies[v.model] = body
            try:
                models[v.model] = load_model(body)
            except SpecError:
                models[v.model] = None
        checks = check_versions(self.model, models)
        cond = split_condition(self.model, checks)
        new = with_condition(new, cond, self.status, self.now, generation)
        if cond["status"] != "True" and cond["reason"] != _split_reason(self.status):
            self.post_event("Warning", "TrafficSplit", cond["message"])
        stats = self.zero.split_stats if self.zero is not None else (lambda key: None)
        rows = []
        weights = [(self.name, owner_weight(checks)), *((c.model, c.applied) for c in checks)]
        if not self.model.router_available:
            weights = [(name, 100 if name == self.name else 0) for name, _ in weights]
        for name, weight in weights:
            row: dict[str, Any] = {"model": name, "weight": weight}
            status = new if name == self.name else (bodies.get(name) or {}).get("status") or {}
            if status.get("readyReplicas") is not None:
                row["readyReplicas"] = status["readyReplicas"]
            numbers = stats((self.namespace, name))
            if numbers is not None:
                row.update(numbers.fields())
            rows.append(row)
        new["split"] = rows
        return new

    def post_events(self) -> None:
        """What changed, then a Warning per refused kind whose message the status lacked."""
        applied, deleted = self.outcome.applied, self.outcome.deleted
        if applied or deleted:
            parts = [f"applied {', '.join(applied)}"] if applied else []
            parts += [f"deleted {', '.join(deleted)}"] if deleted else []
            self.post_event("Normal", "Reconciled", "; ".join(parts))
            log.info(f"{self.namespace}/{self.name}: {'; '.join(parts)}")
        for row in OPTIONAL_KINDS:
            unavailable, _ = self.refused.get(row.name, (None, None))
            if unavailable is not None and reported(row, self.status) != unavailable.message:
                self.post_event("Warning", row.event, unavailable.message)
        if self.key_refused is not None and not key_forbidden(self.status):
            verdict = migration_verdict(self.model, forbidden=True)
            self.post_event("Warning", "ContinuationKeyForbidden", verdict[2] if verdict else "")


def _split_reason(status: Mapping[str, Any]) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "TrafficSplit":
            return str(c.get("reason"))
    return None


def _with_adapters(
    model: StreamingModel,
    status: dict[str, Any],
    pods: list[dict[str, Any]],
    previous: Mapping[str, Any],
    pod_metrics: PodMetrics | None,
    post_event: PostEvent,
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """status.adapters and AdaptersReady from the ready pods' pages; an Event for each
    adapter that newly failed."""
    pages: dict[str, str | None] = {}
    if pod_metrics is not None and model.spec.adapters:
        for pod in pods:
            if ready(pod):
                pages[(pod.get("metadata") or {}).get("name", "?")] = pod_metrics(pod)
    result = adapters_status(model, pods, pages)
    assert result is not None  # LoRA is on
    entries, cond = result
    before = {e.get("name"): e for e in previous.get("adapters") or []}
    for e in entries:
        old = before.get(e["name"]) or {}
        if e["state"] == "Failed" and (old.get("state"), old.get("message")) != (
            "Failed",
            e["message"],
        ):
            post_event("Warning", "AdapterFailed", f"adapter {e['name']}: {e['message']}")
    status = with_condition(status, cond, previous, now, generation)
    status["adapters"] = entries
    return status


def release_weights(
    cluster: Cluster,
    deleted: Mapping[str, Any],
    neighbours: Sequence[Mapping[str, Any]],
    post_event: PostEvent,
    defaults: OperatorDefaults | None = None,
) -> bool:
    """A deleted StreamingModel's commits (`status.weights`: the one its pods served and,
    mid revision change, the one they rolled from) are removed from the claim by a clean-up
    Job when no other model of the namespace (`neighbours`, the deleted one excluded by
    uid) serves, rolls from or pins them; every commit of the repository when no model uses
    it any more. False: a model downloads the repository towards a commit not known yet,
    so the clean-up must wait (the caller asks again later); True: decided (a Job created,
    or nothing to remove)."""
    meta = deleted.get("metadata") or {}
    record = (deleted.get("status") or {}).get("weights") or {}
    commits = {str(c) for c in (record.get("commit"), record.get("previousCommit")) if c}
    claim, repo = record.get("claimName"), record.get("repo")
    if not commits or not claim or not repo:
        return True  # it never served a commit of the cache
    try:
        model = load_model(deleted, defaults=defaults)  # the Job runs the model's image
    except SpecError:
        return True
    cache = cache_of(model)
    if cache is None or cache.claim_name != claim or repo_and_revision(model)[0] != repo:
        return True  # the record is of another claim or repository than its spec: leave it
    # By uid: a new model of the same name is another user (by name for bodies without one).
    uid = meta.get("uid")
    key = "uid" if uid else "name"
    others = [b for b in neighbours if (b.get("metadata") or {}).get(key) != meta.get(key)]
    users = weights_users(str(claim), str(repo), others)
    if users.busy:
        return False
    gone = sorted(commits - users.keep)
    if not gone:
        return True  # another model serves them: it cleans up when it moves on
    manifest = desired_remove_job(model, sorted(users.keep), salt=str(uid or meta.get("name")))
    name = manifest["metadata"]["name"]
    if cluster.get(JOB.api_version, JOB.kind, model.namespace, name) is None:
        cluster.apply(manifest)
    kept = f", keeping {', '.join(sorted(users.keep))}" if users.keep else ""
    post_event(
        "Normal",
        "WeightsRemoving",
        f"model {meta.get('name')} was deleted: removing commit {', '.join(gone)} of {repo} "
        f"from claim {claim} (Job {name}){kept}",
    )
    return True
