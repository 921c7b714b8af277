"""vLLM's own serving layer for every client API, behind `engine.base.ApiServing`.

The API routes reach vLLM's serving classes (chat templates, parameter mapping, tools,
usage, event shapes), built by vLLM's own `init_app_state` on a private `State`, through
`VllmApi`: `OpenAIServingChat`/`Completion`/`Responses`/`Models`,
`AnthropicServingMessages` and `ServingTokenization`. One table (`_HANDLERS`) says which
class serves which `ApiKind`; `MeteredClient` taps the engine client those classes
generate through, for the token counts our metrics and rate limits need.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from . import vllm_chat_stream
from .base import ApiKind, ApiReply, ApiRequestError, ApiStream, Delta, usage_tokens

PRIORITY_HEADER = b"x-vllm-priority"  # vllm.entrypoints.generate.base.serving.PRIORITY_HEADER


@dataclass(slots=True)
class UsageTap:
    """Filled by MeteredClient while vLLM's serving layer streams one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_output_at: float | None = None
    # The output token ids not yet framed (for the event ids of streams the router relays), and a
    # continuation's received ids (`StreamRequest.resume_ids`), replayed first.
    ids: list[int] = field(default_factory=list)
    resume: list[int] | None = None
    cached_tokens: int | None = None  # the engine's num_cached_tokens (prefix cache, transfer)


# Set by `VllmApi.respond` around vLLM's handler; tasks inherit it (contexts are copied).
usage_tap: ContextVar[UsageTap | None] = ContextVar("sluice_usage_tap", default=None)


class MeteredClient:
    """vLLM's EngineClient, with generate() tapped for token counts: the API routes
    need token counts for metrics and rate limits without parsing vLLM's event payloads."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(
        self, prompt: Any, params: Any, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        tap = usage_tap.get()
        resume = tap.resume if tap is not None else None
        own: list[int] | None = None
        if resume:
            prompt, params, own = _resumed(prompt, params, resume)
        gen = self._llm.generate(prompt, params, *args, **kwargs)
        try:
            if tap is None:
                async for out in gen:
                    yield out
                return
            replay = self._replay(resume, own, params) if resume else None
            async for out in gen:
                if own is not None and out.prompt_token_ids is not None:
                    out.prompt_token_ids = own  # the prompt is the request's, counted once
                if replay is not None:
                    first, replay = replay(out), None
                    _tapped(tap, first)
                    yield first
                _tapped(tap, out)
                yield out
        finally:
            # Closing vLLM's generator aborts an unfinished request at once.
            await gen.aclose()

    def _replay(self, resume: list[int], own: Any, params: Any) -> Any:
        """The first output of a continuation: the received tokens, as if just generated,
        in a copy of the engine's first output (its prompt, metrics, cache counts)."""
        text = self._llm.get_tokenizer().decode(
            resume, skip_special_tokens=getattr(params, "skip_special_tokens", True)
        )

        def replayed(out: Any) -> Any:
            first = copy.copy(out)
            first.outputs = [
                dataclasses.replace(
                    out.outputs[0], text=text, token_ids=list(resume), finish_reason=None,
                    stop_reason=None, logprobs=None, cumulative_logprob=None,
                )
            ]  # fmt: skip
            first.finished = False
            return first

        return replayed


def _tapped(tap: UsageTap, out: Any) -> None:
    if tap.first_output_at is None:
        tap.first_output_at = time.perf_counter()
        tap.prompt_tokens += len(out.prompt_token_ids or ())
    if out.num_cached_tokens is not None:
        tap.cached_tokens = out.num_cached_tokens
    for o in out.outputs:
        tap.completion_tokens += len(o.token_ids)
        tap.ids.extend(o.token_ids)


def _resumed(prompt: Any, params: Any, resume: list[int]) -> tuple[Any, Any, list[int]]:
    """A continuation's engine input: the rendered prompt's token ids + the received ones,
    at most `max_tokens` in all; and the prompt's own ids."""
    if not (isinstance(prompt, dict) and prompt.get("type") == "token"):
        raise ValueError("Only a text prompt (token input) can be continued.")
    own = list(prompt["prompt_token_ids"])
    resumed = {k: v for k, v in prompt.items() if k not in ("prompt", "prompt_token_offsets")}
    resumed["prompt_token_ids"] = own + list(resume)
    params = params.clone()
    if params.max_tokens is not None:
        params.max_tokens -= len(resume)
        if params.max_tokens < 1:
            raise ValueError("The continued stream has no tokens left to generate.")
    params.min_tokens = max(0, params.min_tokens - len(resume))
    return resumed, params, own


def _request_classes() -> dict[str, Any]:
    """The request model vLLM validates each kind's body with (vLLM's routes do the same)."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.anthropic.protocol import (
        AnthropicCountTokensRequest,
        AnthropicMessagesRequest,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    return {
        "chat": ChatCompletionRequest,
        "completion": CompletionRequest,
        "responses": ResponsesRequest,
        "messages": AnthropicMessagesRequest,
        "count_tokens": AnthropicCountTokensRequest,
        "tokenize": TypeAdapter(TokenizeRequest),
        "detokenize": DetokenizeRequest,
    }


# ApiKind -> (attribute of the State that init_app_state filled, method, how vLLM's own
# route dumps a whole answer).
_HANDLERS: dict[str, tuple[str, str, dict]] = {
    "chat": ("openai_serving_chat", "create_chat_completion", {}),
    "completion": ("openai_serving_completion", "create_completion", {}),
    "responses": ("openai_serving_responses", "create_responses",
                  {"mode": "json", "by_alias": True}),
    "messages": ("anthropic_serving_messages", "create_messages", {"exclude_none": True}),
    "count_tokens": ("anthropic_serving_messages", "count_tokens", {"exclude_none": True}),
    "tokenize": ("serving_tokenization", "create_tokenize", {}),
    "detokenize": ("serving_tokenization", "create_detokenize", {}),
}  # fmt: skip


class VllmApi:
    """`engine.base.ApiServing` on vLLM's own serving classes (from `init_app_state`)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self._classes = _request_classes()
        chat = getattr(state, "openai_serving_chat", None)
        if chat is not None:  # a plain streamed chat: vLLM's chunks, cheaper (its docstring)
            chat.chat_completion_stream_generator = vllm_chat_stream.route(chat)

    async def models(self) -> dict[str, Any]:
        return (await self.state.openai_serving_models.show_available_models()).model_dump()

    def version(self) -> dict[str, Any]:
        from vllm.version import __version__

        return {"version": __version__}

    def parse(self, body: dict[str, Any], kind: ApiKind) -> Any:
        cls = self._classes[kind]
        if hasattr(cls, "validate_python"):
            return cls.validate_python(body)
        return cls.model_validate(body)

    async def respond(
        self,
        request: Any,
        kind: ApiKind,
        http_request: Any,
        priority: int = 0,
        resume: list[int] | None = None,
    ) -> ApiReply | ApiStream:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        tap = UsageTap(resume=resume or None)
        usage_tap.set(tap)  # a non-streamed request generates in this task
        attr, method, dump = _HANDLERS[kind]
        handler = getattr(self.state, attr, None)
        if handler is None:
            raise ApiRequestError(501, f"This model does not support the {kind} API.")
        try:
            result = await getattr(handler, method)(request, _at_priority(http_request, priority))
        except Exception as e:  # vLLM raises its validation errors; map them as vLLM does
            result = create_error_response(e)
        if isinstance(result, ErrorResponse):
            err = result.error
            raise ApiRequestError(err.code, err.message, err.param)
        if not hasattr(result, "__aiter__"):  # a whole (non-streamed) answer
            body = result.model_dump(**dump)
            return ApiReply(body, 200, *usage_tokens(body))
        events = _framed(result) if kind == "responses" else result
        return ApiStream(_chunks(events, tap), lambda: tap.prompt_tokens)


def _at_priority(http_request: Any, priority: int) -> Any:
    """The request as vLLM's handlers read it, with our priority in the header they prefer
    over the body's `priority` field (`X-Vllm-Priority`, every generating route; the
    Anthropic route's chat request has no field at all): a client's own header is
    dropped, so a caller's priority is its class, never what it asks for."""
    from starlette.requests import Request

    if http_request is None:
        return None
    headers = [(k, v) for k, v in http_request.scope.get("headers", ()) if k != PRIORITY_HEADER]
    headers.append((PRIORITY_HEADER, str(priority).encode()))
    return Request({**http_request.scope, "headers": headers}, http_request.receive)


async def _framed(events: AsyncGenerator[Any, None]) -> AsyncGenerator[str, None]:
    """Responses events (pydantic objects) framed as vLLM's own route frames them."""
    try:
        async for event in events:
            data = event.model_dump_json(indent=None, by_alias=True)
            yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"
    finally:
        await events.aclose()


async def _chunks(sse: AsyncIterator[str], tap: UsageTap) -> AsyncGenerator[Delta, None]:
    """vLLM's framed events as Deltas, token counts from the tap; a finished Delta last."""
    usage_tap.set(tap)  # vLLM's generator runs in this (the stream's producer) task
    seen = 0
    try:
        async for chunk in sse:
            n = tap.completion_tokens - seen
            seen += n
            ids = None
            if tap.ids:  # the tokens since the last chunk (vLLM frames one output at once)
                ids, tap.ids = tap.ids, []
            yield Delta(chunk, n, False, None, tap.prompt_tokens, seen, None, ids)
        yield Delta(
            "", tap.completion_tokens - seen, True, "stop", tap.prompt_tokens,
            tap.completion_tokens, tap.cached_tokens,
        )  # fmt: skip
    finally:
        aclose = getattr(sse, "aclose", None)
        if aclose is not None:
            await aclose()  # aborts an unfinished engine request at once
