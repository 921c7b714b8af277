"""OpenAI-compatible routes. On the vLLM engine they compose vLLM's own serving layer
(`OpenAIServingChat`/`Completion`/`Models`: chat templates, parameter mapping, tools,
usage) and wrap its SSE stream with our streaming behaviour (bounded buffer, timeout,
drain, edge metrics, abort on disconnect). On the simulator a small built-in formatter
(openai_builtin.py) speaks the same wire format."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..errors import error_body
from ..metrics import bind
from ..params import describe_validation_error
from ..services import Services, api_key_of, read_json, received_at, services
from ..sse import StreamingSSE
from ..streaming import FAILED, FINISHED, Meter, Stream, StreamFailed
from .common import open_stream

router = APIRouter()
PROTOCOL = "openai"


def _gate(request: Request, path: str) -> tuple[Services, str]:
    request.state.protocol = PROTOCOL
    svc = services(request)
    svc.require_protocol("sse", path)
    return svc, svc.authorize(PROTOCOL, api_key_of(request))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    svc, _ = _gate(request, "/v1/models")
    engine = await svc.require_engine()
    state = getattr(engine, "openai_state", None)
    if state is not None:
        models = await state.openai_serving_models.show_available_models()
        return JSONResponse(models.model_dump())
    from ..openai_builtin import model_list

    return JSONResponse(model_list(svc.settings.model_label))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "/v1/chat/completions", chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, "/v1/completions", chat=False)


def _precheck(svc: Services, body: dict) -> None:
    """What vLLM would reject less clearly (or not at all), with OpenAI-style errors."""
    served = svc.settings.model_label
    model = body.get("model")
    if model is not None and model != served:
        raise svc.bad_input(PROTOCOL, f"The model `{model}` does not exist; this server "
                            f"serves `{served}`.", "model", code="model_not_found")  # fmt: skip
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise svc.bad_input(PROTOCOL, f"{name}: must be a positive integer, got {v!r}.",
                                name)  # fmt: skip


async def _generate(request: Request, path: str, chat: bool) -> Response:
    svc, kid = _gate(request, path)
    body = await read_json(request, svc, PROTOCOL)
    engine = await svc.require_engine()
    _precheck(svc, body)
    state = getattr(engine, "openai_state", None)
    if state is None:
        from ..openai_builtin import handle

        return await handle(request, svc, kid, engine, body, chat)

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    from ..engine.vllm_engine import UsageTap, usage_tap

    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise svc.bad_input(PROTOCOL, *describe_validation_error(e)) from None
    svc.admit(PROTOCOL, kid)
    tap = UsageTap()
    usage_tap.set(tap)  # this request's context; the producer task copies it
    handler = state.openai_serving_chat if chat else state.openai_serving_completion
    t0 = received_at(request)
    admitted = True
    try:
        create = handler.create_chat_completion if chat else handler.create_completion
        try:
            result = await _unless_disconnected(request, create(req, request))
        except Exception as e:  # vLLM raises its validation errors; map them as vLLM does
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response,
            )

            result = create_error_response(e)
        if result is None:  # client left while vLLM rendered or generated (non-stream)
            meter = Meter(bind(svc.metrics, PROTOCOL), t0)
            meter.finish("disconnected")
            return Response(status_code=499)
        if isinstance(result, ErrorResponse):
            err = result.error
            if 400 <= err.code < 500:
                svc.metrics.reject(PROTOCOL, "bad_input")
            return JSONResponse(error_body(err.code, err.message, err.param), err.code)
        if not hasattr(result, "__aiter__"):  # non-streaming response object
            meter = Meter(bind(svc.metrics, PROTOCOL), t0)
            meter.tokens = tap.completion_tokens
            meter.finish(FINISHED)
            svc.limiter.charge_tokens(kid, tap.prompt_tokens + tap.completion_tokens)
            return JSONResponse(result.model_dump())
        admitted = False  # the stream owns the slot now
        stream, meter, cleanup = open_stream(
            svc, PROTOCOL, kid, result, t0, lambda: tap.prompt_tokens
        )
        return StreamingSSE(
            _vllm_events(stream, meter, tap),
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


def _error_event(message: str, code: str = "stream_error") -> bytes:
    payload = json.dumps(error_body(500, message, code=code))
    return f"event: error\ndata: {payload}\n\ndata: [DONE]\n\n".encode()


async def _vllm_events(stream: Stream, meter: Meter, tap) -> AsyncIterator[bytes]:
    """vLLM's chunks pass through unchanged; whatever piled up is written as one block."""
    while True:
        try:
            batch = await stream.next_batch()
        except StreamFailed as e:
            yield _error_event(str(e))
            meter.finish(FAILED, stream)
            return
        if batch is None:
            meter.tokens = max(meter.tokens, tap.completion_tokens)
            meter.finish(FINISHED, stream)
            return
        data = batch[0] if len(batch) == 1 else "".join(batch)
        yield data.encode()
        new = tap.completion_tokens - meter.tokens
        if new > 0:
            meter.wrote(new)
