"""The model server Deployment: GPUs, volumes, probes, drain, hardened pod."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..models.disaggregation import Role
from ..models.resource import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    CACHE_DIR,
    JWKS_DIR,
    JWKS_FILE,
    MODEL_PVC_DIR,
    StreamingModel,
    pool_view,
)
from .adapters import adapter_volumes
from .args import PRESTOP_SECONDS, server_args, termination_grace_seconds
from .common import (
    PORT,
    PORT_NAME,
    container_security_context,
    endpoint_picker_labels,
    labels,
    metadata,
    pod_security_context,
    selector_labels,
)
from .continuation import continuation_volumes
from .disaggregation import (
    POOL_SUFFIX,
    shared_kv_volumes,
    side_channel_env,
    side_channel_ports,
)
from .kvevents import kv_event_ports
from .secrets import secret_env, secret_volumes
from .weights import OFFLINE_ENV, awaiting_weights, cache_of, weights_volumes

# Loading a large model (download + weights into GPU memory + CUDA graphs) takes tens of
# minutes; the startup probe holds liveness off for spec.startup.timeoutSeconds. The
# Deployment's progress deadline must be longer, or a slow first start is reported as a
# failed rollout. The probe runs every second: a pod is Ready within a second of serving
# (the kubelet probes readiness at once when the startup probe passes), where a period of
# 10 s added 5 s to an average cold start from zero; a failed `/health` costs the server
# next to nothing, and the probe stops once it passes.
STARTUP_PERIOD_SECONDS = 1
PROGRESS_MARGIN_SECONDS = 600


def startup_failure_threshold(model: StreamingModel) -> int:
    """Probes of STARTUP_PERIOD_SECONDS covering at least the startup budget."""
    return -(-model.spec.startup.timeout_seconds // STARTUP_PERIOD_SECONDS)


def progress_deadline_seconds(model: StreamingModel) -> int:
    return STARTUP_PERIOD_SECONDS * startup_failure_threshold(model) + PROGRESS_MARGIN_SECONDS


def _resources(model: StreamingModel) -> dict[str, Any]:
    r = model.spec.resources
    requests = {
        k: str(v)
        for k, v in (("cpu", r.requests.cpu), ("memory", r.requests.memory))
        if v is not None
    }
    limits = {
        k: str(v) for k, v in (("cpu", r.limits.cpu), ("memory", r.limits.memory)) if v is not None
    }
    if not model.simulated:
        # Extended resources: requests must equal limits; setting both keeps that explicit.
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(model: StreamingModel) -> list[dict[str, Any]]:
    env: dict[str, dict[str, Any]] = {
        "HOME": {"name": "HOME", "value": "/tmp"},
        "HF_HOME": {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"},
        "VLLM_CACHE_ROOT": {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        "VLLM_NO_USAGE_STATS": {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
    }
    for var in model.spec.engine.env:
        env[var.name] = var.model_dump(by_alias=True, exclude_none=True)
    # After the user's entries, so none can shadow the Secrets; never arguments.
    secret_env(model, env)
    for side in side_channel_env(model):  # a pool's NIXL side channel: the pod's own address
        env[side["name"]] = side
    if cache_of(model) is not None:  # the weights are on the claim: the Hub stays off
        for name, value in OFFLINE_ENV.items():
            env.pop(name, None)
            env[name] = {"name": name, "value": value}
    return list(env.values())


def _volumes(model: StreamingModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = model.spec
    volumes: list[dict[str, Any]] = [
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.resources.shared_memory_size)},
        },
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    cache = spec.model.cache
    if cache.pvc_name:
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": cache.pvc_name}})
    else:
        volumes.append({"name": "cache", "emptyDir": {"sizeLimit": str(cache.size_limit)}})
    src = model.source
    if src.kind == "pvc":
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": MODEL_PVC_DIR, "readOnly": True})
    ref = spec.auth.api_key_secret_ref
    if ref:
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": API_KEYS_FILE}],
                    "defaultMode": 0o440,
                },
            }
        )
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    jwt = spec.auth.jwt
    if jwt:
        # A whole-volume mount (no subPath), so the kubelet's updates reach the pod and the
        # server reloads the keys without a restart.
        jwks_ref = jwt.jwks.secret_ref or jwt.jwks.config_map_ref
        assert jwks_ref is not None  # the CRD and validation require exactly one
        items = {"items": [{"key": jwks_ref.key, "path": JWKS_FILE}], "defaultMode": 0o440}
        if jwt.jwks.secret_ref:
            volumes.append({"name": "jwks", "secret": {"secretName": jwks_ref.name, **items}})
        else:
            volumes.append({"name": "jwks", "configMap": {"name": jwks_ref.name, **items}})
        mounts.append({"name": "jwks", "mountPath": JWKS_DIR, "readOnly": True})
    # The HF token and the Redis URL, as files.
    secret_vols, secret_mounts = secret_volumes(model)
    # The adapter list's ConfigMap (by name only: its content changes without a rollout).
    more_volumes, more_mounts = adapter_volumes(model)
    # spec.model.cache.weights: the ready commit's folder of the shared claim, read-only.
    cached_volumes, cached_mounts = weights_volumes(model)
    # A router model's continuation key (streams that outlive their pod).
    key_volumes, key_mounts = continuation_volumes(model)
    # A disaggregated pool's shared-storage connector volume.
    kv_volumes, kv_mounts = shared_kv_volumes(model)
    return (
        volumes + secret_vols + more_volumes + cached_volumes + kv_volumes + key_volumes,
        mounts + secret_mounts + more_mounts + cached_mounts + kv_mounts + key_mounts,
    )


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def pod_annotations(model: StreamingModel) -> dict[str, str]:
    return {
        **model.spec.pod_annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }


def pod_template(model: StreamingModel) -> dict[str, Any]:
    """The server pod: the Deployment's, and a LeaderWorkerSet group's leader
    (`builders/leaderworkerset.py` derives the worker from it)."""
    spec = model.spec
    volumes, mounts = _volumes(model)
    container: dict[str, Any] = {
        "name": "server",
        "image": model.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["sluice-server"],
        "args": server_args(model),
        "ports": [
            {"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"},
            *kv_event_ports(model),
            *side_channel_ports(model),
        ],
        "env": _env(model),
        "resources": _resources(model),
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", STARTUP_PERIOD_SECONDS, startup_failure_threshold(model)),
        "readinessProbe": _probe("/ready", 5, 2),
        "livenessProbe": _probe("/health", 15, 4),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(model),
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
    }
    r = spec.resources
    optional = {
        "serviceAccountName": spec.service_account_name,
        "priorityClassName": r.priority_class_name,
        "nodeSelector": dict(r.node_selector) or None,
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in r.tolerations]
        or None,
        "affinity": r.affinity,
        "imagePullSecrets": [{"name": s.name} for s in spec.image_pull_secrets] or None,
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    return {
        "metadata": {
            # podLabels may change the EPP's labels (a role), never the operator's own.
            "labels": {**endpoint_picker_labels(model), **spec.pod_labels, **labels(model)},
            "annotations": pod_annotations(model),
        },
        "spec": pod_spec,
    }


def desired_deployment(model: StreamingModel) -> dict[str, Any] | None:
    """None with parallelism.nodes > 1: a LeaderWorkerSet runs the replicas instead; with
    spec.disaggregation, whose pools are Deployments of their own (`desired_pool_deployment`);
    and for a model of the weights cache before its first commit is ready (no pod could
    start)."""
    if model.multi_node or model.disaggregated:
        return None
    return _deployment(model)


def desired_pool_deployment(role: Role) -> Callable[[StreamingModel], dict[str, Any] | None]:
    """The builder of a disaggregated model's pool `role`: Deployment `<name>-<role>`, its
    pods labelled (and selected) by serving.sluice.dev/role; None for other models."""

    def build(model: StreamingModel) -> dict[str, Any] | None:
        if not model.disaggregated:
            return None
        d = model.spec.disaggregation
        assert d is not None
        out = _deployment(pool_view(model, role))
        if out is not None:
            out["metadata"]["name"] = model.name + POOL_SUFFIX[role]
            if d.pool(role).autoscaling is not None:  # its HPA owns .spec.replicas
                out["spec"].pop("replicas", None)
        return out

    return build


def _deployment(model: StreamingModel) -> dict[str, Any] | None:
    if awaiting_weights(model):
        return None
    spec = model.spec
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(model)},
        # Default surge 1 / unavailable 0: the old pods serve until the new one has loaded
        # its model (minutes). maxSurge 0 replaces in place where no GPU is free for a surge.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": progress_deadline_seconds(model),
        "template": pod_template(model),
    }
    # With autoscaling the HPA owns .spec.replicas; leaving it out of the apply lets the
    # HPA's value stand instead of being reset on every reconcile.
    if not spec.autoscaling_enabled:
        deployment_spec["replicas"] = spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(model),
        "spec": deployment_spec,
    }
