"""One converging pass: desired children vs live, apply only what drifted, then status.

Called by every handler (create, update, resume, child changed, resync). The model, its
watched children and pods are read from `reads`: in the operator the memory its watches
fill (`memory.Memory`), so a pass makes write calls only, and a pass over an object whose
children match and whose status is current makes no call at all. Every write's result is
handed back to `reads`, so the next pass starts from what this one wrote. Children are compared by (a) a hash of the last applied manifest, kept in
an annotation, which catches spec changes including removed fields, and (b) "every field we
set still has our value", which catches hand edits, since the API server adds defaults we
must not fight over.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from .adapterstatus import adapters_status, settling
from .builders.common import HASH_ANNOTATION
from .builders.gateway import (
    schema_lacks_session_persistence,
    session_persistence_dropped,
    without_session_persistence,
)
from .builders.keda import keda_hpa_name
from .cluster import Cluster, LiveReads
from .kinds import (
    CHILD_KINDS,
    HPA,
    HTTPROUTE,
    KEDA_KIND,
    POD_MONITOR_KIND,
    WATCHED_KINDS,
    Kind,
    desired_children,
)
from .memory import Memory
from .status import (
    GATEWAY_CONDITION,
    SESSION_PERSISTENCE_DROPPED,
    compute_status,
    deployment_settled,
    had_pod_monitor,
    invalid_status,
    status_patch,
    with_condition,
    with_pod_monitor,
)
from .validation import SpecError, load_model

log = logging.getLogger("sluice_operator.reconcile")

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    phase: str | None = None
    # An adapter is still loading on some pod: look again soon (handlers.py retries).
    adapters_settling: bool = False


PodMetrics = Callable[[Mapping[str, Any]], str | None]  # a pod's /metrics page, or None


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
    kopf.adopt(manifest, owner=owner_view)
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
    reads: Memory | LiveReads | None = None,
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
    reads: Memory | LiveReads | None = None,
    owner_exists: Callable[[], bool] | None = None,
    pod_metrics: PodMetrics | None = None,
) -> Outcome:
    """One pass (see `_converge`); a model found deleted before a create ends it quietly."""
    try:
        return _converge(cluster, body, post_event, now, reads, owner_exists, pod_metrics)
    except _OwnerGone:
        return Outcome()


def _converge(
    cluster: Cluster,
    body: Mapping[str, Any],
    post_event: PostEvent,
    now: str | None = None,
    reads: Memory | LiveReads | None = None,
    owner_exists: Callable[[], bool] | None = None,
    pod_metrics: PodMetrics | None = None,
) -> Outcome:
    """Raises SpecError (after reporting it) for an invalid spec; API errors propagate.

    `reads`: where the watched children and pods come from (default: GETs through `cluster`).
    Kinds that are not watched (ScaledObject, PodMonitor, HTTPRoute, KEDA's HPA) are read
    through `cluster`, and only by models that use them.
    `owner_exists`: asked once, before the pass creates a child: False ends the pass. Memory
    may still hold a model the API server has deleted (its DELETED event not yet processed)
    while the garbage collector removes the children; without this the pass would create
    them again.
    `pod_metrics`: reads a ready pod's /metrics, for status.adapters (models with LoRA on);
    None: adapters are reported Unknown.
    """
    reads = reads if reads is not None else LiveReads(cluster)
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid")
    outcome = Outcome()
    try:
        model = load_model(body)
    except SpecError as exc:
        outcome.status_written = report_invalid(cluster, body, str(exc), post_event, now, reads)
        outcome.phase = "Failed"
        raise

    desired = desired_children(model)
    live: dict[str, dict[str, Any] | None] = {}
    confirmed = owner_exists is None

    def confirm_owner() -> None:
        nonlocal confirmed
        if not confirmed:
            if not owner_exists():  # type: ignore[misc]
                raise _OwnerGone
            confirmed = True

    def apply_child(manifest: dict[str, Any], exists: bool) -> dict[str, Any]:
        """Server-side apply; for a child that exists and the API server refuses, replace
        its lists and apply once more. Server-side apply keeps list entries another manager
        added, and a Service port edited by hand is such an entry: it stays next to ours and
        the API server refuses two ports named `http`, whatever the spec says. A refusal
        after the lists were replaced (a merge patch) is the spec's own fault. Entries the
        API server accepts (a container patched in) are left alone: they are someone else's."""
        try:
            return cluster.apply(manifest)
        except Exception as exc:
            if not exists or getattr(exc, "status", None) not in (400, 422):
                raise
            message = _api_message(exc)
        kind = manifest["kind"]
        post_event("Warning", "ChildRepaired",
                   f"the API server refused the {kind} ({message}); its lists were replaced")  # fmt: skip
        cluster.replace_lists(manifest)
        return cluster.apply(manifest)

    def apply_without_what_the_schema_lacks(
        manifest: dict[str, Any], current: dict[str, Any] | None
    ) -> dict[str, Any]:
        """`apply_child`; a route the Standard-channel CRD refuses for its sessionPersistence
        is applied without it (same applied-hash, so later passes compare it without)."""
        try:
            return apply_child(manifest, current is not None)
        except Exception as exc:
            if not schema_lacks_session_persistence(exc):
                raise
        post_event("Warning", "SessionPersistenceUnsupported", SESSION_PERSISTENCE_DROPPED)
        return apply_child(without_session_persistence(manifest), current is not None)

    def converge_child(child: Kind) -> None:
        kind = child.kind
        manifest = desired[kind]
        child_name = child.child_name(name)
        if child in WATCHED_KINDS:
            current = reads.get(child, namespace, child_name)
        else:
            current = cluster.get(child.api_version, kind, namespace, child_name)
        if manifest is None:
            if current is not None and _owned_by(current, uid):
                cluster.delete(child.api_version, kind, namespace, child_name)
                reads.deleted(child, namespace, child_name, current)
                outcome.deleted.append(kind)
            live[kind] = None
            return
        manifest = _adopt(manifest, body)
        if session_persistence_dropped(manifest, current):
            # A Standard-channel CRD has no such field: compare what the API server keeps
            # (status says so), or every pass would apply the route again.
            manifest = without_session_persistence(manifest)
        if in_sync(manifest, current):
            live[kind] = current
            return
        if current is None:
            confirm_owner()
        try:
            live[kind] = reads.wrote(apply_without_what_the_schema_lacks(manifest, current))
        except Exception as exc:
            if getattr(exc, "status", None) not in (400, 422):
                raise
            # The API server refused what the spec produced (e.g. a bad affinity or env
            # valueFrom passed through): the spec's fault, so report it like one.
            message = f"the API server rejected the {kind}: {_api_message(exc)}"
            outcome.status_written = report_invalid(cluster, body, message, post_event, now, reads)
            raise SpecError(message) from None
        outcome.applied.append(kind)

    current_status = body.get("status") or {}
    backend = model.spec.autoscaling_backend
    # The ScaledObject is only touched when this model uses KEDA or last did (the status
    # remembers): clusters without KEDA have no such resource and no RBAC for it. Order
    # matters so two HPAs never fight: ours is deleted before the ScaledObject (whose HPA
    # KEDA makes) is applied, and the ScaledObject deleted before ours is applied.
    was_keda = (current_status.get("autoscaling") or {}).get("backend") == "keda"
    keda_error: Exception | None = None

    def converge_keda() -> None:
        nonlocal keda_error
        try:
            converge_child(KEDA_KIND)
        except Exception as exc:
            if getattr(exc, "status", None) not in (403, 404):
                raise
            # KEDA missing (no such resource) or the chart's keda.enabled off (forbidden):
            # converge everything else, say why in the status, then fail the pass so the
            # handler retries with backoff and picks KEDA up once it is there.
            keda_error = exc
            live[KEDA_KIND.kind] = None

    if backend != "keda" and was_keda:
        converge_keda()
    for child in CHILD_KINDS:
        converge_child(child)
    if backend == "keda":
        converge_keda()
    # The PodMonitor likewise: only touched when wanted, or when the status says it was
    # (then it is deleted); a missing CRD or grant is reported, everything else converges.
    pm_wanted = model.spec.observability.pod_monitor.enabled
    pm_error: Exception | None = None
    if pm_wanted or had_pod_monitor(current_status):
        try:
            converge_child(POD_MONITOR_KIND)
        except Exception as exc:
            if getattr(exc, "status", None) not in (403, 404):
                raise
            pm_error = exc if pm_wanted else None

    # The HTTPRoute, like the ScaledObject, is only touched by models that use a Gateway or
    # did on the last pass (their status has the GatewayRoute condition): clusters without
    # Gateway API have no such resource. Applied after the Ingress is deleted, deleted after
    # the Ingress is applied, so a switch never ends with both.
    uses_route = model.spec.gateway is not None
    had_route = any(
        c.get("type") == GATEWAY_CONDITION for c in current_status.get("conditions") or []
    )
    route_error: Exception | None = None
    if uses_route or had_route:
        try:
            converge_child(HTTPROUTE)
        except Exception as exc:
            if getattr(exc, "status", None) not in (403, 404):
                raise
            live[HTTPROUTE.kind] = None
            # Missing CRDs or RBAC: the rest converges; a model that no longer wants a route
            # cannot have one the operator could reach, so there is nothing left to clean up.
            if uses_route:
                route_error = exc

    deployment = live["Deployment"]
    # Pods are only read when something is missing or a rollout is under way: they explain
    # why (no GPUs for the new or the surge pod, crash loop).
    lora = model.spec.lora_enabled
    # Pods are also read for models with LoRA on: their pages say how they stand with each
    # adapter (adapterstatus.py).
    pods = (
        reads.pods(namespace, name)
        if deployment is not None and (lora or not deployment_settled(deployment))
        else []
    )
    hpa = live.get(HPA.kind)
    if backend == "keda":  # KEDA's own HPA has the reading and the decision
        hpa = cluster.get(HPA.api_version, HPA.kind, namespace, keda_hpa_name(model))
    new_status = compute_status(
        model,
        meta.get("generation"),
        deployment,
        pods,
        live.get("Ingress"),
        current_status,
        now or _now(),
        hpa=hpa,
        route=live.get(HTTPROUTE.kind),
        route_problem=gateway_problem(route_error) if route_error is not None else None,
    )
    if pm_wanted:
        problem = pod_monitor_problem(pm_error) if pm_error is not None else None
        new_status = with_pod_monitor(new_status, problem, current_status, now or _now(),
                                      meta.get("generation"))  # fmt: skip
    if lora:
        new_status = _with_adapters(model, new_status, pods, current_status, pod_metrics,
                                    post_event, now or _now(), meta.get("generation"))  # fmt: skip
        outcome.adapters_settling = settling(new_status.get("adapters"))
    if keda_error is not None:
        scaling = dict(new_status.get("autoscaling") or {})
        scaling["message"] = keda_problem(keda_error)
        if backend != "keda":
            scaling["backend"] = "keda"  # a ScaledObject may still exist: keep cleaning up
        new_status["autoscaling"] = scaling
    outcome.phase = new_status["phase"]
    patch = status_patch(current_status, new_status)
    if patch:
        log.info(f"status of {namespace}/{name} changed: {str(patch)[:2000]}")
        reads.wrote(cluster.patch_status(namespace, name, patch))
        outcome.status_written = True

    if outcome.applied or outcome.deleted:
        parts = [f"applied {', '.join(outcome.applied)}"] if outcome.applied else []
        parts += [f"deleted {', '.join(outcome.deleted)}"] if outcome.deleted else []
        post_event("Normal", "Reconciled", "; ".join(parts))
        log.info(f"{namespace}/{name}: {'; '.join(parts)}")
    if route_error is not None:
        message = gateway_problem(route_error)
        before = [
            c for c in current_status.get("conditions") or [] if c.get("type") == GATEWAY_CONDITION
        ]
        if not before or before[0].get("message") != message:
            post_event("Warning", "GatewayAPIUnavailable", message)
        if keda_error is None:
            raise route_error
    if keda_error is not None:
        message = keda_problem(keda_error)
        if (current_status.get("autoscaling") or {}).get("message") != message:
            post_event("Warning", "KedaUnavailable", message)
        raise keda_error
    if pm_error is not None:
        # Retried with backoff (handlers.py), so the PodMonitor appears once the CRD does.
        message = pod_monitor_problem(pm_error)
        before = [c.get("message") for c in current_status.get("conditions") or []
                  if c.get("type") == "PodMonitorReady"]  # fmt: skip
        if before != [message]:
            post_event("Warning", "PodMonitorUnavailable", message)
        raise pm_error
    return outcome


def _with_adapters(
    model: Any,
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
    from .adapterstatus import ready

    pages = {}
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
            "Failed", e["message"]):  # fmt: skip
            post_event("Warning", "AdapterFailed", f"adapter {e['name']}: {e['message']}")
    status = with_condition(status, cond, previous, now, generation)
    status["adapters"] = entries
    return status


def pod_monitor_problem(exc: Exception) -> str:
    if getattr(exc, "status", None) == 403:
        return (
            "the operator may not manage monitoring.coreos.com PodMonitors: install the "
            "sluice-operator chart with podMonitors.enabled=true (or turn "
            "observability.podMonitor off)"
        )
    return (
        "the Prometheus Operator is not installed: the API server has no "
        "monitoring.coreos.com/v1 PodMonitor resource (install it, or turn "
        "observability.podMonitor off; the pods' prometheus.io annotations still work)"
    )


def keda_problem(exc: Exception) -> str:
    if getattr(exc, "status", None) == 403:
        return (
            "the operator may not manage keda.sh ScaledObjects: install the sluice-operator "
            "chart with keda.enabled=true (or set autoscaling.backend: hpa)"
        )
    return (
        "KEDA is not installed: the API server has no keda.sh/v1alpha1 ScaledObject "
        "resource (install KEDA, or set autoscaling.backend: hpa)"
    )


def gateway_problem(exc: Exception) -> str:
    if getattr(exc, "status", None) == 403:
        return (
            "the operator may not manage gateway.networking.k8s.io HTTPRoutes: upgrade the "
            "sluice-operator chart (its RBAC grants them), or use spec.ingress instead"
        )
    return (
        "the Gateway API is not installed: the API server has no gateway.networking.k8s.io/v1 "
        "HTTPRoute resource (install a Gateway API implementation and its CRDs, v1.2 or later, "
        "or use spec.ingress instead)"
    )
