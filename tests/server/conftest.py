"""Session fixtures for the server tests: ONE real vLLM engine (CPU build, tiny model) for
the whole session, and a factory of uvicorn servers on loopback around it.

Names are a contract with the other server test files: `tiny_model_path`, `engine`,
`engine_apart`, `make_server`, `server_url`. Everything runs in pytest-asyncio's session
loop. Plain helpers (settings, serving an app in the test loop) live in app_helpers.py, so
tests import them from there and never from this file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio
from app_helpers import another_engine, engine_settings, serving
from testkit.net import free_port

# Engine sockets on loopback; scratch files (ZMQ sockets, compile caches) in one folder.
_SCRATCH = Path(tempfile.mkdtemp(prefix="sluice-test-"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(_SCRATCH / "vllm-cache"))
os.environ["TMPDIR"] = str(_SCRATCH)
tempfile.tempdir = None  # re-read TMPDIR


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from sluice_server.engine.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tiny_model_path):
    """The real vLLM engine (AsyncLLM), shared by every app in the session."""
    from sluice_server.engine import open_engine

    async with open_engine(engine_settings(tiny_model_path)) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine_apart(engine):
    """For the checks whose verdict depends on when bytes arrive (a stream arrives
    incrementally, a proxy does not buffer): the session engine's processes on their own
    core, this process (the servers and the test's clients) and what it starts meanwhile
    (nginx, a browser) on the others, for the whole module (`testkit.cpus`: unpinned, the
    engine core starves the server on 2 cores and a whole stream leaves in one write).
    Yields the layout; {} where there is nothing to separate (one core)."""
    from testkit.cpus import engine_apart_from_this_process

    with engine_apart_from_this_process() as layout:
        yield layout


# LoRA limits of `lora_engine` (the tests' adapters have rank 8; one of rank 16 is refused).
# Three GPU slots for the two adapters the tests load: vLLM 0.32's CPU LoRA ops (the torch
# bgmv in vllm/lora/ops/torch_ops/lora_ops.py) index the stacked adapter weights with the
# token's slot, and a base token's slot is -1, which Python reads as the last slot: with
# every slot filled, base tokens in a batch with adapter tokens get the last adapter's
# weights (measured: the base's answer then equals the second adapter's). A slot left empty
# keeps them base. The GPU kernels skip -1; this is the CPU build's bug, not ours.
LORA_LIMITS = {"max_loras": 3, "max_lora_rank": 8, "max_cpu_loras": 4}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_engine(tiny_model_path):
    """A second real engine, started with LoRA on (vLLM's LoRA limits are fixed at engine
    start), for the adapter tests' module that asks for it (`another_engine`: the session
    engine's metrics come back when it closes)."""
    async with another_engine(engine_settings(tiny_model_path, **LORA_LIMITS)) as eng:
        yield eng


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def make_server(engine, tiny_model_path):
    """`await make_server(**settings_overrides) -> base_url` (http://127.0.0.1:PORT);
    `wrap_engine`: a function of the shared engine giving the app's (a test double around it).

    Each call builds an app with its own settings (limits, keys, protocols, metrics)
    around the shared engine and serves it, with the server's own uvicorn configuration
    (`drain.uvicorn_config`), on a free loopback port until session end.
    Also reachable: `make_server.apps[base_url]` -> the FastAPI app (for its services).
    """
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    apps: dict[str, object] = {}

    async with contextlib.AsyncExitStack() as servers:

        async def factory(wrap_engine=None, **overrides) -> str:
            port = free_port()
            settings = engine_settings(tiny_model_path, port=port, **overrides)
            app = build_app(settings, engine if wrap_engine is None else wrap_engine(engine))
            await servers.enter_async_context(serving(uvicorn_config(settings, app)))
            url = f"http://127.0.0.1:{port}"
            apps[url] = app
            return url

        factory.apps = apps
        yield factory


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def server_url(make_server) -> str:
    """A server with default settings (auth off, no rate limits, sse + websocket)."""
    return await make_server()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh real redis-server on a free loopback port (testkit/redis_server.py); skipped
    with one line when the binary is missing."""
    from testkit.redis_server import MISSING, RedisServer, available

    if not available():
        pytest.skip(MISSING)
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
