"""Engine selection: `open_engine(settings)` yields the Engine the app serves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..startup import phases
from .base import Delta, Engine, SamplingOptions, StreamRequest

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = [
    "Delta",
    "Engine",
    "SamplingOptions",
    "StreamRequest",
    "open_engine",
    "resolve_model",
    "run_engine_worker",
]


def resolve_model(model: str) -> str:
    """`tiny` means the tiny random model made locally (CPU tests, demo). A local folder
    marks the `weights_located` phase; a hub name is vLLM's to download, later."""
    if model == "tiny":
        from .tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model())
    _mark_if_folder(model)
    return model


def _mark_if_folder(model: str) -> None:
    """`weights_located` when the model is a local folder (the model cache's volume, the
    weights cache's read-only mount)."""
    if Path(model).is_dir():
        phases.mark("weights_located")


@asynccontextmanager
async def open_engine(
    settings: Settings, client_config: dict | None = None
) -> AsyncIterator[Engine]:
    """Start the engine named by settings and shut it down on exit (imports are lazy:
    the simulator must not pay for importing vLLM). `client_config`: a front-end worker's
    connection to an engine core the supervisor started (vLLM's multi-API-server
    handshake); the simulator ignores it (each worker runs its own)."""
    if settings.engine == "simulator":
        _mark_if_folder(settings.model)  # found, never read: the simulator has no weights
        from .simcache import KvEventsConfig
        from .simulator import SimulatorEngine

        events = settings.sim_kv_events_config
        transfer = settings.kv_transfer_config
        sim = SimulatorEngine(
            model_name=settings.model_label,
            ttft_ms=settings.sim_ttft_ms,
            itl_ms=settings.sim_itl_ms,
            ttft_per_stream_ms=settings.sim_ttft_per_stream_ms,
            jitter=settings.sim_jitter,
            prefix_cache_blocks=settings.sim_prefix_cache_blocks,
            block_size=settings.sim_block_size,
            prefill_us_per_token=settings.sim_prefill_us_per_token,
            hash_algo=settings.sim_prefix_caching_hash_algo,
            kv_events=KvEventsConfig.from_json(events) if events is not None else None,
            kv_transfer=json.loads(transfer) if transfer is not None else None,
            kv_transfer_us_per_block=settings.sim_kv_transfer_us_per_block,
        )
        phases.mark("engine_ready")
        try:
            yield sim
        finally:
            await sim.shutdown()
        return

    from .vllm_engine import open_vllm_engine

    async with open_vllm_engine(settings, resolve_model(settings.model), client_config) as engine:
        yield engine


def run_engine_worker(settings: Settings) -> int:
    """A worker node (`--node-rank` above 0): vLLM's headless workers for the leader's
    engine until they exit or a signal stops them; no HTTP API."""
    from .vllm_engine import run_headless_worker

    return run_headless_worker(settings, resolve_model(settings.model))
