"""Validation of /v1/stream and WebSocket generation requests into a StreamRequest."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine.base import Engine, Flag, PromptOrMessages, SamplingOptions, StreamRequest, not_a_flag
from .errors import ApiError


class GenerationParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: Flag = False

    _numbers = field_validator("max_tokens", "temperature", "top_p", "seed",
                               mode="before")(not_a_flag)  # fmt: skip


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
    body: dict[str, Any], request_id: str, engine: Engine, served: str
) -> StreamRequest:
    """Validated StreamRequest (prompt rendered and length-checked when the engine can),
    or ApiError 400 saying what is wrong (`reason` bad_input)."""
    try:
        b = GenerationBody.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise ApiError(400, message, reason="bad_input", param=param) from None
    if b.model is not None and b.model != served:
        raise ApiError(400, f"The model `{b.model}` does not exist; this server serves "
                       f"`{served}`.", reason="bad_input", param="model",
                       code="model_not_found")  # fmt: skip
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req = StreamRequest(
        request_id=request_id,
        prompt=b.prompt,
        messages=[m.model_dump(exclude_none=True) for m in b.messages] if b.messages else None,
        options=SamplingOptions(b.max_tokens, b.temperature, b.top_p, b.seed, stop, b.ignore_eos),
    )
    try:
        engine.prepare(req)
    except ValueError as e:
        raise ApiError(400, str(e), reason="bad_input", param="prompt",
                       code="context_length_exceeded") from None  # fmt: skip
    except Exception as e:  # chat template rejected the messages
        raise ApiError(400, f"Cannot render the prompt: {type(e).__name__}: {e}",
                       reason="bad_input", param="messages") from None  # fmt: skip
    return req
