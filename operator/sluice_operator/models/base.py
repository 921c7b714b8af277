"""Shared pieces of the typed API: camelCase aliases, strict unknown-field handling, quantities."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

# A Kubernetes quantity ("8Gi", "500m", 4). The CRD generator turns the marker into
# `x-kubernetes-int-or-string: true`, which is what the API server expects for quantities.
QUANTITY_MARKER = "x-sluice-quantity"
_QUANTITY_RE = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and _QUANTITY_RE.match(value):
        return value
    raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 4, 500m, 8Gi)")


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    Field(json_schema_extra={QUANTITY_MARKER: True}),
]

# Free-form Kubernetes objects we pass through untouched (affinity, env valueFrom): the CRD
# marks them `x-kubernetes-preserve-unknown-fields` and the API server's own types check them
# when they land in the Deployment.
FREEFORM_MARKER = "x-sluice-freeform"
FreeForm = Annotated[dict[str, Any], Field(json_schema_extra={FREEFORM_MARKER: True})]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One `x-kubernetes-validations` entry; `fieldPath` makes the API server point at the field."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


def sub(model: type[BaseModel], description: str) -> Any:
    """A nested object that is always present (defaulted to `{}` so its own defaults apply)."""
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": {}},
    )
