"""Names, labels and small helpers every builder shares (docs/design.md, "Labels")."""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel

PORT = 8000
PORT_NAME = "http"
MANAGER = "sluice-operator"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# The hash of the manifest the operator last applied, on every child (reconcile.py).
HASH_ANNOTATION = "serving.sluice.dev/applied-hash"
# A disaggregated model's pool (spec.disaggregation): prefill or decode, on its pods and
# in its Deployment's selector.
POOL_ROLE_LABEL = "serving.sluice.dev/role"
# The serving image runs as this non-root user (fsGroup makes the cache and secrets readable).
RUN_AS = 65532


def pod_security_context() -> dict[str, Any]:
    """The pod-level security context of every pod the operator renders (model pods and the
    weights Jobs): the image's non-root user, whose group owns mounted volumes."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The hardened container security context of those pods' containers."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def selector_labels(model: StreamingModel) -> dict[str, str]:
    """The immutable Deployment selector: never add to it (changing it needs a new Deployment).
    A pool's view (`pool_view`) adds its role: its own Deployment, never the model's."""
    out = {NAME_LABEL: "sluice-server", INSTANCE_LABEL: model.name}
    if model.role is not None:
        out[POOL_ROLE_LABEL] = model.role
    return out


def serving_pods(model: StreamingModel) -> dict[str, str]:
    """What to add to the model's selector for the pods that answer its clients: a
    disaggregated model's decode pool (its prefill pods answer the router only)."""
    return {POOL_ROLE_LABEL: "decode"} if model.disaggregated else {}


def labels(model: StreamingModel) -> dict[str, str]:
    return {
        **selector_labels(model),
        MANAGED_BY_LABEL: MANAGER,
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/part-of": "sluice",
    }


# The pod labels an endpoint picker reads (llm-d-router's metrics extractor picks its metric
# mapping by engine type, falling back to GAIE's older `inference.networking.k8s.io/
# engine-type`; its role filters keep `both` for a pod that does prefill and decode).
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ROLE_LABEL = "llm-d.ai/role"


def endpoint_picker_labels(model: StreamingModel) -> dict[str, str]:
    """On the vLLM pods of a model with an InferencePool (whose /metrics carry the `vllm:*`
    gauges an EPP reads). None without the pool: an operator upgrade then changes (and
    rolls) no other model's pods. None on the simulator, which an EPP could not read."""
    if model.simulated or not model.spec.routing.inference_pool.enabled:
        return {}
    return {ENGINE_TYPE_LABEL: "vllm", ROLE_LABEL: "both"}


def metadata(model: StreamingModel, **extra: Any) -> dict[str, Any]:
    return {"name": model.name, "namespace": model.namespace, "labels": labels(model), **extra}


def selector_string(model: StreamingModel) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(model).items())


def fmt_number(value: float) -> str:
    """0.92 -> '0.92', 16.0 -> '16' (flags and annotations are strings)."""
    return f"{value:g}"
