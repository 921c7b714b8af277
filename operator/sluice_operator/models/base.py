"""Shared pieces of the typed API: camelCase aliases, strict unknown-field handling, quantities."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

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


# The pydantic error type of a failed `Rule` (`validation` names the field from its context).
RULE_ERROR = "spec_rule"


@dataclass(frozen=True)
class Rule:
    """One validation rule, written once: the API server runs `cel` (an entry of the CRD's
    `x-kubernetes-validations` on the model's node), the operator runs `holds` on the parsed
    object (`ApiModel`'s validator), and both say `message`.

    `field`: the CEL fieldPath (".extraArgs", relative to the node), where both the API
    server and the operator say the error is. `detail`: what the operator adds in
    parentheses, which a CEL message cannot: the values it found, and the fix they point to.
    `holds` may be stricter than `cel` where CEL cannot express a case; `message` then says
    what CEL checks and `detail` the rest.
    """

    cel: str
    message: str
    holds: Callable[[Any], bool]
    field: str | None = None
    detail: Callable[[Any], str] | None = None

    def validation(self) -> dict[str, str]:
        """The CRD's `x-kubernetes-validations` entry; `fieldPath` makes the API server point
        at the field."""
        entry = {"rule": self.cel, "message": self.message}
        if self.field:
            entry["fieldPath"] = self.field
        return entry

    def error(self, obj: Any) -> str:
        """What the operator says about `obj`, which breaks this rule."""
        return f"{self.message} ({self.detail(obj)})" if self.detail else self.message


def _validations(schema: dict[str, Any], cls: type) -> None:
    rules = getattr(cls, "RULES", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.validation() for r in rules]


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected, and the
    class's `RULES` checked here and written into the CRD."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        json_schema_extra=_validations,
    )
    RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _rules(self) -> Self:
        for rule in self.RULES:
            if not rule.holds(self):
                ctx = {"message": rule.error(self), "field": rule.field or ""}
                raise PydanticCustomError(RULE_ERROR, "{message}", ctx)
        return self


def sub(model: type[BaseModel], description: str) -> Any:
    """A nested object that is always present (defaulted to `{}` so its own defaults apply)."""
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": {}},
    )
