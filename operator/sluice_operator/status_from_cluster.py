"""Status from what the cluster shows: a pure function of the Deployment, its pods, the
Ingress, the HPA and the optional kinds (`kinds.OPTIONAL_KINDS`), built in `compute_status`.

Phases: Failed (spec invalid, or no replica ready and the rollout is stuck or crashing),
Pending (pods cannot be scheduled, e.g. no free GPUs; or scaled to zero), Progressing
(creating, loading the model, rolling out), Degraded (serving, but fewer replicas ready than
wanted and not because of a rollout), Ready (all wanted replicas ready, rollout done).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .builders.common import selector_string
from .builders.continuation import MIGRATION_CONDITION, migration_verdict
from .builders.gateway import route_url
from .builders.hpa import POOL_HISTOGRAM, ttft_metric_name
from .builders.ingress import ingress_url
from .builders.metrics import latency_metric_name
from .builders.routing import backend_verdict, router_verdict
from .builders.service import service_url
from .kinds import GATEWAY_API_INFERENCE_EXTENSION, OPTIONAL_KINDS, OptionalKind, Unavailable
from .models.disaggregation import ROLES
from .models.resource import StreamingModel
from .models.status import ConditionType

# Container states that will not fix themselves without a change (image, args, secrets).
STUCK_REASONS = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
}


def _cond(type_: ConditionType, ok: bool | None, reason: str, message: str) -> dict[str, str]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _dep_condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for c in (deployment.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def pod_problems(pods: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """(unschedulable messages, stuck container messages), one per distinct cause."""
    unschedulable: list[str] = []
    stuck: list[str] = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        st = pod.get("status") or {}
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                msg = f"pod {name} cannot be scheduled: {c.get('message') or c.get('reason', 'Unschedulable')}"
                unschedulable.append(msg)
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                detail = waiting.get("message") or ""
                stuck.append(f"pod {name}: {waiting['reason']}{': ' + detail if detail else ''}")
    return unschedulable, stuck


_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


def quantity_seconds_to_ms(value: str | int | float | None) -> int | None:
    """HPA averageValue in seconds ("250m", "1", "1500m") -> whole milliseconds."""
    if value is None:
        return None
    text = str(value).strip()
    suffix = text[-1] if text and text[-1] in "numkMG" else ""
    try:
        number = float(text[: len(text) - len(suffix)])
    except ValueError:
        return None
    return round(number * _SUFFIX[suffix] * 1000)


def autoscaling_status(
    model: StreamingModel, hpa: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The HPA's last reading and decision, so `kubectl get sm -o wide` shows TTFT."""
    a = model.spec.autoscaling
    if a is None or not a.enabled:
        return None
    metric = ttft_metric_name(a.ttft_percentile)
    out: dict[str, Any] = {
        "backend": a.backend,
        "metric": metric,
        "targetTTFTMilliseconds": a.target_ttft_milliseconds,
    }
    st = (hpa or {}).get("status") or {}
    for key in ("currentReplicas", "desiredReplicas", "lastScaleTime"):
        if st.get(key) is not None:
            out[key] = st[key]
    for m in st.get("currentMetrics") or []:
        # Our HPA: the Pods metric by name. KEDA's HPA (backend keda): the External metric
        # of the one trigger, whose averageValue is the same per-pod average.
        reading = m.get("pods") if a.backend == "hpa" else m.get("external")
        reading = reading or {}
        name = (reading.get("metric") or {}).get("name") or ""
        if name == metric or (a.backend == "keda" and name.endswith("-prometheus")):
            ms = quantity_seconds_to_ms((reading.get("current") or {}).get("averageValue"))
            if ms is not None:
                out["currentTTFTMilliseconds"] = ms
    problems = [
        c.get("message") or c.get("reason", "")
        for c in st.get("conditions") or []
        if c.get("type") in ("AbleToScale", "ScalingActive") and c.get("status") == "False"
    ]
    if problems:
        out["message"] = "; ".join(problems)[:1024]
    return out


def urls(
    model: StreamingModel, ingress: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, str]]:
    base = ingress_url(model) or route_url(model)
    if base and "<ingress-address>" in base and ingress:
        lb = ((ingress.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        address = lb and (lb[0].get("hostname") or lb[0].get("ip"))
        if address:
            base = base.replace("<ingress-address>", address)
    base = base or service_url(model)
    ws_base = "ws" + base.removeprefix("http")
    endpoints = {"openai": f"{base}/v1"}
    protocols = model.spec.streaming.protocols
    if "sse" in protocols:
        endpoints["sse"] = f"{base}/v1/stream"
    else:
        endpoints.pop("openai")  # the OpenAI routes stream over SSE
    if "websocket" in protocols:
        endpoints["websocket"] = f"{ws_base}/ws/stream"
    if "responses" in protocols:
        endpoints["responses"] = f"{base}/v1/responses"
    if "anthropic" in protocols:
        endpoints["anthropic"] = f"{base}/v1/messages"
    return base, endpoints


def _stamp(
    conditions: list[dict[str, Any]],
    previous: Iterable[Mapping[str, Any]],
    now: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """Keep lastTransitionTime when a condition's status did not change."""
    before = {c.get("type"): c for c in previous or []}
    for c in conditions:
        old = before.get(c["type"])
        if old is not None and old.get("status") == c["status"]:
            c["lastTransitionTime"] = old.get("lastTransitionTime", now)
        else:
            c["lastTransitionTime"] = now
        if generation is not None:
            c["observedGeneration"] = generation
    return conditions


def _condition_of(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def migrated(status: Mapping[str, Any]) -> bool:
    """Whether the status says the model's streams migrated on the last pass (so its
    continuation-key Secret may exist)."""
    return (_condition_of(status, MIGRATION_CONDITION) or {}).get("status") == "True"


def key_forbidden(status: Mapping[str, Any]) -> bool:
    """Whether the status already says the model's continuation Secret was refused."""
    return (_condition_of(status, MIGRATION_CONDITION) or {}).get("reason") == "Forbidden"


def remembered(optional: OptionalKind, status: Mapping[str, Any]) -> bool:
    """Whether the status says the last pass wanted this kind (so one may still exist)."""
    if optional.condition is None:
        return (status.get("autoscaling") or {}).get("backend") == "keda"
    return _condition_of(status, optional.condition) is not None


def reported(optional: OptionalKind, status: Mapping[str, Any]) -> str | None:
    """What the status says about this kind: its condition's message, or the autoscaling one."""
    if optional.condition is None:
        return (status.get("autoscaling") or {}).get("message")
    return (_condition_of(status, optional.condition) or {}).get("message")


def optional_condition(
    optional: OptionalKind,
    model: StreamingModel,
    live: Mapping[str, Any] | None,
    unavailable: Unavailable | None = None,
) -> dict[str, str]:
    """The kind's condition: why it cannot be reached, else what its `ready` reads."""
    assert optional.condition is not None and optional.ready is not None
    if unavailable is not None:
        return _cond(optional.condition, False, unavailable.reason, unavailable.message)
    return _cond(optional.condition, *optional.ready(model, live))


TEMPLATE_CONDITION: ConditionType = "TemplateCurrent"


def with_template_wait(
    status: dict[str, Any],
    message: str,
    previous: Mapping[str, Any],
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """Add TemplateCurrent=False: the operator's release changes this model's pod template
    and the model waits for a rollout slot (`pacing.py`); absent otherwise."""
    cond = _cond(TEMPLATE_CONDITION, False, "WaitingForRolloutSlot", message)
    return with_condition(status, cond, previous, now, generation)


def was_waiting(previous: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == TEMPLATE_CONDITION and c.get("status") == "False"
        for c in previous.get("conditions") or []
    )


def with_condition(
    status: dict[str, Any],
    cond: dict[str, str],
    previous: Mapping[str, Any],
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """Add one more condition to a computed status (lastTransitionTime kept as usual)."""
    stamped = _stamp([dict(cond)], previous.get("conditions") or [], now, generation)
    return {**status, "conditions": [*status.get("conditions", []), *stamped]}


def invalid_status(
    message: str, generation: int | None, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    previous = previous or {}
    conditions = [
        _cond("SpecValid", False, "InvalidSpec", message),
        _cond("Ready", False, "InvalidSpec", "fix the spec (see SpecValid)"),
    ]
    # Available/Progressing describe running pods, which an invalid spec does not change.
    for c in previous.get("conditions") or []:
        if c.get("type") in ("Available", "Progressing"):
            conditions.append({k: c[k] for k in ("type", "status", "reason", "message") if k in c})
    return {
        "phase": "Failed",
        "message": message,
        "observedGeneration": generation,
        "conditions": _stamp(conditions, previous.get("conditions") or [], now, generation),
    }


def status_patch(current: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `current` into `new`; empty when equal.

    Nested objects are diffed key by key, so a key that vanished from `new` (at any depth:
    `autoscaling.message`, one entry of `endpoints`, all of `autoscaling`) becomes `null`,
    which deletes it. Lists (conditions) are replaced whole, as RFC 7386 does. A `None` in
    `new` means "absent". Sending the whole new status as a merge patch instead only ever
    adds keys: a vanished one stays forever and the status differs on every pass.
    """
    patch: dict[str, Any] = {}
    for key in current.keys() | new.keys():
        have, want = current.get(key), new.get(key)
        if want is None:
            if have is not None:
                patch[key] = None
        elif isinstance(want, Mapping) and isinstance(have, Mapping):
            sub = status_patch(have, want)
            if sub:
                patch[key] = sub
        elif want != have:
            patch[key] = _without_nulls(want)
    return patch


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _rolling(deployment: Mapping[str, Any]) -> bool:
    """A rollout is under way: new spec not yet seen, not all pods updated, old ones left."""
    dspec = deployment.get("spec") or {}
    dstat = deployment.get("status") or {}
    desired = dspec.get("replicas", 1)
    dgen = (deployment.get("metadata") or {}).get("generation")
    seen = dstat.get("observedGeneration")
    return (
        (dgen is not None and seen is not None and seen < dgen)
        or dstat.get("updatedReplicas", 0) < desired
        or dstat.get("replicas", 0) > desired  # old pods still terminating, or a surge pod
    )


def deployment_settled(deployment: Mapping[str, Any]) -> bool:
    """All wanted replicas ready and no rollout under way: the pods have nothing to explain."""
    desired = (deployment.get("spec") or {}).get("replicas", 1)
    ready = (deployment.get("status") or {}).get("readyReplicas", 0)
    return ready >= desired and not _rolling(deployment)


def combined_workload(
    pools: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, Any] | None:
    """A disaggregated model's two Deployments as one for the model's phase: replica counts
    summed, the oldest observed generation, a failed progress condition from either. Ready
    replicas never exceed the desired ones without a pod too many (a rolling pool), so
    "every pool ready" is "the sum ready and nothing rolling". None while either is missing."""
    if any(d is None for d in pools.values()):
        return None
    deps = [d for d in pools.values() if d is not None]
    counts = ("replicas", "readyReplicas", "updatedReplicas")
    status: dict[str, Any] = {
        k: sum((d.get("status") or {}).get(k, 0) for d in deps) for k in counts
    }
    failed = [
        c
        for d in deps
        for c in (d.get("status") or {}).get("conditions") or []
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
    ]
    status["conditions"] = failed[:1]
    behind = [
        d for d in deps
        if (d.get("status") or {}).get("observedGeneration", 0)
        < (d.get("metadata") or {}).get("generation", 0)
    ]  # fmt: skip
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": sum((d.get("spec") or {}).get("replicas", 1) for d in deps)},
        "status": {**status, "observedGeneration": 0 if behind else 1},
    }


def pools_status(
    model: StreamingModel,
    pools: Mapping[str, Mapping[str, Any] | None],
    hpas: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, Any]:
    """status.pools: each pool's counts and its HPA's reading."""
    d = model.spec.disaggregation
    assert d is not None
    out: dict[str, Any] = {}
    for role in ROLES:
        dep = pools.get(role) or {}
        a = d.pool(role).autoscaling
        floor = a.min_replicas if a is not None else d.pool(role).replicas
        desired = (dep.get("spec") or {}).get("replicas", floor)
        st = dep.get("status") or {}
        ready = st.get("readyReplicas", 0)
        entry: dict[str, Any] = {
            "replicas": st.get("replicas", 0),
            "readyReplicas": ready,
            "ready": f"{ready}/{desired}",
        }
        if a is not None:
            metric = latency_metric_name(POOL_HISTOGRAM[role], a.percentile)
            entry["metric"] = metric
            for m in ((hpas.get(role) or {}).get("status") or {}).get("currentMetrics") or []:
                reading = m.get("pods") or {}
                if (reading.get("metric") or {}).get("name") == metric:
                    value = (reading.get("current") or {}).get("averageValue")
                    ms = quantity_seconds_to_ms(value)
                    if ms is not None:
                        entry["currentMilliseconds"] = ms
        out[role] = entry
    return out


def compute_status(
    model: StreamingModel,
    generation: int | None,
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]] = (),
    ingress: Mapping[str, Any] | None = None,
    previous: Mapping[str, Any] | None = None,
    now: str = "",
    hpa: Mapping[str, Any] | None = None,
    optional: Mapping[str, Mapping[str, Any] | None] | None = None,
    unavailable: Mapping[str, Unavailable] | None = None,
    pools: Mapping[str, Mapping[str, Any] | None] | None = None,
    pool_hpas: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The whole status of a pass: the Deployment, its pods, the Ingress and the HPA as
    observed, then each of `kinds.OPTIONAL_KINDS` the model wants (`optional`: kind -> the
    object as stored) or cannot reach (`unavailable`: kind -> why). A disaggregated model's
    two Deployments come as `pools` (role -> Deployment) instead of `deployment`, their HPAs
    as `pool_hpas`."""
    previous = previous or {}
    optional = optional or {}
    unavailable = unavailable or {}
    if pools is not None:
        deployment = combined_workload(pools)
    out = _compute_status(model, generation, deployment, pods, ingress, previous, now, hpa)
    if pools is not None:
        out["pools"] = pools_status(model, pools, pool_hpas or {})
        if deployment is not None:
            each = ", ".join(f"{role} {p['ready']}" for role, p in out["pools"].items())
            out["message"] = f"{out['message']} ({each})"
    conditions = []
    for row in OPTIONAL_KINDS:
        problem = unavailable.get(row.name)
        if row.condition is not None:
            # An unwanted kind that excludes a child stays reported while its delete is
            # refused: the status remembers it, so the next pass tries again.
            if row.wanted(model) or (problem is not None and row.excludes is not None):
                conditions.append(optional_condition(row, model, optional.get(row.name), problem))
        elif problem is not None:  # the ScaledObject: status.autoscaling reports it
            scaling = {**(out.get("autoscaling") or {}), "message": problem.message}
            if not row.wanted(model):
                scaling["backend"] = "keda"  # a ScaledObject may still exist: keep cleaning up
            out["autoscaling"] = scaling
    routed = model.spec.gateway is not None or (
        model.spec.ingress.enabled and (model.spec.scale_to_zero is not None or model.routed)
    )
    if routed:  # the route's one backend (builders/routing.py)
        pool = unavailable.get(GATEWAY_API_INFERENCE_EXTENSION.name)
        verdict = backend_verdict(model, pool.message if pool else None)
        conditions.append(_cond("RouteBackend", *verdict))
    if model.routed:
        conditions.append(_cond("RouterReady", *router_verdict(model)))
    migration = migration_verdict(model, forbidden=MIGRATION_CONDITION in unavailable)
    if migration is not None:
        conditions.append(_cond(MIGRATION_CONDITION, *migration))
    out["conditions"] += _stamp(conditions, previous.get("conditions") or [], now, generation)
    return out


def _compute_status(
    model: StreamingModel,
    generation: int | None,
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    ingress: Mapping[str, Any] | None,
    previous: Mapping[str, Any],
    now: str,
    hpa: Mapping[str, Any] | None,
) -> dict[str, Any]:
    url, endpoints = urls(model, ingress)
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "selector": selector_string(model),
        "url": url,
        "endpoints": endpoints,
    }
    scaling = autoscaling_status(model, hpa)
    if scaling is not None:
        out["autoscaling"] = scaling
    spec_ok = _cond("SpecValid", True, "Valid", "spec is valid")

    # A multi-node model's LeaderWorkerSet counts replicas in groups of pods.
    workload, unit = (
        ("LeaderWorkerSet", "groups") if model.multi_node else ("Deployment", "replicas")
    )
    if model.disaggregated:
        workload = "prefill and decode Deployments"
    if deployment is None:
        a = model.spec.autoscaling
        desired = max(1, a.min_replicas) if a is not None and a.enabled else model.spec.replicas
        d = model.spec.disaggregation
        if d is not None:
            desired = sum(
                p.autoscaling.min_replicas if p.autoscaling else p.replicas
                for p in (d.prefill, d.decode)
            )
        out.update(phase="Pending", message=f"creating the {workload}", replicas=0, readyReplicas=0)
        out["ready"] = f"0/{desired}"
        missing = f"the {workload} does not exist yet"
        conditions = [
            spec_ok,
            _cond("Available", False, f"{workload}Missing", missing),
            _cond("Progressing", True, "Creating", f"creating the {workload}"),
            _cond("Ready", False, f"{workload}Missing", missing),
        ]
        out["conditions"] = _stamp(conditions, previous.get("conditions") or [], now, generation)
        return out

    dspec = deployment.get("spec") or {}
    dstat = deployment.get("status") or {}
    desired = dspec.get("replicas", 1)
    current = dstat.get("replicas", 0)
    ready = dstat.get("readyReplicas", 0)
    updated = dstat.get("updatedReplicas", 0)
    progressing = _dep_condition(deployment, "Progressing")
    deadline = progressing.get("reason") == "ProgressDeadlineExceeded"
    rolling = _rolling(deployment)
    unschedulable, stuck = pod_problems(pods)
    # A surge rollout whose new pod finds no room: every old replica still serves.
    waiting_for_room = rolling and ready >= desired > 0 and unschedulable and not stuck

    out.update(replicas=current, readyReplicas=ready, ready=f"{ready}/{desired}")
    if desired == 0:
        phase, message = "Pending", "scaled to 0 replicas"
    elif ready >= desired and not rolling:
        phase, message = "Ready", f"{ready}/{desired} {unit} ready"
    elif waiting_for_room:
        phase = "Progressing"
        message = (
            f"rollout waiting: the new pod cannot be scheduled, {ready}/{desired} old replicas "
            "keep serving; " + "; ".join(unschedulable[:3]) + " (free a GPU, or set "
            "spec.rollout.maxSurge: 0 and maxUnavailable: 1 to replace pods in place)"
        )
    elif ready > 0 and (stuck or deadline or unschedulable):
        phase = "Degraded"
        message = f"{ready}/{desired} {unit} ready; " + "; ".join(
            (stuck or unschedulable)[:3] or ["rollout stuck"]
        )
    elif stuck or deadline:
        phase = "Failed"
        message = "; ".join(stuck[:3]) or progressing.get(
            "message", "rollout exceeded its progress deadline"
        )
    elif unschedulable:
        phase, message = "Pending", "; ".join(unschedulable[:3])
    elif rolling:
        phase, message = (
            "Progressing",
            f"rolling out: {updated}/{desired} updated, {ready}/{desired} ready",
        )
    elif ready > 0:
        phase, message = "Degraded", f"{ready}/{desired} {unit} ready"
    else:
        phase, message = "Progressing", f"0/{desired} {unit} ready (starting, loading the model)"
    out.update(phase=phase, message=message)

    if deadline:
        prog = _cond(
            "Progressing", False, "ProgressDeadlineExceeded", progressing.get("message", message)
        )
    elif phase == "Failed":
        prog = _cond("Progressing", False, "ContainersFailing", message)
    elif waiting_for_room:
        prog = _cond("Progressing", True, "SurgePodUnschedulable", message)
    elif rolling or phase == "Progressing":
        prog = _cond("Progressing", True, "RollingOut", message)
    elif phase == "Pending" and desired > 0:
        prog = _cond("Progressing", True, "WaitingForPods", message)
    else:
        prog = _cond("Progressing", False, "RolloutComplete", "the latest spec is rolled out")
    conditions = [
        spec_ok,
        _cond(
            "Available",
            ready > 0,
            "ReplicasAvailable" if ready > 0 else "NoReplicasReady",
            f"{ready} replica(s) serving" if ready > 0 else message,
        ),
        prog,
        _cond(
            "Ready", phase == "Ready", phase if phase != "Ready" else "AllReplicasReady", message
        ),
    ]
    out["conditions"] = _stamp(conditions, previous.get("conditions") or [], now, generation)
    return out
