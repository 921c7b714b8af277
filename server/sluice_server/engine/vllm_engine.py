"""The Engine protocol over vLLM's `AsyncLLM`, plus vLLM's own serving layer for every
client API.

The API routes reach vLLM's serving classes (chat templates, parameter mapping, tools,
usage, event shapes), built by vLLM's own `init_app_state` on a private `State`, through
`VllmEngine.api`: `OpenAIServingChat`/`Completion`/`Responses`/`Models`,
`AnthropicServingMessages` and `ServingTokenization`. This module owns creating and
shutting them down, and one table (`_HANDLERS`) says which class serves which `ApiKind`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import vllm_chat_stream
from .base import (
    Adapter,
    AdapterLoadError,
    ApiKind,
    ApiReply,
    ApiRequestError,
    ApiStream,
    Delta,
    StreamRequest,
    usage_tokens,
)

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger(__name__)
PRIORITY_HEADER = b"x-vllm-priority"  # vllm.entrypoints.generate.base.serving.PRIORITY_HEADER


class PromptTooLong(ValueError):
    pass


@dataclass(slots=True)
class UsageTap:
    """Filled by MeteredClient while vLLM's serving layer streams one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_output_at: float | None = None


# Set by `VllmApi.respond` around vLLM's handler; tasks inherit it (contexts are copied).
usage_tap: ContextVar[UsageTap | None] = ContextVar("sluice_usage_tap", default=None)


class MeteredClient:
    """vLLM's EngineClient, with generate() tapped for token counts: the API routes
    need token counts for metrics and rate limits without parsing vLLM's event payloads."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        tap = usage_tap.get()
        gen = self._llm.generate(*args, **kwargs)
        try:
            if tap is None:
                async for out in gen:
                    yield out
                return
            async for out in gen:
                if tap.first_output_at is None:
                    tap.first_output_at = time.perf_counter()
                    tap.prompt_tokens += len(out.prompt_token_ids or ())
                for o in out.outputs:
                    tap.completion_tokens += len(o.token_ids)
                yield out
        finally:
            # Closing vLLM's generator aborts an unfinished request at once.
            await gen.aclose()


def vllm_cli_args(settings: Settings, model_path: str, cpu_defaults: bool) -> list[str]:
    """Our flags rendered as vLLM serve arguments; `engine_args` come last and win."""
    args = ["--model", model_path, "--served-model-name", settings.model_label]
    if settings.revision:
        args += ["--revision", settings.revision]
    args += ["--tensor-parallel-size", str(settings.tensor_parallel_size)]
    args += ["--pipeline-parallel-size", str(settings.pipeline_parallel_size)]
    if settings.nnodes > 1:
        # vLLM's multiprocessing backend across nodes: every node runs the same arguments
        # with its own rank; the workers (rank > 0) are headless.
        args += ["--nnodes", str(settings.nnodes), "--node-rank", str(settings.node_rank)]
        args += ["--master-addr", str(settings.master_addr)]
        args += ["--master-port", str(settings.master_port)]
        if settings.headless:
            args += ["--headless"]
    args += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    args += ["--dtype", settings.dtype]
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "quantization"):
        value = getattr(settings, name)
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    if settings.swap_space is not None:
        # vLLM 0.32 has no --swap-space any more; its successor is CPU KV offloading (GiB).
        args += ["--kv-offloading-size", str(settings.swap_space)]
    if settings.lora_enabled:
        # Adapters are added and removed at run time (core/adapters.py), never listed here.
        args += ["--enable-lora"]
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(settings, name)
            if value is not None:
                args += ["--" + name.replace("_", "-"), str(value)]
    if settings.otlp_traces_endpoint:
        # The engine's own spans (queue, prefill, decode) join the request's trace.
        args += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    if settings.priority_classes:
        # Fixed when the engine starts; each request then carries its caller's class.
        args += ["--scheduling-policy", "priority"]
    if cpu_defaults:
        # The CPU build misreads NUMA memory without an explicit KV size, and
        # torch.compile adds ~30 s to start-up for a model this small.
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20)]
    return args + list(settings.engine_args)


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

    async def respond(self, request: Any, kind: ApiKind, http_request: Any,
                      priority: int = 0) -> ApiReply | ApiStream:  # fmt: skip
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        tap = UsageTap()
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
            yield Delta(chunk, n, False, None, tap.prompt_tokens, seen)
        yield Delta("", tap.completion_tokens - seen, True, "stop", tap.prompt_tokens,
                    tap.completion_tokens)  # fmt: skip
    finally:
        aclose = getattr(sse, "aclose", None)
        if aclose is not None:
            await aclose()  # aborts an unfinished engine request at once


class VllmEngine:
    """Adapter: `Engine` protocol methods; `api` is vLLM's own serving layer."""

    def __init__(self, llm: Any, args: Any, api_state: Any, model_name: str) -> None:
        self.llm = llm
        self.args = args
        self.api = VllmApi(api_state)
        self.model_name = model_name
        self.max_model_len: int = llm.model_config.max_model_len
        self._tokenizer = llm.get_tokenizer()

    # -- Engine protocol -------------------------------------------------------------
    def prepare(self, request: StreamRequest) -> int:
        """Render (chat template) and tokenize before the 200, so a prompt longer than
        max_model_len is a 400, not an error event. Returns the prompt token count."""
        tok = self._tokenizer
        if request.messages is not None:
            text = tok.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=False
            )
            # The template already holds the special tokens it wants.
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(request.prompt or "")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens."
            )
        request.prompt_token_ids = ids
        return len(ids)

    async def generate(self, request: StreamRequest) -> AsyncGenerator[Delta, None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if request.prompt_token_ids is None:
            self.prepare(request)
        ids = request.prompt_token_ids
        assert ids is not None  # prepare() sets them
        opts = request.options
        max_tokens = min(opts.max_tokens, self.max_model_len - len(ids))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=opts.temperature,
            top_p=opts.top_p,
            seed=opts.seed,
            stop=opts.stop or None,
            ignore_eos=opts.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        completion_tokens = 0
        n_prompt = len(ids)
        # AsyncLLM.generate aborts the engine request when it is cancelled or closed; close
        # it explicitly so an abandoned outer generator never waits for GC to abort.
        gen = self.llm.generate({"prompt_token_ids": ids}, params, request.request_id,
                                lora_request=_lora_request(request.adapter),
                                trace_headers=request.trace_headers,
                                priority=request.priority)  # fmt: skip
        try:
            async for out in gen:
                o = out.outputs[0]
                n = len(o.token_ids)
                completion_tokens += n
                yield Delta(
                    o.text,
                    n,
                    out.finished,
                    o.finish_reason if out.finished else None,
                    n_prompt,
                    completion_tokens,
                )
        finally:
            await gen.aclose()

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def load_adapter(self, adapter: Adapter) -> None:
        """Into the engine core (`add_lora`: read from disk, checked against the LoRA limits,
        kept in its CPU cache), then into vLLM's serving layer's table of served adapters,
        through which its OpenAI and Anthropic handlers route by `model`."""
        request = _lora_request(adapter)
        try:
            await self.llm.add_lora(request)
        except Exception as e:
            raise AdapterLoadError(_lora_failure(e)) from None
        self.api.state.openai_serving_models.lora_requests[adapter.name] = request

    async def unload_adapter(self, adapter: Adapter) -> None:
        self.api.state.openai_serving_models.lora_requests.pop(adapter.name, None)
        await self.llm.remove_lora(adapter.lora_id)

    async def check_health(self) -> None:
        await self.llm.check_health()

    def num_unfinished_requests(self) -> int:
        return self.llm.get_num_unfinished_requests()

    async def shutdown(self) -> None:
        self.llm.shutdown()


def _lora_request(adapter: Adapter | None) -> Any:
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, adapter.path)


_WORKER_FAILED = re.compile(r"Worker failed with error '(.*)', please check", re.S)


def _lora_failure(e: Exception) -> str:
    """The engine core's reason ("LoRA rank 32 is greater than max_lora_rank 16."), without
    the RPC wrapping around it."""
    text = str(e)
    m = _WORKER_FAILED.search(text)
    return (m.group(1) if m else text or type(e).__name__)[:500]


def parse_vllm_args(settings: Settings, model_path: str) -> Any:
    """vLLM's own serve arguments (its `make_arg_parser`) from our settings."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if settings.otlp_traces_endpoint:
        # Ours is OTLP/HTTP; vLLM's exporter defaults to gRPC.
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    cpu = current_platform.is_cpu()
    argv = vllm_cli_args(settings, model_path, cpu_defaults=cpu and not _has_kv_size(settings))
    parser = make_arg_parser(FlexibleArgumentParser(prog="sluice-server --"))
    return parser.parse_args(argv)


@asynccontextmanager
async def _own_engine(args: Any) -> AsyncIterator[Any]:
    """An AsyncLLM that starts (and shuts down) its own engine core: one process per pod."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    llm = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    try:
        yield llm
    finally:
        llm.shutdown()


@asynccontextmanager
async def open_vllm_engine(
    settings: Settings, model_path: str, client_config: dict | None = None
) -> AsyncIterator[VllmEngine]:
    """The engine for one process. With `client_config` (a worker of a pod with several,
    `engine/vllm_pod.py`), an AsyncLLM client of the engine core the supervisor launched,
    connected by vLLM's own front-end code (`build_async_engine_client`, what each of
    vLLM's API server processes runs); without, an AsyncLLM with its own engine core."""
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    args = parse_vllm_args(settings, model_path)
    if client_config is None:
        client = _own_engine(args)
    else:
        config = dict(client_config)
        # vLLM's least-loaded accept array: its own uvicorn subclass reads it; ours does not.
        config.pop("api_server_loads", None)
        client = build_async_engine_client(args, client_config=config)
    async with client as llm:
        state = State()
        tasks = await llm.get_supported_tasks()
        await init_app_state(MeteredClient(llm), state, args, tasks)
        with _envs_cached():
            yield VllmEngine(llm, args, state, settings.model_label)


_engines_open = 0  # in this process: the envs cache ends with the last one


@contextmanager
def _envs_cached() -> Iterator[None]:
    """vLLM's settings read from the environment, cached while an engine serves, as vLLM's
    engine core caches them once it is up: uncached, every read is an `os.environ` lookup,
    and the front end's per-token path reads some (its iteration stats), 4-7% of our
    server's CPU per token. Nothing sets a `VLLM_*` variable once the engine started; the
    cache ends with the last engine, so one opened later in the process reads afresh."""
    global _engines_open
    from vllm import envs

    envs.enable_envs_cache()  # a no-op when already on
    _engines_open += 1
    try:
        yield
    finally:
        _engines_open -= 1
        if not _engines_open:
            envs.disable_envs_cache()


def _has_kv_size(settings: Settings) -> bool:
    return any(a.startswith("--kv-cache-memory") for a in settings.engine_args) or bool(
        os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    )


def run_headless_worker(settings: Settings, model_path: str) -> int:
    """vLLM's own headless entry point (`vllm serve --headless`) with the leader's engine
    arguments and this node's rank: the multiprocessing executor's workers for its GPUs,
    which join the leader's engine through the rendezvous at --master-addr."""
    from vllm.entrypoints.cli.serve import run_headless

    args = parse_vllm_args(settings, model_path)
    args.api_server_count = 0  # as `vllm serve --headless` sets it: no API servers here
    run_headless(args)
    return 0
