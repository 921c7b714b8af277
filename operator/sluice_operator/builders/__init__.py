"""Pure manifest builders: typed StreamingModel in, plain dicts out. No kopf, no API client."""

from __future__ import annotations

from typing import Any

from ..models.resource import StreamingModel
from .deployment import desired_deployment
from .hpa import desired_hpa
from .ingress import desired_ingress
from .keda import desired_scaled_object
from .pdb import desired_pdb
from .service import desired_service

# (apiVersion, kind) of every child kind, in apply order. Optional kinds are deleted when
# the spec no longer asks for them.
CHILD_KINDS: tuple[tuple[str, str, bool], ...] = (
    ("v1", "Service", False),
    ("apps/v1", "Deployment", False),
    ("networking.k8s.io/v1", "Ingress", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler", True),
    ("policy/v1", "PodDisruptionBudget", True),
)

# KEDA's ScaledObject (autoscaling.backend: keda) is kept apart: its CRD exists only where
# KEDA is installed and the chart grants it only with keda.enabled, so the operator neither
# watches it nor reads it unless a model uses (or last used) the keda backend.
KEDA_KIND: tuple[str, str, bool] = ("keda.sh/v1alpha1", "ScaledObject", True)
ALL_KINDS: tuple[tuple[str, str, bool], ...] = (*CHILD_KINDS, KEDA_KIND)

_BUILDERS = {
    "Service": desired_service,
    "Deployment": desired_deployment,
    "Ingress": desired_ingress,
    "HorizontalPodAutoscaler": desired_hpa,
    "PodDisruptionBudget": desired_pdb,
    "ScaledObject": desired_scaled_object,
}


def desired_children(model: StreamingModel) -> dict[str, dict[str, Any] | None]:
    """Kind -> manifest, or None when that optional child must not exist."""
    return {kind: _BUILDERS[kind](model) for _, kind, _ in ALL_KINDS}


__all__ = [
    "ALL_KINDS",
    "CHILD_KINDS",
    "KEDA_KIND",
    "desired_children",
    "desired_deployment",
    "desired_hpa",
    "desired_ingress",
    "desired_pdb",
    "desired_scaled_object",
    "desired_service",
]
