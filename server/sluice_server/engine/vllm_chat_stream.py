"""A streamed chat completion's per-token path, for a plain request, in vLLM's own bytes.

vLLM's `OpenAIServingChat.chat_completion_stream_generator` builds three pydantic models
for every token (the chunk, its choice, the delta: each validated, each through vLLM's
extra-field check) and serializes them, about a fifth of our OpenAI route's CPU per token
(py-spy, tiny engine, 64 streams). For a plain request (one choice, no tool or reasoning
parser, no logprobs, echo, token ids or continuous usage stats, no output logging) every
chunk between the first and the last has one shape that differs only in its text.

`plain_stream` is vLLM's loop for that case: the first chunk (the role), the finishing one
and the usage chunk are vLLM's models serialized as vLLM does; a chunk in between is
vLLM's serialization of one such chunk, made once per request with a placeholder, with the
text put in its place. Every other request goes to vLLM's generator unchanged (`route`).
`tests/server/test_vllm_chat_stream.py` runs both on the real engine for the same requests
and compares them chunk by chunk.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any

log = logging.getLogger(__name__)
CHUNK = "chat.completion.chunk"
_MARK = "sluice-text-placeholder-5f0c"
_text = partial(json.dumps, ensure_ascii=False)  # as pydantic-core writes a str


def is_plain(serving: Any, request: Any) -> bool:
    """A request whose stream `plain_stream` writes exactly as vLLM would."""
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage

    _, continuous = should_include_usage(request.stream_options, serving.enable_force_include_usage)
    return not (
        serving.parser_cls is not None
        or serving._include_reasoning_tokens_details
        or (serving.enable_log_outputs and serving.request_logger)
        or (request.n or 1) != 1
        or request.logprobs
        or request.echo
        or request.return_token_ids
        or request.return_prompt_text
        or request.tools
        or continuous
    )


def route(serving: Any) -> Callable[..., AsyncGenerator[str, None]]:
    """`serving.chat_completion_stream_generator` with plain requests taken by
    `plain_stream` (installed on the instance by `VllmApi`)."""
    vllm_stream = serving.chat_completion_stream_generator

    def stream(
        request: Any,
        result_generator: Any,
        request_id: str,
        model_name: str,
        conversation: Any,
        tokenizer: Any,
        request_metadata: Any,
        chat_template_kwargs: Any = None,
        mm_token_counts: dict[str, int] | None = None,
    ) -> AsyncGenerator[str, None]:
        if is_plain(serving, request):
            return plain_stream(
                serving,
                request,
                result_generator,
                request_id,
                model_name,
                request_metadata,
                mm_token_counts,
            )
        return vllm_stream(
            request,
            result_generator,
            request_id,
            model_name,
            conversation,
            tokenizer,
            request_metadata,
            chat_template_kwargs=chat_template_kwargs,
            mm_token_counts=mm_token_counts,
        )

    return stream


def framed(chunk: Any, **dump: Any) -> str:
    """One chunk on the wire, as vLLM's generator writes it."""
    return f"data: {chunk.model_dump_json(exclude_unset=True, **dump)}\n\n"


def text_chunk(chunk: Callable[..., Any]) -> Callable[[str], str]:
    """text -> the framed chunk vLLM writes for a token's text between the first chunk and
    the last, from vLLM's own serialization of one such chunk (`chunk(**fields)` makes a
    ChatCompletionStreamResponse of the request) with the text in place of a placeholder."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
    )

    choice = ChatCompletionResponseStreamChoice(
        index=0,
        delta=DeltaMessage(content=_MARK),
        logprobs=None,
        finish_reason=None,
        token_ids=None,
    )
    head, tail = framed(chunk(choices=[choice])).split(_text(_MARK))
    return lambda text: f"{head}{_text(text)}{tail}"


async def plain_stream(
    serving: Any,
    request: Any,
    result_generator: AsyncIterator[Any],
    request_id: str,
    model_name: str,
    request_metadata: Any,
    mm_token_counts: dict[str, int] | None = None,
) -> AsyncGenerator[str, None]:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.generate.base.serving import build_spec_decoding_metrics
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice as Choice,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionStreamResponse as Chunk,
    )
    from vllm.entrypoints.openai.chat_completion.serving import _make_prompt_tokens_details
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage
    from vllm.exceptions import GenerationError

    created = int(time.time())

    def chunk(**fields: Any) -> Any:
        return Chunk(id=request_id, object=CHUNK, created=created, model=model_name, **fields)

    between = text_chunk(chunk)
    include_usage, _ = should_include_usage(
        request.stream_options, serving.enable_force_include_usage
    )
    prompt_tokens = tokens = 0
    cached = cache_creation = None
    first, finished = True, False
    last_res = None
    try:
        async for res in result_generator:
            last_res = res
            if res.prompt_token_ids is not None:
                prompt_tokens = len(res.prompt_token_ids) + len(res.encoder_prompt_token_ids or ())
            if first:
                first = False
                cached, cache_creation = res.num_cached_tokens, res.num_cache_creation_tokens
                role = serving.get_chat_request_role(request)
                yield framed(
                    chunk(
                        choices=[
                            Choice(
                                index=0,
                                delta=DeltaMessage(role=role, content=""),
                                logprobs=None,
                                finish_reason=None,
                            )
                        ],
                        prompt_token_ids=None,
                        prompt_text=None,
                    )
                )
            for output in res.outputs:
                if finished:
                    continue
                serving._raise_if_error(output.finish_reason, request_id)
                text = output.text
                if not text and not output.token_ids and not tokens:
                    continue
                tokens += len(output.token_ids)
                if output.finish_reason is None:
                    yield between(text)
                    continue
                finished = True
                last = chunk(
                    choices=[
                        Choice(
                            index=0,
                            delta=DeltaMessage(content=text),
                            logprobs=None,
                            finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason,
                            token_ids=None,
                        )
                    ]
                )
                if not include_usage and serving.system_fingerprint is not None:
                    last.system_fingerprint = serving.system_fingerprint
                yield framed(last)
        if include_usage:
            usage = UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=tokens,
                total_tokens=prompt_tokens + tokens,
                completion_tokens_details=None,
            )
            usage.prompt_tokens_details = _make_prompt_tokens_details(
                serving.enable_prompt_tokens_details, cached, cache_creation, mm_token_counts
            )
            metrics = None
            if serving.enable_per_request_metrics:
                from vllm.entrypoints.generate.base.serving import (
                    build_per_request_timing_metrics,
                )

                metrics = build_per_request_timing_metrics(
                    last_res.metrics if last_res is not None else None, tokens
                )
            spec = build_spec_decoding_metrics(last_res)
            if spec is not None:
                from vllm.entrypoints.generate.base.protocol import PerRequestMetrics

                metrics = metrics or PerRequestMetrics()
                metrics.speculative_decoding = spec
            yield framed(
                chunk(
                    choices=[],
                    usage=usage,
                    system_fingerprint=serving.system_fingerprint,
                    metrics=metrics,
                ),
                exclude_none=True,
            )
        request_metadata.final_usage_info = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=tokens,
            total_tokens=prompt_tokens + tokens,
            completion_tokens_details=None,
        )
    except GenerationError as e:
        yield f"data: {serving._convert_generation_error_to_streaming_response(e)}\n\n"
    except Exception as e:
        log.exception("Error in chat completion stream generator.")
        yield f"data: {serving.create_streaming_error_response(e)}\n\n"
    yield "data: [DONE]\n\n"
