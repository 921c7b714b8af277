"""OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

The engine renders OpenAI's wire format (`Engine.openai`: vLLM's own serving layer, or the
simulator's built-in formatter); this module adds Sluice's streaming behaviour on the
stream core (bounded buffer, timeout, drain, edge metrics, abort on disconnect) and sends
one error object after the 200 whatever the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..core.errors import ApiError, error_body
from ..core.events import DISCONNECTED, FINISHED, Failed, Meter, Tokens, events
from ..core.identity import Principal
from ..core.lifecycle import open_stream
from ..core.metrics import bind
from ..core.params import describe_validation_error
from ..core.services import Services, read_json, received_at, services, trail_of
from ..core.stream import Stream
from ..engine.base import OpenAIKind, OpenAIRequestError, OpenAIStream
from ..transport.sse import SSEResponse
from .openapi import openai_body, streamed

router = APIRouter(tags=["openai"])
PROTOCOL = "openai"


def _gate(request: Request, path: str) -> tuple[Services, Principal]:
    svc = services(request)
    svc.require_protocol("sse", path)
    return svc, svc.authorize(request, PROTOCOL)


@router.get("/v1/models", responses=streamed(stream=False))
async def list_models(request: Request) -> Response:
    """The served model (OpenAI's model list)."""
    svc, _ = _gate(request, "/v1/models")
    engine = await svc.require_engine()
    return JSONResponse(await engine.openai.models())


@router.post("/v1/chat/completions", openapi_extra=openai_body("chat"), responses=streamed())
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streamed (`"stream": true`, SSE) or not."""
    return await _generate(request, "/v1/chat/completions", "chat")


@router.post("/v1/completions", openapi_extra=openai_body("completion"), responses=streamed())
async def completions(request: Request) -> Response:
    """OpenAI (legacy) completions, streamed or not."""
    return await _generate(request, "/v1/completions", "completion")


def _precheck(svc: Services, body: dict) -> None:
    """What vLLM would reject less clearly (or not at all), with OpenAI-style errors."""
    served = svc.settings.model_label
    model = body.get("model")
    if model is not None and model != served:
        raise svc.bad_input(PROTOCOL, f"The model `{model}` does not exist; this server "
                            f"serves `{served}`.", "model", code="model_not_found")  # fmt: skip
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if v is not None and (not integral or isinstance(v, bool) or v < 1):
            raise svc.bad_input(PROTOCOL, f"{name}: must be a positive integer, got {v!r}.",
                                name)  # fmt: skip


async def _generate(request: Request, path: str, kind: OpenAIKind) -> Response:
    svc, who = _gate(request, path)
    body = await read_json(request, svc, PROTOCOL)
    engine = await svc.require_engine()
    _precheck(svc, body)
    try:
        parsed = engine.openai.parse(body, kind)
    except ValidationError as e:
        raise svc.bad_input(PROTOCOL, *describe_validation_error(e)) from None
    await svc.admit(PROTOCOL, who)
    t0 = received_at(request)
    trail = trail_of(request)
    admitted = True
    try:
        try:
            result = await _unless_disconnected(
                request, engine.openai.respond(parsed, kind, request)
            )
        except OpenAIRequestError as e:
            if 400 <= e.status < 500:
                raise svc.bad_input(PROTOCOL, e.message, e.param, status=e.status) from None
            raise ApiError(e.status, e.message, param=e.param) from None
        if result is None:  # client left while the engine rendered or generated (non-stream)
            Meter(bind(svc.metrics, PROTOCOL), t0, trail).finish(DISCONNECTED)
            return Response(status_code=499)
        if not isinstance(result, OpenAIStream):  # a whole answer
            trail.prompt_tokens = lambda: result.prompt_tokens
            meter = Meter(bind(svc.metrics, PROTOCOL), t0, trail)
            meter.tokens = result.completion_tokens
            meter.finish(FINISHED)
            svc.bill(who, result.prompt_tokens + result.completion_tokens)
            return JSONResponse(result.body, result.status)
        admitted = False  # the stream owns the slot now
        stream, meter, cleanup = open_stream(
            svc, trail, who, result.chunks, t0, result.prompt_tokens
        )
        return SSEResponse(
            _frames(stream, meter),
            cleanup,
            ping=svc.settings.heartbeat_seconds,
            send_timeout=svc.settings.send_timeout_seconds,
        )
    finally:
        if admitted:
            svc.gate.release()


async def _unless_disconnected(request: Request, work):
    """Run `work`; if the client goes first, cancel it (aborting any engine request) and
    return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


def error_event(message: str, code: str = "stream_error") -> bytes:
    """The error after the 200 (the same object as before it), then `[DONE]`."""
    payload = json.dumps(error_body(500, message, code=code))
    return f"event: error\ndata: {payload}\n\ndata: [DONE]\n\n".encode()


async def _frames(stream: Stream, meter: Meter) -> AsyncIterator[bytes]:
    """The engine's chunks pass through unchanged (whatever piled up as one block). The
    loop runs to its end after `Finished` (the engine's chunks already hold the final one and
    `[DONE]`), so the stream is recorded as finished, not as a client that left."""
    async for ev in events(stream, meter):
        if type(ev) is Tokens:
            yield ev.text.encode()
        elif type(ev) is Failed:
            yield error_event(ev.message, ev.code)
