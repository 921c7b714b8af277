"""A small OpenAI wire-format formatter over the Engine protocol, used when the engine is
the simulator (no vLLM, no tokenizer). With vLLM the routes use vLLM's own serving layer.

Covers chat and completions, streaming and not, `stream_options.include_usage`, `stop`,
`max_tokens`, `temperature`, `top_p`, `seed`, `n=1`. Chunks are pre-encoded strings.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .engine.base import Engine, SamplingOptions, StreamRequest
from .params import Message, describe_validation_error
from .routes.common import open_stream
from .services import Services, received_at
from .sse import StreamingSSE
from .streaming import FAILED, FINISHED, Meter, Stream, StreamFailed, join_batch

PROTOCOL = "openai"
_dumps = json.dumps


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str


def model_list(name: str) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "sluice"}]}  # fmt: skip


async def handle(request: Request, svc: Services, kid: str, engine: Engine, body: dict,
                 chat: bool) -> Response:  # fmt: skip

    try:
        b = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        raise svc.bad_input(PROTOCOL, *describe_validation_error(e)) from None
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    max_tokens = b.max_completion_tokens or b.max_tokens or 16
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    req = StreamRequest(
        request_id=rid,
        prompt=None if chat else b.prompt,
        messages=[m.model_dump(exclude_none=True) for m in b.messages] if chat else None,
        options=SamplingOptions(max_tokens, b.temperature, b.top_p, b.seed, stop, b.ignore_eos),
    )
    svc.admit(PROTOCOL, kid)
    model = svc.settings.model_label
    stream, meter, cleanup = open_stream(svc, PROTOCOL, kid, engine.generate(req),
                                         received_at(request))  # fmt: skip
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    events = _events(stream, meter, rid, model, chat, include_usage)
    if b.stream:
        return StreamingSSE(events, cleanup, ping=svc.settings.heartbeat_seconds,
                            send_timeout=svc.settings.send_timeout_seconds)  # fmt: skip
    try:
        return await _collect(stream, meter, rid, model, chat)
    finally:
        cleanup()


async def _collect(stream: Stream, meter: Meter, rid: str, model: str, chat: bool) -> Response:
    parts, last = [], None
    while True:
        try:
            batch = await stream.next_batch()
        except StreamFailed as e:
            meter.finish(FAILED, stream)
            return JSONResponse({"error": {"message": str(e), "type": "internal_error",
                                           "param": None, "code": 500}}, 500)  # fmt: skip
        if batch is None:
            break
        for d in batch:
            parts.append(d.text)
            last = d
    text = "".join(parts)
    usage = _usage(last)
    meter.tokens = usage["completion_tokens"]
    meter.finish(FINISHED, stream)
    reason = last.finish_reason if last else "abort"
    choice = ({"index": 0, "message": {"role": "assistant", "content": text},
               "finish_reason": reason} if chat else
              {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})  # fmt: skip
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [choice],
                         "usage": usage})  # fmt: skip


def _usage(last) -> dict:
    p = last.prompt_tokens if last else 0
    c = last.completion_tokens if last else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _events(stream: Stream, meter: Meter, rid: str, model: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:  # fmt: skip
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
            f'"model":{_dumps(model)},"choices":[')  # fmt: skip
    tail = "]}\n\n"
    if chat:
        yield f'{head}{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null}}{tail}'.encode()

    def piece(text: str, reason) -> str:
        r = "null" if reason is None else _dumps(reason)
        if chat:
            return f'{head}{{"index":0,"delta":{{"content":{_dumps(text)}}},"finish_reason":{r}}}{tail}'
        return (
            f'{head}{{"index":0,"text":{_dumps(text)},"logprobs":null,"finish_reason":{r}}}{tail}'
        )

    while True:
        try:
            batch = await stream.next_batch()
        except StreamFailed as e:
            err = {"error": {"message": str(e), "type": "stream_error", "param": None,
                             "code": 500}}  # fmt: skip
            yield f"event: error\ndata: {_dumps(err)}\n\ndata: [DONE]\n\n".encode()
            meter.finish(FAILED, stream)
            return
        if batch is None:
            yield b"data: [DONE]\n\n"
            meter.finish(FAILED, stream)
            return
        last = batch[-1]
        text, ntok = join_batch(batch)
        if text or last.finished:
            yield piece(text, last.finish_reason if last.finished else None).encode()
            meter.wrote(ntok)
        else:
            meter.tokens += ntok
        if last.finished:
            if include_usage:
                u = _dumps(_usage(last))
                yield f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{_dumps(model)},"choices":[],"usage":{u}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
            meter.finish(FINISHED, stream)
            return
