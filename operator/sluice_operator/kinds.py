"""Every kind the operator touches, listed once: API coordinates, URL plural, builder.

One table so the places that need a kind cannot drift apart: the handlers watch
`WATCHED_KINDS` and index `INDEXED_KINDS` in memory, the cluster client builds URLs from
`plural_of`, reconcile applies `CHILD_KINDS` in order and `OPTIONAL_KINDS` around them (each
row says when it is touched, how the status reports it and what a missing CRD means),
`status` reports the optional ones from the same rows, `render` and reconcile build through
`desired_children`, and a chart test checks every entry against the operator chart's RBAC,
so a kind added here without a matching rule fails that test.

Pure: builders in, no kopf and no API client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .builders.activator import ACTIVATOR_SUFFIX, desired_activator_service
from .builders.adapters import ADAPTERS_SUFFIX, desired_adapter_config_map
from .builders.continuation import CONTINUATION_SUFFIX, desired_continuation_secret
from .builders.deployment import desired_deployment, desired_pool_deployment
from .builders.disaggregation import POOL_SUFFIX
from .builders.gateway import desired_httproute, route_verdict, wants_session_persistence
from .builders.hpa import desired_hpa, desired_pool_hpa
from .builders.ingress import desired_ingress
from .builders.keda import desired_scaled_object
from .builders.leaderworkerset import desired_leaderworkerset
from .builders.networkpolicy import (
    KV_EVENTS_SUFFIX,
    desired_kv_events_network_policy,
    desired_network_policy,
)
from .builders.pdb import desired_pdb
from .builders.podmonitor import desired_pod_monitor
from .builders.routing import desired_inference_pool, pool_verdict
from .builders.service import desired_service
from .models import GROUP, KIND, PLURAL, VERSION
from .models.resource import StreamingModel
from .models.status import ConditionType

Builder = Callable[[StreamingModel], dict[str, Any] | None]


@dataclass(frozen=True)
class Kind:
    """One Kubernetes kind as the operator addresses it.

    `builder` is set for children (what the StreamingModel becomes); `optional` children
    are deleted when their builder returns None (the spec no longer asks for them), the
    others are never deleted by the operator (the garbage collector does it).
    """

    api_version: str
    kind: str
    plural: str
    builder: Builder | None = None
    optional: bool = False
    # Children are named like their model; a kind whose name would clash with the user's
    # own objects (a ConfigMap) gets a suffix.
    name_suffix: str = ""
    # What `desired_children` and a pass call this child when two share a kind (the
    # model's Service and its activator Service); default: the kind.
    role: str = ""

    @property
    def id(self) -> str:
        return self.role or self.kind

    def child_name(self, model_name: str) -> str:
        return model_name + self.name_suffix

    def owner_of(self, child_name: str) -> str:
        return child_name.removesuffix(self.name_suffix) if self.name_suffix else child_name

    @property
    def group(self) -> str:
        """API group ("" for the core group), as RBAC rules and kopf watches name it."""
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def index_id(self) -> str:
        """Name of the in-memory index of this kind (a kopf index id and handler keyword)."""
        return f"observed_{self.plural}"


SERVICE = Kind("v1", "Service", "services", desired_service)
# The adapter list (spec.adapters), mounted in the pods; only while LoRA is on. Named
# <model>-adapters: a user's own ConfigMap (a JWKS) may well carry the model's name.
ADAPTER_CONFIG_MAP = Kind(
    "v1",
    "ConfigMap",
    "configmaps",
    desired_adapter_config_map,
    optional=True,
    name_suffix=ADAPTERS_SUFFIX,
)
# Optional: a LeaderWorkerSet replaces it for models on several nodes per replica.
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments", desired_deployment, optional=True)
INGRESS = Kind("networking.k8s.io/v1", "Ingress", "ingresses", desired_ingress, optional=True)
HPA = Kind(
    "autoscaling/v2",
    "HorizontalPodAutoscaler",
    "horizontalpodautoscalers",
    desired_hpa,
    optional=True,
)
# A disaggregated model's pools (spec.disaggregation), each a Deployment with its own HPA;
# the same plurals as DEPLOYMENT and HPA: one watch and index serve both.
PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT = (
    Kind(
        "apps/v1",
        "Deployment",
        "deployments",
        desired_pool_deployment(role),
        optional=True,
        name_suffix=POOL_SUFFIX[role],
        role=f"{role.capitalize()}Deployment",
    )
    for role in ("prefill", "decode")
)
PREFILL_HPA, DECODE_HPA = (
    Kind(
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        "horizontalpodautoscalers",
        desired_pool_hpa(role),
        optional=True,
        name_suffix=POOL_SUFFIX[role],
        role=f"{role.capitalize()}HorizontalPodAutoscaler",
    )
    for role in ("prefill", "decode")
)
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", desired_pdb, optional=True)
NETWORK_POLICY = Kind(
    "networking.k8s.io/v1",
    "NetworkPolicy",
    "networkpolicies",
    desired_network_policy,
    optional=True,
)
# A router model's KV-event ports closed to all but the router's pods while the model's own
# NetworkPolicy is off (builders/networkpolicy.py); the same plural: one watch and index.
KV_EVENTS_NETWORK_POLICY = Kind(
    "networking.k8s.io/v1",
    "NetworkPolicy",
    "networkpolicies",
    desired_kv_events_network_policy,
    optional=True,
    name_suffix=KV_EVENTS_SUFFIX,
    role="KvEventsNetworkPolicy",
)

# The ExternalName Service `<name>-activator` the route names for a router model, or while
# a model with minReplicas 0 has no Ready replica (builders/activator.py); only then. The
# same plural as SERVICE: one watch and one index serve both (`unique`).
ACTIVATOR_SERVICE = Kind(
    "v1",
    "Service",
    "services",
    desired_activator_service,
    optional=True,
    name_suffix=ACTIVATOR_SUFFIX,
    role="ActivatorService",
)

# Children applied on every pass, in apply order (the Services before the Deployment whose
# pods one selects and the Ingress that names them, the adapter ConfigMap before the pods
# that mount it).
CHILD_KINDS: tuple[Kind, ...] = (
    SERVICE, ACTIVATOR_SERVICE, ADAPTER_CONFIG_MAP, DEPLOYMENT, PREFILL_DEPLOYMENT,
    DECODE_DEPLOYMENT, INGRESS, HPA, PREFILL_HPA, DECODE_HPA, PDB, NETWORK_POLICY,
    KV_EVENTS_NETWORK_POLICY,
)  # fmt: skip

# The optional kinds whose API a cluster may lack: not watched, see `OptionalKind`.
KEDA_KIND = Kind(
    "keda.sh/v1alpha1", "ScaledObject", "scaledobjects", desired_scaled_object, optional=True
)
POD_MONITOR_KIND = Kind(
    "monitoring.coreos.com/v1", "PodMonitor", "podmonitors", desired_pod_monitor, optional=True
)
HTTPROUTE = Kind(
    "gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes", desired_httproute, optional=True
)
INFERENCE_POOL_KIND = Kind(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    "inferencepools",
    desired_inference_pool,
    optional=True,
)
LWS_KIND = Kind(
    "leaderworkerset.x-k8s.io/v1",
    "LeaderWorkerSet",
    "leaderworkersets",
    desired_leaderworkerset,
    optional=True,
)

# (status, reason, message) of a condition: True/False, or None for Unknown.
Verdict = tuple[bool | None, str, str]
Ready = Callable[[StreamingModel, Mapping[str, Any] | None], Verdict]


@dataclass(frozen=True)
class Unavailable:
    """Why an optional kind cannot be reached: the condition's reason and the message."""

    reason: str
    message: str


@dataclass(frozen=True)
class OptionalKind:
    """A child whose API a cluster may lack (no CRD: 404) or the operator chart may not
    grant (403), so it is neither watched nor read unless the model wants it (its builder
    returns a manifest) or the status says it did on the last pass (then it is deleted).

    A 403 or 404 on it stops only this kind: the rest of the model converges, the status
    says why (`forbidden`, `missing`), a Warning Event `event` is posted when that message
    is new, and the pass then fails so the handler retries with backoff and the kind is
    picked up once it is installed or granted. A refusal while the model no longer wants
    the kind is dropped (an object the operator cannot reach is none it made), except with
    `excludes`.

    `condition`: the status condition that reports the kind, with `ready` (model, the object
    as stored) while it is reachable and `reasons` (403, 404) when not; its presence in the
    status remembers the kind was wanted. None: `status.autoscaling` reports it (the
    ScaledObject is an autoscaler: `autoscaling.message` says why, `autoscaling.backend:
    keda` remembers it).
    `excludes`: a child that must never exist beside this one (two HPAs would fight): while
    unwanted this kind is deleted before the children are applied, and a refusal of that
    delete is reported and retried (a leftover would keep fighting); while wanted it is
    applied after them, once the other is gone.
    """

    kind: Kind
    event: str
    forbidden: str
    missing: str
    condition: ConditionType | None = None
    ready: Ready | None = None
    reasons: tuple[str, str] = ("Forbidden", "CRDMissing")
    excludes: Kind | None = None

    @property
    def name(self) -> str:
        return self.kind.kind

    def wanted(self, model: StreamingModel) -> bool:
        return self.kind.builder(model) is not None  # type: ignore[misc]

    def unavailable(self, exc: Exception) -> Unavailable | None:
        """What a refusal means for this kind; None for any error but 403 and 404."""
        status = getattr(exc, "status", None)
        if status == 403:
            return Unavailable(self.reasons[0], self.forbidden)
        if status == 404:
            return Unavailable(self.reasons[1], self.missing)
        return None


def _applied(message: str) -> Ready:
    return lambda model, live: (True, "Applied", message)


KEDA = OptionalKind(
    KEDA_KIND,
    event="KedaUnavailable",
    forbidden="the operator may not manage keda.sh ScaledObjects: install the sluice-operator "
    "chart with keda.enabled=true (or set autoscaling.backend: hpa)",
    missing="KEDA is not installed: the API server has no keda.sh/v1alpha1 ScaledObject "
    "resource (install KEDA, or set autoscaling.backend: hpa)",
    excludes=HPA,  # KEDA makes its own HPA from the ScaledObject
)
GATEWAY_API = OptionalKind(
    HTTPROUTE,
    event="GatewayAPIUnavailable",
    forbidden="the operator may not manage gateway.networking.k8s.io HTTPRoutes: upgrade the "
    "sluice-operator chart (its RBAC grants them), or use spec.ingress instead",
    missing="the Gateway API is not installed: the API server has no "
    "gateway.networking.k8s.io/v1 HTTPRoute resource (install a Gateway API implementation "
    "and its CRDs, v1.2 or later, or use spec.ingress instead)",
    condition="GatewayRoute",
    ready=lambda model, route: route_verdict(route, wants_session_persistence(model)),
    reasons=("GatewayAPIUnavailable", "GatewayAPIUnavailable"),
)
GATEWAY_API_INFERENCE_EXTENSION = OptionalKind(
    INFERENCE_POOL_KIND,
    event="InferencePoolUnavailable",
    forbidden="the operator may not manage inference.networking.k8s.io InferencePools: "
    "upgrade the sluice-operator chart (its RBAC grants them), or turn "
    "routing.inferencePool off",
    missing="the Gateway API Inference Extension is not installed: the API server has no "
    "inference.networking.k8s.io/v1 InferencePool resource (install its CRDs, v1.0 or later, "
    "or turn routing.inferencePool off)",
    condition="InferencePoolReady",
    ready=pool_verdict,
)
PROMETHEUS_OPERATOR = OptionalKind(
    POD_MONITOR_KIND,
    event="PodMonitorUnavailable",
    forbidden="the operator may not manage monitoring.coreos.com PodMonitors: install the "
    "sluice-operator chart with podMonitors.enabled=true (or turn observability.podMonitor "
    "off)",
    missing="the Prometheus Operator is not installed: the API server has no "
    "monitoring.coreos.com/v1 PodMonitor resource (install it, or turn "
    "observability.podMonitor off; the pods' prometheus.io annotations still work)",
    condition="PodMonitorReady",
    ready=_applied("the PodMonitor selects the model's pods"),
)
LEADER_WORKER_SET = OptionalKind(
    LWS_KIND,
    event="LeaderWorkerSetUnavailable",
    forbidden="the operator may not manage leaderworkerset.x-k8s.io LeaderWorkerSets: upgrade "
    "the sluice-operator chart (its RBAC grants them), or set parallelism.nodes: 1",
    missing="LeaderWorkerSet is not installed: the API server has no leaderworkerset.x-k8s.io/v1 "
    "LeaderWorkerSet resource, which models with parallelism.nodes above 1 run on (install "
    "LWS v0.10 or later, or set parallelism.nodes: 1)",
    condition="LeaderWorkerSetReady",
    ready=_applied("the LeaderWorkerSet runs each replica as a group of pods"),
    excludes=DEPLOYMENT,  # one workload per model: never both
)
# In the order a pass converges them (after the children, but see `excludes`), reports
# them (conditions in this order) and raises the first refusal.
# The pool goes before the route that names it.
OPTIONAL_KINDS: tuple[OptionalKind, ...] = (
    KEDA,
    GATEWAY_API_INFERENCE_EXTENSION,
    GATEWAY_API,
    PROMETHEUS_OPERATOR,
    LEADER_WORKER_SET,
)
ALL_KINDS: tuple[Kind, ...] = (*CHILD_KINDS, *(o.kind for o in OPTIONAL_KINDS))

# The weights cache's objects (builders/weights.py): shared by the models of a namespace
# that name one claim, so no one model owns them and they are not children (no builder
# here, no watch, no owner reference). The download and clean-up Jobs are read by name,
# created, and deleted when a finished Job's result is gone; the claim is read and created,
# never deleted (other models may share it).
JOB = Kind("batch/v1", "Job", "jobs", optional=True)
PERSISTENT_VOLUME_CLAIM = Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
WEIGHTS_KINDS: tuple[Kind, ...] = (JOB, PERSISTENT_VOLUME_CLAIM)

# The continuation key of a model whose streams migrate (builders/continuation.py): a child
# the operator writes but never reads, since it reads no Secret (its RBAC grants create,
# patch and delete on Secrets, nothing else). So it is neither watched nor read: it is
# server-side applied without a read, the hash of what was applied is kept in memory
# (`cluster_view.ClusterView.applied`) so a settled model makes no call, and it is deleted
# when the model stops migrating while the status says it did (condition StreamMigration
# True). A Secret deleted by hand is made again when the operator restarts or the key
# changes.
CONTINUATION_SECRET = Kind(
    "v1",
    "Secret",
    "secrets",
    desired_continuation_secret,
    optional=True,
    name_suffix=CONTINUATION_SUFFIX,
    role="ContinuationSecret",
)
WRITE_ONLY_KINDS: tuple[Kind, ...] = (CONTINUATION_SECRET,)

# Not children, but addressed by the cluster client: pods are listed (why they are Pending)
# and watched (status follows them); the StreamingModel is read and its status patched.
POD = Kind("v1", "Pod", "pods")
STREAMING_MODEL = Kind(f"{GROUP}/{VERSION}", KIND, PLURAL)


def unique(kinds: tuple[Kind, ...]) -> tuple[Kind, ...]:
    """One row per API resource (the first): two child kinds may share a resource (the
    model's Service and its activator Service), and one watch and one index serve both."""
    seen: dict[tuple[str, str], Kind] = {}
    for k in kinds:
        seen.setdefault((k.api_version, k.plural), k)
    return tuple(seen.values())


# What the handlers watch (by the managed-by label) to converge the owner on any change.
WATCHED_KINDS: tuple[Kind, ...] = (*CHILD_KINDS, POD)
# What a pass reads from memory (`cluster_view.ClusterView`, fed by one kopf index per kind), not the API.
INDEXED_KINDS: tuple[Kind, ...] = unique((*WATCHED_KINDS, STREAMING_MODEL))

# Everything the cluster client may address.
RESOURCES: tuple[Kind, ...] = (*ALL_KINDS, *WEIGHTS_KINDS, *WRITE_ONLY_KINDS, POD, STREAMING_MODEL)
_PLURALS = {(k.api_version, k.kind): k.plural for k in RESOURCES}


def plural_of(api_version: str, kind: str) -> str:
    """The URL collection segment of a kind; KeyError for a kind the operator never touches."""
    return _PLURALS[(api_version, kind)]


def desired_children(model: StreamingModel) -> dict[str, dict[str, Any] | None]:
    """Kind (`Kind.id`) -> manifest, or None when that optional child must not exist."""
    return {k.id: k.builder(model) for k in (*ALL_KINDS, *WRITE_ONLY_KINDS)}  # type: ignore[misc]
