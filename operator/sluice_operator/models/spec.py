"""StreamingModel spec: every field typed, described (for `kubectl explain`) and defaulted.

The CRD in crds/ is generated from these classes (`python -m sluice_operator crds --write`),
and the operator validates every object with them again before it renders anything, so a
cluster without CEL support or an object written before a rule existed still gets a clear
`SpecValid=False` instead of a broken Deployment. Each class's `RULES` are both: the CEL rule
in the CRD and the operator's check, with one message (`base.Rule`).

This is the root; each concept's types and rules are a module of their own: `engine.py` (the
model and the engine), `adapters.py` (LoRA adapters), `pods.py` (resources, parallelism,
startup, rollout), `serving.py` (protocols, limits, the server's processes and queue),
`auth.py`, `scaling.py` (autoscaling, scale to zero), `exposure.py` (Ingress, Gateway,
routing, NetworkPolicy), `observability.py` and `disaggregation.py` (prefill and decode
pools). The rules that compare fields of several of
them are written in the module of the field they point at and listed here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .adapters import ADAPTER_RULES, MAX_ADAPTERS, AdapterSpec
from .auth import AuthSpec
from .base import ApiModel, sub
from .disaggregation import DISAGGREGATION_RULES, DisaggregationSpec
from .engine import EngineSpec, LoraSpec, ModelSpec
from .exposure import (
    GATEWAY_OR_INGRESS,
    STALL_OVER_HEARTBEAT,
    GatewaySpec,
    IngressSpec,
    NetworkPolicySpec,
    RoutingSpec,
    nginx_size_bytes,
)
from .observability import ObservabilitySpec
from .pods import (
    GPUS_FIT_PARALLELISM,
    MULTI_NODE_NEEDS_VLLM,
    ParallelismSpec,
    ResourcesSpec,
    RolloutSpec,
    StartupSpec,
)
from .refs import LocalObjectReference, Name
from .scaling import HOLD_TIMEOUT_MARGIN_SECONDS, AutoscalingSpec, ScaleToZeroSpec
from .serving import (
    DEFAULT_MAX_REQUEST_BYTES,
    ONE_WORKER_ON_NODES,
    ONE_WORKER_WITH_RESUME,
    LimitsSpec,
    ServerSpec,
    StreamingSpec,
)
from .weights import WEIGHTS_NO_HUB_ADAPTERS, WEIGHTS_ONE_NODE

# What the CRD used to store in `spec.image` of every object that did not set it; such a
# stored value counts as unset (`resource.StreamingModel.image`). Never changes.
FORMER_DEFAULT_IMAGE = "ghcr.io/sluice-dev/sluice-server:0.1.0"


class StreamingModelSpec(ApiModel):
    """Desired state of a StreamingModel: a model served as a streaming endpoint."""

    RULES = (
        GATEWAY_OR_INGRESS,
        ONE_WORKER_WITH_RESUME,
        *ADAPTER_RULES,
        GPUS_FIT_PARALLELISM,
        MULTI_NODE_NEEDS_VLLM,
        ONE_WORKER_ON_NODES,
        WEIGHTS_NO_HUB_ADAPTERS,
        WEIGHTS_ONE_NODE,
        STALL_OVER_HEARTBEAT,
        *DISAGGREGATION_RULES,
    )

    model: ModelSpec = Field(description="Which model to serve.")
    resources: ResourcesSpec = sub(
        ResourcesSpec,
        "GPUs, CPU, memory and placement of each pod (per node with parallelism.nodes > 1).",
    )
    parallelism: ParallelismSpec = sub(
        ParallelismSpec,
        "Tensor, pipeline and node parallelism; tensor x pipeline must equal resources.gpus "
        "x nodes.",
    )
    engine: EngineSpec = sub(EngineSpec, "Inference engine settings.")
    streaming: StreamingSpec = sub(StreamingSpec, "Streaming protocols and limits.")
    auth: AuthSpec = sub(AuthSpec, "API keys, JWTs and rate limits.")
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Replicas when autoscaling is off (also the scale subresource); with "
        "parallelism.nodes > 1 each replica is a group of that many pods.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="TTFT autoscaling; unset: fixed spec.replicas."
    )
    disaggregation: DisaggregationSpec | None = Field(
        default=None,
        description="Serve prefill and decode on separate pools (Deployments <name>-prefill "
        "and <name>-decode) with the KV cache handed over by a connector; needs "
        "routing.router.enabled (the router does the two steps). Unset: one pool does both.",
    )
    ingress: IngressSpec = sub(IngressSpec, "Ingress settings.")
    gateway: GatewaySpec | None = Field(
        default=None,
        description="Expose the model through a Gateway API Gateway with an HTTPRoute "
        "(gateway.networking.k8s.io/v1) instead of an Ingress; exclusive with ingress.enabled.",
    )
    routing: RoutingSpec = sub(RoutingSpec, "Balancing over replicas and the InferencePool path.")
    network_policy: NetworkPolicySpec = sub(
        NetworkPolicySpec, "NetworkPolicy for the model pods (off by default)."
    )
    limits: LimitsSpec = sub(LimitsSpec, "Request size limits (server and proxy alike).")
    server: ServerSpec = sub(ServerSpec, "The streaming server's own processes.")
    adapters: Annotated[list[AdapterSpec], Field(max_length=MAX_ADAPTERS)] = Field(
        default_factory=list,
        description=f"LoRA adapters (fine-tunes of the base model) served by name next to "
        f"the base, at most {MAX_ADAPTERS}. Adding, changing or removing one does not restart "
        "anything: the operator writes the list to the ConfigMap <name>-adapters, which every "
        "pod has mounted, and each server process loads and unloads adapters in its running "
        "engine (the kubelet refreshes a mounted ConfigMap within about a minute). Only "
        "engine.lora's limits (and LoRA turning on with the first adapter, unless engine.lora "
        "is set) restart the engine. status.adapters says per adapter whether every pod "
        "serves it (Ready), is still loading it (Loading), or could not (Failed, with why).",
    )
    startup: StartupSpec = sub(StartupSpec, "Startup budget of a new pod.")
    rollout: RolloutSpec = sub(
        RolloutSpec, "How spec changes replace pods: surge (default) or in place."
    )
    observability: ObservabilitySpec = sub(
        ObservabilitySpec, "PodMonitor and OpenTelemetry tracing."
    )
    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = Field(
        default=None,
        description="Serving image (the Sluice server). Unset: the operator's default image "
        "(its --model-image: the operator chart's modelImage.repository and modelImage.tag), "
        f"and the pods follow it when it changes. {FORMER_DEFAULT_IMAGE}, which older CRDs "
        "stored as the default, counts as unset.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the image."
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="Extra pod labels (the operator's own labels win)."
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra pod annotations."
    )
    service_account_name: Name | None = Field(
        default=None, description="ServiceAccount of the pods; namespace default when unset."
    )

    @property
    def lora_enabled(self) -> bool:
        """The engine starts with LoRA on: engine.lora is set or adapters are declared."""
        return self.engine.lora is not None or bool(self.adapters)

    @property
    def lora_limits(self) -> LoraSpec:
        return self.engine.lora or LoraSpec()

    @property
    def max_request_bytes(self) -> int:
        """The one request body limit: limits.maxRequestBytes, else the deprecated
        ingress.maxBodySize, else 16 MiB."""
        if self.limits.max_request_bytes is not None:
            return self.limits.max_request_bytes
        if self.ingress.max_body_size is not None:
            return nginx_size_bytes(self.ingress.max_body_size)
        return DEFAULT_MAX_REQUEST_BYTES

    @property
    def autoscaling_enabled(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.enabled

    @property
    def autoscaling_backend(self) -> Literal["hpa", "keda"] | None:
        """Which autoscaler object the operator makes; None when autoscaling is off."""
        a = self.autoscaling
        return a.backend if a is not None and a.enabled else None

    @property
    def scale_to_zero(self) -> ScaleToZeroSpec | None:
        """The scale-to-zero settings (defaults filled in) when autoscaling.minReplicas is 0."""
        a = self.autoscaling
        if a is None or not a.enabled or a.min_replicas != 0:
            return None
        return a.scale_to_zero or ScaleToZeroSpec()

    @property
    def hold_timeout_seconds(self) -> int:
        """How long the activator holds a request: as set, else the startup budget + 60 s."""
        zero = self.scale_to_zero or ScaleToZeroSpec()
        if zero.hold_timeout_seconds is not None:
            return zero.hold_timeout_seconds
        return self.startup.timeout_seconds + HOLD_TIMEOUT_MARGIN_SECONDS

    @property
    def max_possible_replicas(self) -> int:
        """Most pods serving at once; a disaggregated model's both pools together."""
        d = self.disaggregation
        if d is not None:
            return sum(
                p.autoscaling.max_replicas if p.autoscaling else p.replicas
                for p in (d.prefill, d.decode)
            )
        a = self.autoscaling
        return a.max_replicas if a is not None and a.enabled else self.replicas
