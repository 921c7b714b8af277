"""Validation of /v1/stream and WebSocket generation requests into a StreamRequest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine.base import (
    Adapter,
    ClientSalt,
    Engine,
    Flag,
    PromptOrMessages,
    SamplingOptions,
    StreamRequest,
    not_a_flag,
)
from .errors import ApiError


class GenerationParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: Flag = False
    cache_salt: ClientSalt | None = Field(
        None,
        description="The client's own salt for the prefix cache: requests share "
        "cached prefixes only with requests of the same tenant and the same salt.",
    )

    _numbers = field_validator("max_tokens", "temperature", "top_p", "seed", mode="before")(
        not_a_flag
    )


class GenerationBody(GenerationParams, PromptOrMessages):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=PromptOrMessages.model_config["json_schema_extra"]
    )
    model: str | None = None


def describe_validation_error(e: ValidationError) -> tuple[str, str | None]:
    """One readable message (and the first offending parameter) for every route's 400."""
    parts, param = [], None
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        param = param or where or None
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "Invalid request", param


def to_stream_request(
    body: dict[str, Any],
    request_id: str,
    engine: Engine,
    route: Callable[[str | None], Adapter | None],
) -> StreamRequest:
    """Validated StreamRequest (prompt rendered and length-checked when the engine can),
    or ApiError 400 saying what is wrong (`reason` bad_input). `route` turns the body's
    `model` into the adapter to generate with (None: the base), or raises its ApiError."""
    try:
        b = GenerationBody.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise ApiError(400, message, reason="bad_input", param=param) from None
    adapter = route(b.model)
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req = StreamRequest(
        request_id=request_id,
        prompt=b.prompt,
        messages=[m.model_dump(exclude_none=True) for m in b.messages] if b.messages else None,
        options=SamplingOptions(b.max_tokens, b.temperature, b.top_p, b.seed, stop, b.ignore_eos),
        adapter=adapter,
        cache_salt=b.cache_salt,  # the client's; the route combines it with the tenant's
    )
    try:
        engine.prepare(req)
    except ValueError as e:
        raise ApiError(
            400, str(e), reason="bad_input", param="prompt", code="context_length_exceeded"
        ) from None
    except Exception as e:  # chat template rejected the messages
        raise ApiError(
            400,
            f"Cannot render the prompt: {type(e).__name__}: {e}",
            reason="bad_input",
            param="messages",
        ) from None
    return req
