"""Typed StreamingModel API: the single source of the CRD schema and of the operator's validation."""

from .spec import StreamingModelSpec
from .status import StreamingModelStatus

GROUP = "serving.sluice.dev"
VERSION = "v1alpha1"
KIND = "StreamingModel"
PLURAL = "streamingmodels"
SINGULAR = "streamingmodel"
SHORT_NAMES = ["sm", "smodel"]

__all__ = [
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "StreamingModelSpec",
    "StreamingModelStatus",
]
