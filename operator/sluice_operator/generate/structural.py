"""pydantic JSON Schema -> structural Kubernetes OpenAPI v3 schema.

pydantic emits JSON Schema; Kubernetes wants a *structural* schema: every node typed, no
`$ref`, no `anyOf` with null, no `additionalProperties: false`, no titles, and Kubernetes'
own extensions for quantities, free-form objects and list semantics. This module does
exactly that translation, node by node; `crd.py` adds the CRD's envelope.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..models.base import FREEFORM_MARKER, QUANTITY_MARKER

# Key order in the generated YAML: what a reader looks for first, extensions last.
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


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(raw, defs)
