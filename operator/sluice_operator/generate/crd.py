"""The StreamingModel CRD: the structural schema of the typed models plus the CRD envelope
(names, scope, subresources, printer columns, the name rule). The models are the only source
of the schema; `outputs.py` writes the result to crds/ and the operator chart.
"""

from __future__ import annotations

from typing import Any

from ..models import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    StreamingModelSpec,
    StreamingModelStatus,
)
from ..models.spec import ADAPTER_NAME_IS_BASE
from ..yamldump import dump_yaml
from .structural import model_schema

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILENAME = f"{CRD_NAME}.yaml"

ADAPTER_NAME_IS_OBJECT_RULE = (
    "!has(self.spec.adapters) || has(self.spec.model.servedName) || "
    "self.spec.model.uri.startsWith('hf://') || "
    "self.spec.adapters.all(a, a.name != self.metadata.name)"
)
DNS1035_RULE = (
    "self.metadata.name.size() <= 63 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
)


def openapi_schema() -> dict[str, Any]:
    return {
        "description": "A model served as a streaming endpoint: GPU pods running the Sluice server, "
        "a Service, an optional streaming-safe Nginx Ingress and a TTFT autoscaler.",
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "APIVersion of this object (serving.sluice.dev/v1alpha1).",
            },
            "kind": {"type": "string", "description": "Kind of this object (StreamingModel)."},
            "metadata": {"type": "object"},
            "spec": model_schema(StreamingModelSpec),
            "status": model_schema(StreamingModelStatus),
        },
        "x-kubernetes-validations": [
            {
                "rule": DNS1035_RULE,
                "message": "metadata.name must be a DNS-1035 label (lower case letters, digits and '-', "
                "starting with a letter, at most 63 characters): it also names the Service",
            },
            # The one adapter rule that needs the object's name (the base's served name
            # defaults to it); the others are on the spec (models/spec.py, ADAPTER_RULES).
            {
                "rule": ADAPTER_NAME_IS_OBJECT_RULE,
                "message": ADAPTER_NAME_IS_BASE,
                "fieldPath": ".spec.adapters",
            },
        ],
    }


PRINTER_COLUMNS = [
    {
        "name": "Model",
        "type": "string",
        "jsonPath": ".spec.model.uri",
        "description": "Model location.",
    },
    {
        "name": "GPUs",
        "type": "integer",
        "jsonPath": ".spec.resources.gpus",
        "description": "GPUs per replica.",
    },
    {
        "name": "TP",
        "type": "integer",
        "jsonPath": ".spec.parallelism.tensor",
        "description": "Tensor-parallel size.",
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.ready",
        "description": "Ready replicas / replicas.",
    },
    {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Pending, Progressing, Ready, Degraded or Failed.",
    },
    {
        "name": "Protocols",
        "type": "string",
        "jsonPath": ".spec.streaming.protocols",
        "priority": 1,
        "description": "Streaming protocols served.",
    },
    {
        "name": "URL",
        "type": "string",
        "jsonPath": ".status.url",
        "priority": 1,
        "description": "Ingress URL, else the Service URL.",
    },
    {
        "name": "TTFT-ms",
        "type": "integer",
        "jsonPath": ".status.autoscaling.currentTTFTMilliseconds",
        "priority": 1,
        "description": "Per-pod time to first token the autoscaler last read, in milliseconds.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {
                "app.kubernetes.io/name": "sluice-operator",
                "app.kubernetes.io/part-of": "sluice",
            },
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["sluice", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `python -m sluice_operator crds --write` from operator/sluice_operator/models. Do not edit.\n"


def render_crd() -> str:
    return HEADER + "---\n" + dump_yaml(build_crd())
