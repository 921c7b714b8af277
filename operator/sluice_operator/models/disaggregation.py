"""Disaggregated serving (`disaggregation`): prefill and decode on separate pools of one
model, the KV cache handed from a prefill pod to a decode pod by one of vLLM's KV
connectors, and the router doing the two steps (docs/disaggregation.md, "Operator").

Each pool is a Deployment of its own (`<name>-prefill`, `<name>-decode`) with its replicas,
GPUs, tensor parallelism and autoscaler: prefill scales on time to first token, decode on
inter-token latency. Neither pool scales to zero: a request needs a pod of each, and the
activator's hold (which wakes one workload) has no second step, so `minReplicas` is at least
1 (a rule refuses 0, and spec.autoscaling, whose minReplicas may be 0, is refused with
disaggregation).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ApiModel, Rule
from .refs import Name

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class SharedStorageSpec(ApiModel):
    """Where the shared-storage connector writes and reads the KV cache."""

    claim_name: Name = Field(
        description="A ReadWriteMany PersistentVolumeClaim in the model's namespace, mounted "
        "read-write in every pod of both pools: prefill pods write each prompt's KV there and "
        "decode pods read it. The operator does not create it."
    )


class ConnectorSpec(ApiModel):
    """The KV connector both pools' engines run (vLLM's KVTransferConfig: NIXL as kv_producer on prefill pods and kv_consumer on decode pods, shared storage kv_both)."""

    RULES = (
        Rule(
            "has(self.type) && self.type == 'sharedStorage' ? has(self.sharedStorage) : "
            "!has(self.sharedStorage)",
            "disaggregation.connector.type sharedStorage needs disaggregation.connector."
            "sharedStorage.claimName (a ReadWriteMany PersistentVolumeClaim both pools mount); "
            "sharedStorage is only used with type sharedStorage",
            holds=lambda c: (c.type == "sharedStorage") == (c.shared_storage is not None),
            field=".sharedStorage",
        ),
    )

    type: Literal["nixl", "sharedStorage"] = Field(
        default="nixl",
        description="nixl (default): vLLM's NixlConnector; a decode pod pulls the KV blocks "
        "from the prefill pod over NIXL (RDMA or TCP on GPUs), asking the prefill pod's side "
        "channel (port 5600, VLLM_NIXL_SIDE_CHANNEL_PORT) for them; the operator opens that "
        "port between the two pools only. sharedStorage: vLLM's ExampleConnector, which "
        "writes every prompt's KV to files on a shared volume and loads them on decode: the "
        "CPU and testing path (it never deletes what it wrote), not for production.",
    )
    shared_storage: SharedStorageSpec | None = Field(
        default=None, description="With type sharedStorage: the volume (required then)."
    )


class PoolAutoscalingSpec(ApiModel):
    """A pool's HorizontalPodAutoscaler: prefill on time to first token, decode on
    inter-token latency, each per pod at `percentile` (prometheus-adapter with the operator
    chart's rules)."""

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest replicas; at least 1: a disaggregated pool never scales to zero "
        "(a rule refuses 0).",
    )
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Most replicas.")
    target_milliseconds: int = Field(
        default=500,
        ge=1,
        le=600000,
        description="Target per pod at `percentile`, in milliseconds: time to first token on "
        "the prefill pool (sluice_ttft_pNN_seconds), inter-token latency on the decode pool "
        "(sluice_itl_pNN_seconds).",
    )
    percentile: Literal[0.5, 0.75, 0.9, 0.95, 0.99] = Field(  # type: ignore[valid-type]
        default=0.9, description="Which percentile the target applies to."
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Scale-up stabilization window in seconds."
    )
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600, description="Scale-down stabilization window in seconds."
    )


class PoolSpec(ApiModel):
    """One pool's size and shape; what it does not set comes from the model's spec
    (resources, parallelism, engine, adapters: LoRA adapters are loaded on both pools)."""

    replicas: int = Field(
        default=1, ge=1, le=1000, description="Replicas when the pool has no autoscaling."
    )
    gpus: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs per pod of this pool; unset: resources.gpus. tensor x "
        "parallelism.pipeline must equal it.",
    )
    tensor: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Tensor-parallel size of this pool; unset: parallelism.tensor.",
    )
    autoscaling: PoolAutoscalingSpec | None = Field(
        default=None, description="The pool's autoscaler; unset: fixed replicas."
    )


class DisaggregationSpec(ApiModel):
    """Prefill and decode on separate pools, the KV cache handed over by a connector."""

    connector: ConnectorSpec = Field(
        default_factory=ConnectorSpec,
        description="The KV connector (NIXL by default).",
        json_schema_extra={"default": {}},
    )
    prefill: PoolSpec = Field(
        default_factory=PoolSpec,
        description="The prefill pool: runs each prompt (max_tokens 1) and hands its KV over.",
        json_schema_extra={"default": {}},
    )
    decode: PoolSpec = Field(
        default_factory=PoolSpec,
        description="The decode pool: streams the answer from the handed-over KV.",
        json_schema_extra={"default": {}},
    )

    def pool(self, role: Role) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode


# Rules on the whole spec (StreamingModelSpec.RULES).
_ON = "has(self.disaggregation)"


def _pool_fits(s: object, role: Role) -> bool:
    d = s.disaggregation  # type: ignore[attr-defined]
    if d is None or s.parallelism.nodes > 1:  # type: ignore[attr-defined]
        return True  # several nodes: refused by a rule of their own
    pool = d.pool(role)
    gpus = pool.gpus or s.resources.gpus  # type: ignore[attr-defined]
    tensor = pool.tensor or s.parallelism.tensor  # type: ignore[attr-defined]
    return bool(tensor * s.parallelism.pipeline == gpus)  # type: ignore[attr-defined]


def _pool_bounds(s: object, role: Role) -> bool:
    d = s.disaggregation  # type: ignore[attr-defined]
    a = d.pool(role).autoscaling if d is not None else None
    return a is None or a.min_replicas <= a.max_replicas


def _pool_bounds_rule(role: Role) -> Rule:
    a = f"self.disaggregation.{role}.autoscaling"
    return Rule(
        f"!{_ON} || !has(self.disaggregation.{role}) || !has({a}) || "
        f"(has({a}.minReplicas) ? {a}.minReplicas : 1) <= "
        f"(has({a}.maxReplicas) ? {a}.maxReplicas : 4)",
        f"disaggregation.{role}.autoscaling.minReplicas must not exceed maxReplicas",
        holds=lambda s: _pool_bounds(s, role),
        field=f".disaggregation.{role}.autoscaling.minReplicas",
        detail=lambda s: "got minReplicas {0.min_replicas}, maxReplicas {0.max_replicas}".format(
            s.disaggregation.pool(role).autoscaling
        ),
    )


def _pool_min(s: object, role: Role) -> bool:
    d = s.disaggregation  # type: ignore[attr-defined]
    a = d.pool(role).autoscaling if d is not None else None
    return a is None or a.min_replicas >= 1


def _pool_zero_rule(role: Role) -> Rule:
    a = f"self.disaggregation.{role}.autoscaling"
    return Rule(
        f"!{_ON} || !has(self.disaggregation.{role}) || !has({a}) || !has({a}.minReplicas) || "
        f"{a}.minReplicas >= 1",
        f"disaggregation.{role}.autoscaling.minReplicas must be at least 1: disaggregated "
        "pools do not scale to zero (every request needs a prefill and a decode pod, and "
        "the activator wakes one workload)",
        holds=lambda s: _pool_min(s, role),
        field=f".disaggregation.{role}.autoscaling.minReplicas",
    )


def _fit_detail(s: object, role: Role) -> str:
    pool = s.disaggregation.pool(role)  # type: ignore[attr-defined]
    gpus = pool.gpus or s.resources.gpus  # type: ignore[attr-defined]
    tensor = pool.tensor or s.parallelism.tensor  # type: ignore[attr-defined]
    pipeline = s.parallelism.pipeline  # type: ignore[attr-defined]
    fix = f"set tensor: {gpus // pipeline}" if gpus % pipeline == 0 else "change gpus"
    return f"got tensor {tensor} x pipeline {pipeline} = {tensor * pipeline} and gpus {gpus}; {fix}"


def _pool_rule(role: Role) -> Rule:
    p = f"self.disaggregation.{role}"
    return Rule(
        f"!{_ON} || !has({p}) || (has(self.parallelism.nodes) && self.parallelism.nodes > 1) "
        f"|| (has({p}.tensor) ? {p}.tensor : self.parallelism.tensor) * "
        f"self.parallelism.pipeline == (has({p}.gpus) ? {p}.gpus : self.resources.gpus)",
        f"disaggregation.{role}: tensor (else parallelism.tensor) x parallelism.pipeline must "
        f"equal gpus (else resources.gpus)",
        holds=lambda s: _pool_fits(s, role),
        field=f".disaggregation.{role}",
        detail=lambda s: _fit_detail(s, role),
    )


DISAGGREGATION_RULES = (
    Rule(
        f"!{_ON} || (has(self.routing) && has(self.routing.router) && "
        "has(self.routing.router.enabled) && self.routing.router.enabled)",
        "disaggregation needs routing.router.enabled: the router sends each request to a "
        "prefill pod, then to a decode pod with the KV the prefill handed over",
        holds=lambda s: s.disaggregation is None or s.routing.router.enabled,
        field=".disaggregation",
    ),
    Rule(
        f"!{_ON} || !has(self.routing.router.migration) || "
        "!has(self.routing.router.migration.enabled) || self.routing.router.migration.enabled",
        "disaggregation needs the router's model key on the pods, which routing.router."
        "migration mounts: it authenticates the router's prefill requests and KV hand-overs; "
        "do not set routing.router.migration.enabled to false",
        holds=lambda s: s.disaggregation is None or s.routing.router.migration.enabled,
        field=".routing.router.migration.enabled",
    ),
    Rule(
        f"!{_ON} || !has(self.parallelism.nodes) || self.parallelism.nodes == 1",
        "disaggregation runs each pool's replica on one node: parallelism.nodes must be 1 "
        "(multi-node pools are not supported)",
        holds=lambda s: s.disaggregation is None or s.parallelism.nodes == 1,
        field=".disaggregation",
    ),
    Rule(
        f"!{_ON} || !has(self.autoscaling)",
        "with disaggregation each pool scales on its own: set disaggregation.prefill."
        "autoscaling and disaggregation.decode.autoscaling instead of autoscaling",
        holds=lambda s: s.disaggregation is None or s.autoscaling is None,
        field=".autoscaling",
    ),
    _pool_rule("prefill"),
    _pool_rule("decode"),
    _pool_bounds_rule("prefill"),
    _pool_bounds_rule("decode"),
    _pool_zero_rule("prefill"),
    _pool_zero_rule("decode"),
)
