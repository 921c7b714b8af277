"""Turn a StreamingModel object into a typed spec, or one readable error naming field and fix.

The API server enforces the same rules through the CRD schema and CEL; the operator checks
again because a cluster may run an older CRD, and because a message in the resource's status
is where people look first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .models.base import RULE_ERROR
from .models.resource import (
    ADAPTER_NAME_RULE,
    NAME_RULE,
    SPLIT_SELF_RULE,
    WEIGHTS_REFRESH_ANNOTATION,
    OperatorDefaults,
    StreamingModel,
)
from .models.spec import StreamingModelSpec


class SpecError(ValueError):
    """The spec cannot be served as written; `field` is the first offending path."""

    def __init__(self, message: str, field: str = "spec") -> None:
        super().__init__(message)
        self.field = field


def _loc(error: Mapping[str, Any]) -> str:
    """Where the error is: the field, or for a `Rule` its node and fieldPath (as the API
    server says it)."""
    path = ["spec", *(str(p) for p in error["loc"])]
    if error["type"] == RULE_ERROR and error["ctx"]["field"]:
        path.append(error["ctx"]["field"].lstrip("."))
    return ".".join(path)


def _describe(error: Mapping[str, Any]) -> str:
    where = _loc(error)
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field (check the spelling against `kubectl explain streamingmodel.spec`)"
    if error["type"] == "missing":
        return f"{where}: required field is missing"
    if error["type"] == RULE_ERROR:
        return f"{where}: {error['msg']}"
    msg = error["msg"].removeprefix("Value error, ")
    # Validators raising ValueError already say what to do; pydantic's own messages get the value.
    if (
        error["type"] != "value_error"
        and "input" in error
        and not isinstance(error["input"], dict | list)
    ):
        msg = f"{msg} (got {error['input']!r})"
    return f"{where}: {msg}"


def parse_spec(spec: Mapping[str, Any] | None, name: str | None = None) -> StreamingModelSpec:
    """Validate a raw `.spec` (camelCase, as stored) and the object's name."""
    if name is not None and not NAME_RULE.holds(name):
        raise SpecError(NAME_RULE.error(name), field="metadata.name")
    try:
        parsed = StreamingModelSpec.model_validate(dict(spec or {}))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        message = "; ".join(_describe(e) for e in errors)
        raise SpecError(message, field=_loc(errors[0])) from None
    if name is not None and not ADAPTER_NAME_RULE.holds((name, parsed)):
        raise SpecError(f"spec.{ADAPTER_NAME_RULE.error((name, parsed))}", field="spec.adapters")
    if name is not None and not SPLIT_SELF_RULE.holds((name, parsed)):
        raise SpecError(SPLIT_SELF_RULE.error((name, parsed)), field="spec.routing.router.split")
    return parsed


def parse_object(body: Mapping[str, Any]) -> StreamingModelSpec:
    meta = body.get("metadata") or {}
    return parse_spec(body.get("spec"), name=meta.get("name"))


def load_model(
    body: Mapping[str, Any],
    namespace: str | None = None,
    *,
    defaults: OperatorDefaults | None = None,
) -> StreamingModel:
    """A StreamingModel object (as the API server or a file holds it) -> what builders take.

    `namespace` is used when the object has none (a file rendered offline); else "default".
    `defaults`: the operator's configuration (`run --model-image`); None: the built-in one.
    """
    meta = body.get("metadata") or {}
    return StreamingModel(
        name=meta["name"],
        namespace=meta.get("namespace") or namespace or "default",
        spec=parse_object(body),
        defaults=defaults or OperatorDefaults(),
        weights_refresh=str((meta.get("annotations") or {}).get(WEIGHTS_REFRESH_ANNOTATION, "")),
    )
