"""Turn a StreamingModel object into a typed spec, or one readable error naming field and fix.

The API server enforces the same rules through the CRD schema and CEL; the operator checks
again because a cluster may run an older CRD, and because a message in the resource's status
is where people look first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .models.resource import StreamingModel
from .models.spec import ADAPTER_NAME_IS_BASE, StreamingModelSpec

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class SpecError(ValueError):
    """The spec cannot be served as written; `field` is the first offending path."""

    def __init__(self, message: str, field: str = "spec") -> None:
        super().__init__(message)
        self.field = field


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(["spec", *(str(p) for p in loc)])


def _describe(error: Mapping[str, Any]) -> str:
    where = _loc(error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field (check the spelling against `kubectl explain streamingmodel.spec`)"
    if error["type"] == "missing":
        return f"{where}: required field is missing"
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
    if name is not None and (len(name) > 63 or not DNS1035.match(name)):
        raise SpecError(
            f"metadata.name must be a DNS-1035 label (lower case letters, digits and '-', starting with a "
            f"letter, at most 63 characters); {name!r} is not. It also names the Service: rename the resource",
            field="metadata.name",
        )
    try:
        parsed = StreamingModelSpec.model_validate(dict(spec or {}))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        message = "; ".join(_describe(e) for e in errors)
        raise SpecError(message, field=_loc(errors[0]["loc"])) from None
    # The twin of the CRD root's rule: an unnamed non-hf base is served under the object's name.
    if (
        name is not None
        and parsed.model.served_name is None
        and not (parsed.model.uri.startswith("hf://"))
    ):
        if any(a.name == name for a in parsed.adapters):
            raise SpecError(f"spec.{ADAPTER_NAME_IS_BASE}: {name}", field="spec.adapters")
    return parsed


def parse_object(body: Mapping[str, Any]) -> StreamingModelSpec:
    meta = body.get("metadata") or {}
    return parse_spec(body.get("spec"), name=meta.get("name"))


def load_model(body: Mapping[str, Any], namespace: str | None = None) -> StreamingModel:
    """A StreamingModel object (as the API server or a file holds it) -> what builders take.

    `namespace` is used when the object has none (a file rendered offline); else "default".
    """
    meta = body.get("metadata") or {}
    return StreamingModel(
        name=meta["name"],
        namespace=meta.get("namespace") or namespace or "default",
        spec=parse_object(body),
    )
