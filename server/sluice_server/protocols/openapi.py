"""What `/openapi.json` says about the routes that read their body themselves.

The streaming routes read raw JSON (their own size limit and error wording, and no
validation work before auth), so FastAPI cannot see their bodies: the schemas are given
here from the same pydantic models that validate them, together with the event-stream
responses and the error object every refusal uses (with `Retry-After` where it is sent).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..core.params import GenerationBody
from ..engine.builtin_api import BODIES


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """Every refusal before the stream starts (OpenAI's error object)."""

    error: ErrorDetail


# Schemas the models refer to (`$ref`), added to the document's components by `install`.
COMPONENTS: dict[str, Any] = {}


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    COMPONENTS.update(schema.pop("$defs", {}))
    return schema


_ERROR = {"application/json": {"schema": schema_of(ErrorBody)}}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "integer"},
    }
}
# One server-sent event (schemathesis and other tools check each event against it).
_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_EVENT_STREAM = {"text/event-stream": {"schema": _EVENT}}

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (the message names the parameter).", "content": _ERROR},
    401: {"description": "Missing or invalid API key.", "content": _ERROR},
    404: {"description": "Protocol disabled on this server.", "content": _ERROR},
    413: {"description": "Request body over the size limit.", "content": _ERROR},
    429: {"description": "Rate limit or capacity reached.", "content": _ERROR,
          "headers": _RETRY_AFTER},
    503: {"description": "Engine not ready, or the server is draining.", "content": _ERROR,
          "headers": _RETRY_AFTER},
}  # fmt: skip


def streamed(stream: bool = True) -> dict[int | str, dict[str, Any]]:
    """Responses of a route that may stream (`text/event-stream`) and may refuse."""
    ok: dict[str, Any] = {"description": "The answer (JSON), or its events when streamed."}
    if stream:
        ok["content"] = {"application/json": {"schema": {"type": "object"}}, **_EVENT_STREAM}
    return {200: ok, **ERRORS}


def _body(model: type[BaseModel]) -> dict[str, Any]:
    content = {"application/json": {"schema": schema_of(model)}}
    return {"requestBody": {"required": True, "content": content}}


def api_body(kind: str) -> dict[str, Any]:
    """The body of an engine-rendered API kind (the simulator's model of it: vLLM's own
    request models accept more fields)."""
    return _body(BODIES[kind])


def stream_body() -> dict[str, Any]:
    return _body(GenerationBody)


def stream_query() -> dict[str, Any]:
    """`GET /v1/stream`: the body's fields as query parameters (EventSource). A query cannot
    say "prompt or messages", so `prompt` is the documented one and `messages` (a JSON
    array, instead of `prompt`) is described in the operation."""
    props = schema_of(GenerationBody)["properties"]
    params = [
        {"name": "prompt", "in": "query", "required": True, "schema": props["prompt"]},
        {
            "name": "api_key",
            "in": "query",
            "description": "For EventSource, which cannot send headers.",
            "schema": {"type": "string"},
        },
    ]
    for name, schema in props.items():
        if name not in ("prompt", "messages"):
            params.append({"name": name, "in": "query", "schema": schema})
    return {
        "parameters": params,
        "description": "The POST body's fields as query "
        "parameters; `messages` (a JSON array) may replace `prompt`; `stop` may repeat.",
    }


METRICS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format.",
          "content": {"text/plain": {"schema": {"type": "string"}}}}
}  # fmt: skip


def _served_model_only(doc: dict[str, Any], served: str) -> None:
    """`model` may only name the served model (anything else is a 400 model_not_found);
    where it may be null or left out, it still may."""
    name = {"type": "string", "enum": [served]}

    def only(schema: dict) -> dict:
        nullable = any(s.get("type") == "null" for s in schema.get("anyOf", ()))
        return {"anyOf": [name, {"type": "null"}], "title": "Model"} if nullable else name

    for path in doc.get("paths", {}).values():
        for op in path.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            props = body.get("schema", {}).get("properties", {})
            if "model" in props:
                props["model"] = only(props["model"])
            for param in op.get("parameters", []):
                if param["name"] == "model":
                    param["schema"] = only(param["schema"])


def install(app, served_model: str) -> None:
    """Add the models' shared schemas to the document's components (every `$ref`
    resolves) and pin `model` to the served model."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=app.description
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
            _served_model_only(doc, served_model)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
