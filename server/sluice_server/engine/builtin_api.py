"""A small serving layer for every client API over any `Engine.generate`, used by the
simulator (no vLLM, no tokenizer). With vLLM the API routes use vLLM's own serving layer.

Covers OpenAI chat and completions (`stream_options.include_usage`, `stop`, `max_tokens`,
`temperature`, `top_p`, `seed`, `n=1`), OpenAI Responses (text input or messages,
`instructions`, `max_output_tokens`), Anthropic Messages (`system`, `max_tokens`,
`stop_sequences`), streamed and not (event formats in `builtin_events.py`), and the
utility kinds: count_tokens and tokenize count the simulator's tokens (the prompt's words,
as `prepare` does); detokenize needs a vocabulary the simulator does not have (501).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from .base import (
    ApiKind,
    ApiReply,
    ApiRequestError,
    ApiStream,
    ClientSalt,
    Delta,
    Engine,
    Flag,
    Message,
    PromptOrMessages,
    SamplingOptions,
    StreamRequest,
    not_a_flag,
)
from .builtin_events import (
    STOP_REASONS,
    ChatFramer,
    MessagesFramer,
    ResponsesFramer,
    anthropic_usage,
    message_item,
    openai_usage,
    response_object,
    response_status,
    responses_usage,
    usage_of,
)


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
    cache_salt: ClientSalt | None = None
    # Set by the routes from the router's header (core/kvtransfer.py), never by a client (a
    # body that carries it is a 400): not in the published schema.
    kv_transfer_params: SkipJsonSchema[dict[str, Any] | None] = None

    _numbers = field_validator(
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", mode="before"
    )(not_a_flag)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str


class InputItem(BaseModel):
    """A Responses input message (content: text, or parts with `text`)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: str | list[dict[str, Any]]


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: Flag = False
    ignore_eos: Flag = False
    cache_salt: ClientSalt | None = None
    kv_transfer_params: SkipJsonSchema[dict[str, Any] | None] = None  # as above

    _numbers = field_validator("max_output_tokens", "temperature", "top_p", mode="before")(
        not_a_flag
    )


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: Flag = False
    ignore_eos: Flag = False
    cache_salt: ClientSalt | None = None
    kv_transfer_params: SkipJsonSchema[dict[str, Any] | None] = None  # as above

    _numbers = field_validator("max_tokens", "temperature", "top_p", mode="before")(not_a_flag)


class TokenizeBody(PromptOrMessages):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


BODIES: dict[str, type[BaseModel]] = {
    "chat": ChatBody,
    "completion": CompletionBody,
    "responses": ResponsesBody,
    "messages": MessagesBody,
    "count_tokens": CountTokensBody,
    "tokenize": TokenizeBody,
    "detokenize": DetokenizeBody,
}


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content)


def _anthropic_messages(b: CountTokensBody) -> list[dict]:
    system = [] if b.system is None else [{"role": "system", "content": _text_of(b.system)}]
    return system + [{"role": m.role, "content": _text_of(m.content)} for m in b.messages]


def _responses_messages(b: ResponsesBody) -> list[dict]:
    msgs = [] if b.instructions is None else [{"role": "system", "content": b.instructions}]
    if isinstance(b.input, str):
        return [*msgs, {"role": "user", "content": b.input}]
    return msgs + [{"role": i.role, "content": _text_of(i.content)} for i in b.input]


class BuiltinApi:
    """Implements `engine.base.ApiServing` on an engine's `generate` and `prepare`."""

    def __init__(self, model: str, engine: Engine) -> None:
        self.model = model
        self._engine = engine

    async def models(self) -> dict[str, Any]:
        """The base, then each loaded adapter with the base as `parent` (as vLLM lists them)."""
        data: list[dict[str, Any]] = [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "sluice"}
        ]
        for a in getattr(self._engine, "adapters", {}).values():
            data.append(
                {
                    "id": a.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sluice",
                    "root": a.path,
                    "parent": self.model,
                }
            )
        return {"object": "list", "data": data}

    def version(self) -> dict[str, Any]:
        return {"version": "simulator"}

    def parse(self, body: dict[str, Any], kind: ApiKind) -> BaseModel:
        return BODIES[kind].model_validate(body)

    def _prepared(self, req: StreamRequest) -> StreamRequest:
        try:
            self._engine.prepare(req)
        except ValueError as e:
            raise ApiRequestError(400, str(e)) from None
        return req

    async def respond(
        self,
        b: Any,
        kind: ApiKind,
        http_request: Any,
        priority: int = 0,
        resume: list[int] | None = None,
    ) -> ApiReply | ApiStream:
        if kind == "detokenize":
            raise ApiRequestError(
                501,
                "The simulator has no vocabulary to detokenize with; "
                "/detokenize needs a model (--engine vllm).",
            )
        if kind in ("tokenize", "count_tokens"):
            if kind == "tokenize":
                msgs = b.messages and [m.model_dump(exclude_none=True) for m in b.messages]
            else:
                msgs = _anthropic_messages(b)
            req = self._prepared(
                StreamRequest("tok", prompt=getattr(b, "prompt", None), messages=msgs)
            )
            ids = req.prompt_token_ids or []
            if kind == "count_tokens":
                return ApiReply({"input_tokens": len(ids)})
            return ApiReply(
                {
                    "count": len(ids),
                    "max_model_len": self._engine.max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            )
        req, framer = self._request(b, kind)
        req.priority = priority
        req.resume_ids = resume
        req.cache_salt = b.cache_salt  # what the routes set (core/auth/cachesalt.py)
        req.kv_transfer_params = b.kv_transfer_params
        req.adapter = getattr(self._engine, "adapters", {}).get(getattr(b, "model", None))
        deltas = self._engine.generate(req)
        if b.stream:
            return ApiStream(_chunks(deltas, framer), lambda: len(req.prompt_token_ids or ()))
        return await self._collect(deltas, req, kind, b)

    def _request(self, b: Any, kind: ApiKind) -> tuple[StreamRequest, Any]:
        prefix = {
            "chat": "chatcmpl-",
            "completion": "cmpl-",
            "responses": "resp_",
            "messages": "msg_",
        }[kind]
        rid = prefix + uuid.uuid4().hex
        if kind in ("chat", "completion"):
            chat = kind == "chat"
            stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
            opts = SamplingOptions(
                b.max_completion_tokens or b.max_tokens or 16,
                b.temperature,
                b.top_p,
                b.seed,
                stop,
                b.ignore_eos,
            )
            usage = bool(b.stream_options and b.stream_options.include_usage)
            req = StreamRequest(
                rid,
                prompt=None if chat else b.prompt,
                options=opts,
                messages=[m.model_dump(exclude_none=True) for m in b.messages] if chat else None,
            )
            return req, ChatFramer(rid, self.model, chat, usage)
        if kind == "responses":
            opts = SamplingOptions(
                b.max_output_tokens or 16,
                1.0 if b.temperature is None else b.temperature,
                b.top_p or 1.0,
                ignore_eos=b.ignore_eos,
            )
            req = StreamRequest(rid, messages=_responses_messages(b), options=opts)
            return self._prepared(req), ResponsesFramer(rid, self.model, b.model_dump())
        opts = SamplingOptions(
            b.max_tokens, b.temperature, b.top_p, None, list(b.stop_sequences or []), b.ignore_eos
        )
        req = StreamRequest(rid, messages=_anthropic_messages(b), options=opts)
        return self._prepared(req), MessagesFramer(rid, self.model)

    async def _collect(
        self, deltas: AsyncIterator[Delta], req: StreamRequest, kind: ApiKind, b: Any
    ) -> ApiReply:
        parts, last = [], None
        async for d in deltas:
            parts.append(d.text)
            last = d
        text = "".join(parts)
        p, c = usage_of(last)
        reason = last.finish_reason if last else "abort"
        rid = req.request_id
        if kind == "responses":
            body = response_object(
                rid,
                self.model,
                int(time.time()),
                b.model_dump(),
                response_status(reason),
                [message_item("msg_" + uuid.uuid4().hex, text, "completed")],
                responses_usage(p, c, last.cached_tokens if last else None),
            )
        elif kind == "messages":
            body = {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": STOP_REASONS.get(reason or "stop", "end_turn"),
                "stop_sequence": None,
                "usage": anthropic_usage(p, c, last.cached_tokens if last else None),
            }
        else:
            chat = kind == "chat"
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            )
            body = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": openai_usage(last),
            }
        if last is not None and last.kv_transfer_params is not None:
            body["kv_transfer_params"] = last.kv_transfer_params  # as vLLM's answers carry them
        return ApiReply(body, 200, p, c)


async def _chunks(deltas: AsyncGenerator[Delta, None], framer: Any) -> AsyncGenerator[Delta, None]:
    """Each delta framed in the API's events; the opening goes out before the engine
    answers. An engine-side abort ends without the closing events: the stream core then
    sends the API's error event."""
    opening = framer.opening()
    if opening:
        yield Delta(opening, 0)
    started = False
    try:
        async for d in deltas:
            if d.finished and d.finish_reason == "abort":
                yield Delta(
                    "",
                    d.num_tokens,
                    True,
                    "abort",
                    d.prompt_tokens,
                    d.completion_tokens,
                    d.cached_tokens,
                )
                return
            text = ""
            if d.text or d.finished:
                if not started:
                    text, started = framer.start(d), True
                text += framer.end(d) if d.finished else framer.text(d.text)
            yield Delta(
                text,
                d.num_tokens,
                d.finished,
                d.finish_reason,
                d.prompt_tokens,
                d.completion_tokens,
                d.cached_tokens,
                d.token_ids,
            )
    finally:
        await deltas.aclose()
