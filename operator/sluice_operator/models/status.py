"""StreamingModel status: what the operator observed, written through the status subresource."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from .base import ApiModel

Phase = Literal[
    "Pending", "Progressing", "Ready", "Degraded", "Failed", "ScaledToZero", "Activating"
]
# Every condition type the operator writes: status.py's own, the optional kinds' (kinds.py),
# adapterstatus.py's and scaletozero.py's. Each of them is typed with it, so mypy refuses a
# condition this list does not name, and test_operator_status.py checks the API reference
# names each one (`StreamingModelStatus.conditions`).
ConditionType = Literal[
    "SpecValid",
    "Available",
    "Progressing",
    "Ready",
    "TemplateCurrent",
    "GatewayRoute",
    "RouteBackend",
    "InferencePoolReady",
    "RouterReady",
    "StreamMigration",
    "PodMonitorReady",
    "LeaderWorkerSetReady",
    "AdaptersReady",
    "ScaledToZero",
    "WeightsReady",
    "TrafficSplit",
]
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)


class Condition(ApiModel):
    """One aspect of the StreamingModel's state (Kubernetes condition conventions)."""

    type: str = Field(
        description=f"One of {', '.join(CONDITION_TYPES)} (status.conditions says when each "
        "is written)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="What happened, in words a person can act on.")
    last_transition_time: str | None = Field(
        default=None,
        description="When status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was computed for."
    )


class Endpoints(ApiModel):
    """Client URLs of the model (ingress URL when an Ingress exists, else the in-cluster Service)."""

    openai: str | None = Field(
        default=None, description="OpenAI-compatible base URL (append /chat/completions)."
    )
    sse: str | None = Field(default=None, description="Token SSE stream URL (/v1/stream).")
    websocket: str | None = Field(default=None, description="WebSocket stream URL (/ws/stream).")
    responses: str | None = Field(
        default=None, description="OpenAI Responses URL (/v1/responses; SDK base URL: .../v1)."
    )
    anthropic: str | None = Field(
        default=None,
        description="Anthropic Messages URL (/v1/messages; SDK base URL: the model's URL).",
    )


class AutoscalingStatus(ApiModel):
    """What the HorizontalPodAutoscaler last saw and decided (from its status; with backend keda, the HPA KEDA made)."""

    backend: Literal["hpa", "keda"] | None = Field(
        default=None,
        description="Autoscaler backend in use (hpa or keda); the operator uses it to clean up after a switch.",
    )

    metric: str | None = Field(
        default=None,
        description="The TTFT metric scaled on (sluice_ttft_pNN_seconds; with KEDA, the same query in the ScaledObject's trigger).",
    )
    target_ttft_milliseconds: int | None = Field(
        default=None,
        alias="targetTTFTMilliseconds",
        description="Target per-pod TTFT in milliseconds.",
    )
    current_ttft_milliseconds: int | None = Field(
        default=None,
        alias="currentTTFTMilliseconds",
        description="Last per-pod average TTFT the HPA read, in milliseconds (unset while the metric is unavailable).",
    )
    current_replicas: int | None = Field(default=None, description="Replicas the HPA last saw.")
    desired_replicas: int | None = Field(default=None, description="Replicas the HPA wants.")
    last_scale_time: str | None = Field(
        default=None,
        description="When the HPA last scaled (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    message: str | None = Field(
        default=None,
        description="Why the HPA cannot scale or read the metric, when that is the case.",
    )


class AdapterStatus(ApiModel):
    """How the model's pods stand with one LoRA adapter (from each ready pod's /metrics)."""

    name: str = Field(description="The adapter's served name (spec.adapters[].name).")
    state: Literal["Loading", "Ready", "Failed", "Unknown"] = Field(
        description="Ready: every ready pod serves it. Loading: a pod is still loading it, or "
        "has not seen the new adapter list yet (the kubelet refreshes a mounted ConfigMap "
        "within about a minute). Failed: a pod could not load it (see message); the other "
        "adapters and the base keep serving. Unknown: no pod's /metrics could be read."
    )
    reason: str = Field(default="", description="CamelCase reason of the state.")
    message: str = Field(default="", description="Why, for Failed and Loading.")
    ready_pods: str | None = Field(
        default=None, description="Pods serving it / ready pods, for kubectl get -o yaml."
    )


class WeightsStatus(ApiModel):
    """The weights cache's commit the pods serve (spec.model.cache.weights)."""

    claim_name: str | None = Field(default=None, description="The claim holding the weights.")
    repo: str | None = Field(default=None, description="org/name on the Hub.")
    revision: str | None = Field(
        default=None, description="The revision asked for (spec.model.uri's @revision, or main)."
    )
    commit: str | None = Field(
        default=None,
        description="The commit the revision resolved to when it was downloaded; a branch is "
        "resolved again only with a new serving.sluice.dev/weights-refresh annotation.",
    )
    resolved_at: str | None = Field(
        default=None,
        description="When the download finished (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    files: int | None = Field(default=None, description="Files of the commit.")
    bytes: int | None = Field(default=None, description="Bytes of the commit.")
    job: str | None = Field(default=None, description="The download Job that produced it.")
    previous_commit: str | None = Field(
        default=None,
        description="The commit served before a revision change, removed from the claim once "
        "the pods rolled and no model of the namespace serves it.",
    )


class PoolStatus(ApiModel):
    """One pool of a disaggregated model (spec.disaggregation): its Deployment's counts and,
    with the pool's autoscaling, its HPA's last reading."""

    replicas: int | None = Field(default=None, description="Pods of the pool's Deployment.")
    ready_replicas: int | None = Field(default=None, description="Pods ready to serve.")
    ready: str | None = Field(default=None, description="readyReplicas/desired replicas.")
    metric: str | None = Field(
        default=None,
        description="With autoscaling: the metric scaled on (sluice_ttft_pNN_seconds on "
        "prefill, sluice_itl_pNN_seconds on decode).",
    )
    current_milliseconds: int | None = Field(
        default=None,
        description="The per-pod average of that metric the HPA last read, in milliseconds: "
        "time to first token on prefill, inter-token latency on decode.",
    )


class PoolsStatus(ApiModel):
    """The two pools of a disaggregated model."""

    prefill: PoolStatus | None = Field(default=None, description="The prefill pool.")
    decode: PoolStatus | None = Field(default=None, description="The decode pool.")


class SplitVersionStatus(ApiModel):
    """One version of a split (spec.routing.router.split), this model first: its share and
    how it serves, side by side with the others."""

    model: str = Field(description="The StreamingModel (this one first, then the versions).")
    weight: int = Field(
        description="Percent of conversations the router sends it now: the spec's, or 0 "
        "for a version that fails a check (condition TrafficSplit), whose share stays with "
        "this model."
    )
    ready_replicas: int | None = Field(default=None, description="Its ready pods.")
    ttft_milliseconds: int | None = Field(
        default=None,
        alias="ttftMilliseconds",
        description="Median time to first token over the last window (from its ready pods' "
        "sluice_ttft_seconds, which streamed answers record); unset while it streamed no "
        "answer in the window.",
    )
    error_rate: str | None = Field(
        default=None,
        description="Streams ended by an error event / requests accepted over the last "
        "window, as a decimal (0.0012); unset without requests.",
    )
    tokens_per_second: int | None = Field(
        default=None,
        description="Tokens streamed to clients per second over the last window (a stream's "
        "tokens count when it ends).",
    )
    window_seconds: int | None = Field(
        default=None, description="The window the rates cover (between two reads of /metrics)."
    )


class StreamingModelStatus(ApiModel):
    """Observed state of a StreamingModel."""

    phase: Phase | None = Field(
        default=None,
        description="Pending, Progressing, Ready, Degraded or Failed; with "
        "autoscaling.minReplicas 0 also ScaledToZero (no replica, the activator holds the next "
        "request) and Activating (requests held while a replica starts).",
    )
    message: str | None = Field(
        default=None, description="Human-readable summary of the phase (why not Ready)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="SpecValid, Available, Progressing and Ready conditions; TemplateCurrent=False "
        "while an operator upgrade's new pod template waits for a rollout slot; with spec.gateway "
        "also GatewayRoute (the HTTPRoute accepted by its Gateways, or why not: the Gateway API "
        "CRDs missing, access forbidden, a Gateway refusing the route); with spec.gateway, or an "
        "Ingress and autoscaling.minReplicas 0 or routing.router.enabled, also RouteBackend (the "
        "backend the route names: Service, InferencePool, Activator or Router; False when the "
        "InferencePool cannot be applied); with routing.inferencePool.enabled also "
        "InferencePoolReady; with routing.router.enabled RouterReady (False, RouterDisabled, "
        "when the operator chart runs no router: the route then goes to the Service) and, unless "
        "routing.router.migration.enabled is false, StreamMigration (True: streams continue on "
        "another replica when their pod goes away; False says why not: NoContinuationKey, "
        "RouterDisabled, Forbidden); with "
        "observability.podMonitor.enabled PodMonitorReady, with parallelism.nodes above 1 "
        "LeaderWorkerSetReady (each: the object applied and accepted, or why not: its CRD "
        "missing, access forbidden); with LoRA on AdaptersReady (every adapter served by every "
        "ready pod, or which are still loading or failed); with autoscaling.minReplicas 0 also "
        "ScaledToZero (True at zero; False says why not, e.g. how long since the last request); "
        "with model.cache.weights WeightsReady (Resolving, Downloading with files and bytes "
        "done, Ready, or why the download failed: Unauthorized, Gated, RevisionNotFound, "
        "NoSpace, Corrupt, HubUnreachable, DownloadFailed); with routing.router.split "
        "TrafficSplit (True: every version takes its weight; False names the version that "
        "takes none and why: VersionMissing, VersionInvalid, VersionNotRouted, "
        "ServedNameDiffers, PathDiffers, RouteClaimed, VersionSplits, RouterDisabled).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the status was computed for."
    )
    replicas: int | None = Field(
        default=None,
        description="Replicas (scale subresource): pods of the model's Deployment, or with "
        "parallelism.nodes above 1 groups of its LeaderWorkerSet (one pod per node each).",
    )
    ready_replicas: int | None = Field(
        default=None,
        description="Replicas ready to serve (groups whose leader is Ready, for a multi-node "
        "model: its readiness waits for every node of the group).",
    )
    ready: str | None = Field(default=None, description="readyReplicas/replicas, for kubectl get.")
    held_requests: int | None = Field(
        default=None,
        description="With autoscaling.minReplicas 0: requests the activator holds for the "
        "model now (condition ScaledToZero says why it is or is not at zero).",
    )
    selector: str | None = Field(
        default=None,
        description="Label selector of the pods (scale subresource, for kubectl scale and HPAs).",
    )
    url: str | None = Field(
        default=None,
        description="Base URL: the Ingress's or the HTTPRoute's when one exists, else the "
        "Service URL.",
    )
    endpoints: Endpoints | None = Field(default=None, description="SSE, OpenAI and WebSocket URLs.")
    autoscaling: AutoscalingStatus | None = Field(
        default=None,
        description="The autoscaler's last reading and decision (when autoscaling is enabled).",
    )
    weights: WeightsStatus | None = Field(
        default=None,
        description="With model.cache.weights: the commit on the claim the pods mount (with "
        "condition WeightsReady).",
    )
    pools: PoolsStatus | None = Field(
        default=None,
        description="With spec.disaggregation: each pool's ready counts and latency (the "
        "model's replicas, readyReplicas and Ready condition cover both pools: Ready when "
        "each pool has all its replicas ready).",
    )
    split: list[SplitVersionStatus] | None = Field(
        default=None,
        description="With routing.router.split: this model and each version, with the "
        "weight the router applies and its TTFT, error rate and tokens/s over the last window "
        "(condition TrafficSplit says why a version takes no traffic).",
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        description="Each LoRA adapter of spec.adapters and its state on the pods (with "
        "condition AdaptersReady).",
    )
