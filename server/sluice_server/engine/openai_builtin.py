"""A small OpenAI serving layer over any `Engine.generate`, used by the simulator (no vLLM,
no tokenizer). With vLLM the OpenAI routes use vLLM's own serving layer instead.

Covers chat and completions, streaming and not, `stream_options.include_usage`, `stop`,
`max_tokens`, `temperature`, `top_p`, `seed`, `n=1`. Chunks are pre-encoded strings.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .base import (
    Delta,
    Flag,
    Message,
    OpenAIKind,
    OpenAIReply,
    OpenAIStream,
    SamplingOptions,
    StreamRequest,
    not_a_flag,
)

_dumps = json.dumps


class StreamOptions(BaseModel):
    include_usage: Flag = False


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
    stream: Flag = False
    stream_options: StreamOptions | None = None
    ignore_eos: Flag = False

    _numbers = field_validator("max_tokens", "max_completion_tokens", "temperature", "top_p",
                               "seed", "n", mode="before")(not_a_flag)  # fmt: skip


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str


def _usage(last: Delta | None) -> dict:
    p = last.prompt_tokens if last else 0
    c = last.completion_tokens if last else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class BuiltinOpenAI:
    """Implements `engine.base.OpenAIServing` on `generate(StreamRequest)`."""

    def __init__(self, model: str, generate: Callable[[StreamRequest], AsyncIterator[Delta]]):
        self.model = model
        self._generate = generate

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "sluice"}]}  # fmt: skip

    def parse(self, body: dict, kind: OpenAIKind) -> ChatBody | CompletionBody:
        return (ChatBody if kind == "chat" else CompletionBody).model_validate(body)

    async def respond(self, b: Any, kind: OpenAIKind, http_request: Any):
        chat = kind == "chat"
        stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        max_tokens = b.max_completion_tokens or b.max_tokens or 16
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        req = StreamRequest(
            request_id=rid,
            prompt=None if chat else b.prompt,
            messages=[m.model_dump(exclude_none=True) for m in b.messages] if chat else None,
            options=SamplingOptions(
                max_tokens, b.temperature, b.top_p, b.seed, stop, b.ignore_eos
            ),  # fmt: skip
        )
        deltas = self._generate(req)
        if b.stream:
            usage = bool(b.stream_options and b.stream_options.include_usage)
            return OpenAIStream(self._chunks(deltas, rid, chat, usage),
                                lambda: len(req.prompt_token_ids or ()))  # fmt: skip
        return await self._collect(deltas, rid, chat)

    async def _collect(self, deltas: AsyncIterator[Delta], rid: str, chat: bool) -> OpenAIReply:
        parts, last = [], None
        async for d in deltas:
            parts.append(d.text)
            last = d
        text = "".join(parts)
        usage = _usage(last)
        reason = last.finish_reason if last else "abort"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})  # fmt: skip
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": usage}  # fmt: skip
        return OpenAIReply(body, 200, usage["prompt_tokens"], usage["completion_tokens"])

    async def _chunks(self, deltas: AsyncIterator[Delta], rid: str, chat: bool,
                      include_usage: bool) -> AsyncIterator[Delta]:  # fmt: skip
        """Each delta framed as one chunk; the finishing one also carries the usage chunk
        and `[DONE]`. An engine-side abort ends without `[DONE]`: the stream core then
        sends the error event."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                f'"model":{_dumps(self.model)},"choices":[')  # fmt: skip
        tail = "]}\n\n"

        def piece(text: str, reason) -> str:
            r = "null" if reason is None else _dumps(reason)
            if chat:
                return f'{head}{{"index":0,"delta":{{"content":{_dumps(text)}}},"finish_reason":{r}}}{tail}'
            return f'{head}{{"index":0,"text":{_dumps(text)},"logprobs":null,"finish_reason":{r}}}{tail}'

        first = (f'{head}{{"index":0,"delta":{{"role":"assistant","content":""}},'
                 f'"finish_reason":null}}{tail}') if chat else ""  # fmt: skip
        try:
            async for d in deltas:
                if d.finished and d.finish_reason == "abort":
                    yield Delta("", d.num_tokens, True, "abort", d.prompt_tokens,
                                d.completion_tokens)  # fmt: skip
                    return
                if d.text or d.finished:
                    text = first + piece(d.text, d.finish_reason if d.finished else None)
                    first = ""
                else:
                    text = ""
                if d.finished:
                    if include_usage:
                        text += (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                                 f'"model":{_dumps(self.model)},"choices":[],'
                                 f'"usage":{_dumps(_usage(d))}}}\n\n')  # fmt: skip
                    text += "data: [DONE]\n\n"
                yield Delta(text, d.num_tokens, d.finished, d.finish_reason, d.prompt_tokens,
                            d.completion_tokens)  # fmt: skip
        finally:
            await deltas.aclose()
