"""The Engine protocol over vLLM's `AsyncLLM`, and the engine's lifecycle: opening it (its
own engine core, or a client of the core the pod's supervisor launched), its serving layer
(`vllm_api.VllmApi`) built on it, LoRA adapters loaded into it, and shutting it down.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..kvcache import blockhash, describe
from ..startup import phases
from .base import Adapter, AdapterLoadError, Delta, StreamRequest
from .vllm_api import MeteredClient, VllmApi
from .vllm_argv import vllm_cli_args

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    pass


class VllmEngine:
    """Adapter: `Engine` protocol methods; `api` is vLLM's own serving layer."""

    def __init__(self, llm: Any, args: Any, api_state: Any, model_name: str) -> None:
        self.llm = llm
        self.args = args
        self.api = VllmApi(api_state)
        self.model_name = model_name
        self.max_model_len: int = llm.model_config.max_model_len
        self._tokenizer = llm.get_tokenizer()
        self._tokenizer_described: tuple[dict[str, Any], Path | None] | None = None

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
        resume = request.resume_ids or []
        max_tokens = min(opts.max_tokens, self.max_model_len - len(ids)) - len(resume)
        if max_tokens < 1:
            raise ValueError("The continued stream has no tokens left to generate.")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=opts.temperature,
            top_p=opts.top_p,
            seed=opts.seed,
            stop=opts.stop or None,
            ignore_eos=opts.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        if request.kv_transfer_params is not None:  # as vLLM's OpenAI request models pass them
            params.extra_args = {"kv_transfer_params": request.kv_transfer_params}
        completion_tokens = len(resume)
        n_prompt = len(ids)
        # AsyncLLM.generate aborts the engine request when it is cancelled or closed; close
        # it explicitly so an abandoned outer generator never waits for GC to abort.
        prompt: dict[str, Any] = {"prompt_token_ids": ids + resume if resume else ids}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        gen = self.llm.generate(
            prompt,
            params,
            request.request_id,
            lora_request=_lora_request(request.adapter),
            trace_headers=request.trace_headers,
            priority=request.priority,
        )
        try:
            if resume:  # a continuation: the received tokens first (StreamRequest.resume_ids)
                text = self._tokenizer.decode(resume, skip_special_tokens=True)
                yield Delta(text, len(resume), False, None, n_prompt, len(resume), None, resume)
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
                    out.num_cached_tokens,
                    o.token_ids,
                    out.kv_transfer_params if out.finished else None,
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

    def prefix_cache(self) -> tuple[dict[str, Any], Path | None]:
        """How a router hashes this engine's prompts (`kvcache/describe.py`) and the folder
        the tokenizer files are read from: vLLM's cache config, the NONE_HASH seed of this
        process's environment (the engine core's: it inherits it), the adapters vLLM's
        serving layer routes to, and the tokenizer with the chat template and content
        format vLLM's chat rendering resolves for a request without tools."""
        cache = self.llm.vllm_config.cache_config
        algo = cache.prefix_caching_hash_algo
        try:
            seed: str | None = blockhash.none_hash_seed(algo, os.environ)
        except ValueError:
            seed = None
        loras = self.api.state.openai_serving_models.lora_requests
        desc: dict[str, Any] = {
            "enabled": bool(cache.enable_prefix_caching),
            "block_size": cache.block_size,
            "hash_algo": algo,
            "none_hash_seed": seed,
            "loras": {name: r.lora_path for name, r in loras.items()},
        }
        if self._tokenizer_described is None:  # the files and template never change
            self._tokenizer_described = self._describe_tokenizer()
        desc["tokenizer"], folder = self._tokenizer_described
        return desc, folder

    def _describe_tokenizer(self) -> tuple[dict[str, Any], Path | None]:
        from vllm.renderers.hf import resolve_chat_template, resolve_chat_template_content_format

        folder = Path(self.llm.model_config.tokenizer)
        try:
            files = describe.tokenizer_files(folder)
        except (OSError, ValueError) as e:
            return {"kind": "unavailable", "reason": str(e)}, None
        tok = self._tokenizer
        chat = getattr(self.api.state, "openai_serving_chat", None)
        given = chat.chat_template if chat is not None else None
        mc = self.llm.model_config
        template = resolve_chat_template(tok, given, None, model_config=mc)
        fmt = chat.chat_template_content_format if chat is not None else "auto"
        cls = next(c for c in type(tok).__mro__ if c.__module__.startswith("transformers"))
        harmony = getattr(mc.hf_config, "model_type", None) == "gpt_oss"
        return {
            "kind": "hf",
            "class": cls.__name__,
            # How vLLM renders a chat: gpt-oss models through Harmony, not the template;
            # server-wide template arguments change every rendering.
            "chat_rendering": "harmony" if harmony else "template",
            "default_chat_template_kwargs": getattr(chat, "default_chat_template_kwargs", {}) or {},
            "chat_template": template,
            "content_format": resolve_chat_template_content_format(
                template, None, fmt, tok, model_config=mc
            ),
            "sha256": describe.files_digest({n: (folder / n).read_bytes() for n in files}),
            "files": files,
        }, folder

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
    if settings.kv_transfer_config is not None:
        check_kv_transfer_config(settings.kv_transfer_config)
    cpu = current_platform.is_cpu()
    argv = vllm_cli_args(settings, model_path, cpu_defaults=cpu and not _has_kv_size(settings))
    parser = make_arg_parser(FlexibleArgumentParser(prog="sluice-server --"))
    return parser.parse_args(argv)


def check_kv_transfer_config(text: str) -> None:
    """ValueError with vLLM's own reason when its `KVTransferConfig` refuses the JSON
    (`--kv-transfer-config`), before the engine starts."""
    from vllm.config import KVTransferConfig

    try:
        KVTransferConfig(**json.loads(text))
    except Exception as e:  # pydantic's ValidationError, or vLLM's own ValueError
        errors = getattr(e, "errors", None)
        why = (
            "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors())
            if callable(errors)
            else str(e)
        )
        raise ValueError(
            f"--kv-transfer-config is not a valid vLLM KVTransferConfig: {why}"
        ) from None


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
    phases.mark("engine_imported")
    if client_config is None:
        client = _own_engine(args)
    else:
        config = dict(client_config)
        # vLLM's least-loaded accept array: its own uvicorn subclass reads it; ours does not.
        config.pop("api_server_loads", None)
        client = build_async_engine_client(args, client_config=config)
    async with client as llm:
        phases.mark("engine_ready")
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
