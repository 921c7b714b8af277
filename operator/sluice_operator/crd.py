"""Generate the StreamingModel CRD from the typed models (the only source of the schema).

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: every node
typed, no `$ref`, no `anyOf` with null, no `additionalProperties: false`, no titles, and
Kubernetes' own extensions for quantities, free-form objects and list semantics. This module
does exactly that translation and adds the CRD's envelope (subresources, printer columns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .models import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    StreamingModelSpec,
    StreamingModelStatus,
)
from .models.base import FREEFORM_MARKER, QUANTITY_MARKER

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILENAME = f"{CRD_NAME}.yaml"
# Repository-relative places the generated file is written to (identical copies).
CRD_PATHS = (Path("crds") / CRD_FILENAME, Path("charts/sluice-operator/crds") / CRD_FILENAME)

_KEY_ORDER = [
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
]

DNS1035_RULE = (
    "self.metadata.name.size() <= 63 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
)


def _order(node: dict[str, Any]) -> dict[str, Any]:
    def rank(k: str) -> tuple[int, str]:
        if k in _KEY_ORDER:
            return (_KEY_ORDER.index(k), k)
        return (len(_KEY_ORDER) + (1 if k.startswith("x-") else 0), k)

    return {k: node[k] for k in sorted(node, key=rank)}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON Schema node into a structural Kubernetes schema node."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's description/default beat the class docstring
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if node.pop(QUANTITY_MARKER, False) or any(o.get(QUANTITY_MARKER) for o in options):
            node = {
                **{
                    k: v
                    for o in options
                    for k, v in o.items()
                    if k not in ("type", "anyOf", QUANTITY_MARKER)
                },
                **node,
            }
            node["x-kubernetes-int-or-string"] = True
        elif len(options) == 1:
            node = {**options[0], **node}
            return structural(node, defs)
        else:  # pragma: no cover - the models never need a real union
            raise ValueError(f"cannot express union {options} structurally")
    node.pop("title", None)
    node.pop(QUANTITY_MARKER, None)
    if node.get("default", ...) is None:
        node.pop("default")
    if node.pop(FREEFORM_MARKER, False):
        keep = {k: node[k] for k in ("description",) if k in node}
        return _order({**keep, "type": "object", "x-kubernetes-preserve-unknown-fields": True})
    if node.get("additionalProperties") is False or "properties" in node:
        node.pop("additionalProperties", None)
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = structural(node["additionalProperties"], defs)
    if "properties" in node:
        node["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = structural(node["items"], defs)
    if isinstance(node.get("exclusiveMinimum"), int | float) and not isinstance(
        node["exclusiveMinimum"], bool
    ):
        node["minimum"], node["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if isinstance(node.get("exclusiveMaximum"), int | float) and not isinstance(
        node["exclusiveMaximum"], bool
    ):
        node["maximum"], node["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if node.get("uniqueItems"):
        node.pop("uniqueItems")
        node.setdefault("x-kubernetes-list-type", "set")
    return _order(node)


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(raw, defs)


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
            }
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


class IndentedDumper(yaml.SafeDumper):
    """Indents block sequences under their key (what yamllint's default `indentation` wants)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=IndentedDumper, sort_keys=False, width=120, allow_unicode=True)


def render_crd() -> str:
    return HEADER + "---\n" + dump_yaml(build_crd())


def generated_files() -> dict[Path, str]:
    """Repository-relative path -> content of everything generated from the models."""
    from .apidocs import DOC_PATH, render_api_doc

    text = render_crd()
    return {**{rel: text for rel in CRD_PATHS}, DOC_PATH: render_api_doc()}


def write_crds(root: Path) -> list[Path]:
    written = []
    for rel, text in generated_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def stale_crds(root: Path) -> list[Path]:
    """Checked-in generated files (CRD copies, docs/api.md) that differ from the models."""
    return [
        root / rel
        for rel, text in generated_files().items()
        if not (root / rel).is_file() or (root / rel).read_text() != text
    ]
