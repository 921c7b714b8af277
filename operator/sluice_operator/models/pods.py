"""A replica's pods: their GPUs, CPU, memory and placement (`resources`), how the model is
split over GPUs and nodes (`parallelism`), the startup budget (`startup`) and how a spec
change replaces them (`rollout`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .base import ApiModel, FreeForm, Quantity, Rule
from .refs import Name


class Toleration(ApiModel):
    """A Kubernetes toleration (same fields as in a Pod spec)."""

    key: str | None = Field(
        default=None, description="Taint key to tolerate; empty matches all keys."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value to match (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


class ComputeResources(ApiModel):
    """CPU and memory for the server container."""

    cpu: Quantity | None = Field(default=None, description="CPU, e.g. 4 or 500m.")
    memory: Quantity | None = Field(default=None, description="Memory, e.g. 32Gi.")


class ResourcesSpec(ApiModel):
    """GPUs, CPU, memory and placement of each pod (a replica's pod, or with
    parallelism.nodes > 1 each pod of its group)."""

    gpus: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per pod: per replica, or with parallelism.nodes > 1 per node of the "
        "replica's group. parallelism.tensor x parallelism.pipeline must equal gpus x "
        "parallelism.nodes. Not requested when engine.backend is simulator.",
    )
    gpu_resource_name: Annotated[
        str,
        StringConstraints(
            max_length=253,
            pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
        ),
    ] = Field(
        default="nvidia.com/gpu",
        description="Extended resource name of the GPU (e.g. nvidia.com/gpu, amd.com/gpu).",
    )
    requests: ComputeResources = Field(
        default_factory=lambda: ComputeResources(cpu="4", memory="32Gi"),
        description="CPU/memory requests of the server container (of each pod of a group).",
        json_schema_extra={"default": {"cpu": "4", "memory": "32Gi"}},
    )
    limits: ComputeResources = Field(
        default_factory=lambda: ComputeResources(memory="64Gi"),
        description="CPU/memory limits of the server container (no CPU limit by default: throttling hurts token latency; vLLM's engine-core process busy-polls a whole core while it generates, so keep any CPU limit at 2 or more).",
        json_schema_extra={"default": {"memory": "64Gi"}},
    )
    shared_memory_size: Quantity = Field(
        default="8Gi",
        description="Size of /dev/shm (a memory emptyDir); NCCL and tensor parallelism need it.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations, e.g. for tainted GPU nodes."
    )
    affinity: FreeForm | None = Field(
        default=None, description="Pod affinity/anti-affinity, as in a Pod spec."
    )
    priority_class_name: Name | None = Field(default=None, description="PriorityClass of the pods.")


Key = Annotated[
    str,
    StringConstraints(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    ),
]


class ParallelismSpec(ApiModel):
    """How one replica splits the model over its GPUs and, with nodes > 1, over several nodes."""

    RULES = (
        Rule(
            "!has(self.exclusiveTopologyKey) || (has(self.nodes) && self.nodes > 1)",
            "parallelism.exclusiveTopologyKey places the pods of a multi-node group; it needs "
            "parallelism.nodes above 1",
            holds=lambda p: p.exclusive_topology_key is None or p.nodes > 1,
            field=".exclusiveTopologyKey",
        ),
    )

    tensor: int = Field(
        default=1, ge=1, le=64, description="Tensor-parallel size (GPUs a layer is split over)."
    )
    pipeline: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pipeline-parallel size (stages the layers are split into).",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Nodes per replica. 1: a replica is one pod (a Deployment). Above 1: a "
        "replica is a group of this many pods, one per node, each with resources.gpus GPUs "
        "(a LeaderWorkerSet, leaderworkerset.x-k8s.io/v1, LWS v0.10 or later must be "
        "installed): the leader runs the server and vLLM's engine, the workers run vLLM's "
        "headless workers (its multiprocessing multi-node backend), and the whole group is "
        "recreated when any of its pods fails. tensor x pipeline must equal gpus x nodes.",
    )
    exclusive_topology_key: Key | None = Field(
        default=None,
        description="With nodes > 1: a node label (e.g. a rack or NVLink-domain label) whose "
        "value every pod of one group shares, with one group per value (LWS exclusive "
        "placement). Unset: the scheduler places the group's pods freely.",
    )


class StartupSpec(ApiModel):
    """How long a new pod may take to load its model before it counts as failed."""

    timeout_seconds: int = Field(
        default=1800,
        ge=60,
        le=86400,
        description="Startup budget in seconds (download, weights into GPU memory, warm-up): "
        "the startup probe holds liveness off this long; the Deployment's progress deadline "
        "is 10 minutes longer. Default 30 minutes.",
    )


class RolloutSpec(ApiModel):
    """How a spec change replaces pods (the Deployment's rolling update)."""

    RULES = (
        Rule(
            # has(): the API server checks this rule on the field's default ({}) too,
            # before the members' own defaults apply.
            "(has(self.maxSurge) ? self.maxSurge : 1)"
            " + (has(self.maxUnavailable) ? self.maxUnavailable : 0) > 0",
            "rollout.maxSurge and rollout.maxUnavailable cannot both be 0 (nothing "
            "could be replaced); surge: maxSurge: 1; in place: maxUnavailable: 1",
            holds=lambda r: r.max_surge + r.max_unavailable > 0,
        ),
    )

    max_surge: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Extra pods started (with their GPUs) before old ones stop. The default 1 "
        "keeps every ready replica serving while the new pod loads its model; it needs room "
        "for one more pod. On a full cluster the surge pod waits (status says why): set 0 to "
        "replace in place.",
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Ready pods that may stop before their replacement is ready. 0 (default): "
        "never fewer than the current ready replicas. maxSurge: 0 with maxUnavailable: 1 "
        "replaces in place (a one-replica model is down while the new pod loads). Also the "
        "PodDisruptionBudget's maxUnavailable (at least 1, so node drains never block).",
    )


# Rules on the whole spec (StreamingModelSpec.RULES): they compare parallelism with the
# GPUs per pod and with the engine.


def _gpus_detail(parallelism: ParallelismSpec, gpus: int) -> str:
    tensor, pipeline, nodes = parallelism.tensor, parallelism.pipeline, parallelism.nodes
    if nodes == 1:
        return (
            f"got {tensor} x {pipeline} = {tensor * pipeline} and gpus: {gpus}; "
            f"set gpus: {tensor * pipeline} or change the parallelism"
        )
    fix = (
        f"set gpus: {tensor * pipeline // nodes}"
        if tensor * pipeline % nodes == 0
        else "change the parallelism"
    )
    return (
        f"got {tensor} x {pipeline} = {tensor * pipeline} and gpus x nodes: {gpus} x {nodes} "
        f"= {gpus * nodes}; {fix}"
    )


GPUS_FIT_PARALLELISM = Rule(
    "self.parallelism.tensor * self.parallelism.pipeline == self.resources.gpus * "
    "(has(self.parallelism.nodes) ? self.parallelism.nodes : 1)",
    "parallelism.tensor x parallelism.pipeline must equal resources.gpus x "
    "parallelism.nodes (e.g. gpus: 4 with tensor: 4, pipeline: 1, or tensor: 2, "
    "pipeline: 2; gpus: 8 with nodes: 2 and tensor: 8, pipeline: 2)",
    holds=lambda s: (
        s.parallelism.tensor * s.parallelism.pipeline == s.resources.gpus * s.parallelism.nodes
    ),
    field=".parallelism",
    detail=lambda s: _gpus_detail(s.parallelism, s.resources.gpus),
)
MULTI_NODE_NEEDS_VLLM = Rule(
    "!has(self.parallelism.nodes) || self.parallelism.nodes == 1 || "
    "!has(self.engine.backend) || self.engine.backend == 'vllm'",
    "parallelism.nodes above 1 needs engine.backend vllm: the simulator has no multi-node engine",
    holds=lambda s: s.parallelism.nodes == 1 or s.engine.backend == "vllm",
    field=".parallelism.nodes",
)
