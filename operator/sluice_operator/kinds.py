"""Every kind the operator touches, listed once: API coordinates, URL plural, builder.

One table so the places that need a kind cannot drift apart: the handlers watch
`WATCHED_KINDS` and index `INDEXED_KINDS` in memory, the cluster client builds URLs from `plural_of`, reconcile applies
`CHILD_KINDS` in order (and `KEDA_KIND`, `HTTPROUTE` apart), `render` and reconcile build through
`desired_children`, and a chart test checks every entry against the operator chart's RBAC,
so a kind added here without a matching rule fails that test.

Pure: builders in, no kopf and no API client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .builders.adapters import ADAPTERS_SUFFIX, desired_adapter_config_map
from .builders.deployment import desired_deployment
from .builders.gateway import desired_httproute
from .builders.hpa import desired_hpa
from .builders.ingress import desired_ingress
from .builders.keda import desired_scaled_object
from .builders.networkpolicy import desired_network_policy
from .builders.pdb import desired_pdb
from .builders.podmonitor import desired_pod_monitor
from .builders.service import desired_service
from .models import GROUP, KIND, PLURAL, VERSION
from .models.resource import StreamingModel

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
    "v1", "ConfigMap", "configmaps", desired_adapter_config_map, optional=True,
    name_suffix=ADAPTERS_SUFFIX,
)  # fmt: skip
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments", desired_deployment)
INGRESS = Kind("networking.k8s.io/v1", "Ingress", "ingresses", desired_ingress, optional=True)
HPA = Kind(
    "autoscaling/v2",
    "HorizontalPodAutoscaler",
    "horizontalpodautoscalers",
    desired_hpa,
    optional=True,
)
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", desired_pdb, optional=True)
NETWORK_POLICY = Kind(
    "networking.k8s.io/v1",
    "NetworkPolicy",
    "networkpolicies",
    desired_network_policy,
    optional=True,
)

# Children applied on every pass, in apply order (the Service before the Deployment whose
# pods it selects, the adapter ConfigMap before the pods that mount it).
CHILD_KINDS: tuple[Kind, ...] = (
    SERVICE, ADAPTER_CONFIG_MAP, DEPLOYMENT, INGRESS, HPA, PDB, NETWORK_POLICY
)  # fmt: skip

# KEDA's ScaledObject (autoscaling.backend: keda) is kept apart: its CRD exists only where
# KEDA is installed and the chart grants it only with keda.enabled, so the operator neither
# watches it nor reads it unless a model uses (or last used) the keda backend.
KEDA_KIND = Kind(
    "keda.sh/v1alpha1", "ScaledObject", "scaledobjects", desired_scaled_object, optional=True
)
# The Prometheus Operator's PodMonitor (observability.podMonitor) is apart for the same
# reason: its CRD exists only where the Prometheus Operator runs; a missing CRD is reported
# in the status, and the rest of the model converges.
POD_MONITOR_KIND = Kind(
    "monitoring.coreos.com/v1", "PodMonitor", "podmonitors", desired_pod_monitor, optional=True
)
# The Gateway API HTTPRoute (spec.gateway) likewise: its CRDs exist only where a Gateway API
# implementation is installed, so it is not watched, and only read by models that use it (or
# last did, which the status remembers).
HTTPROUTE = Kind(
    "gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes", desired_httproute, optional=True
)
ALL_KINDS: tuple[Kind, ...] = (*CHILD_KINDS, KEDA_KIND, POD_MONITOR_KIND, HTTPROUTE)

# Not children, but addressed by the cluster client: pods are listed (why they are Pending)
# and watched (status follows them); the StreamingModel is read and its status patched.
POD = Kind("v1", "Pod", "pods")
STREAMING_MODEL = Kind(f"{GROUP}/{VERSION}", KIND, PLURAL)

# What the handlers watch (by the managed-by label) to converge the owner on any change.
WATCHED_KINDS: tuple[Kind, ...] = (*CHILD_KINDS, POD)
# What a pass reads from memory (`memory.Memory`, fed by one kopf index per kind), not the API.
INDEXED_KINDS: tuple[Kind, ...] = (*WATCHED_KINDS, STREAMING_MODEL)

# Everything the cluster client may address.
RESOURCES: tuple[Kind, ...] = (*ALL_KINDS, POD, STREAMING_MODEL)
_PLURALS = {(k.api_version, k.kind): k.plural for k in RESOURCES}


def plural_of(api_version: str, kind: str) -> str:
    """The URL collection segment of a kind; KeyError for a kind the operator never touches."""
    return _PLURALS[(api_version, kind)]


def desired_children(model: StreamingModel) -> dict[str, dict[str, Any] | None]:
    """Kind -> manifest, or None when that optional child must not exist."""
    return {k.kind: k.builder(model) for k in ALL_KINDS}  # type: ignore[misc]
