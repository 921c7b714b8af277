"""Plain helpers shared by the server tests: small clients (httpx / websockets, no magic),
the engine settings every app in the session uses, and serving an app in the test loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path

import httpx
from testkit.net import free_port
from testkit.wait import eventually_async

ENGINE_KV_BYTES = 256 * 2**20


async def sse_events(client: httpx.AsyncClient, method: str, path: str, **kw) -> list[dict]:
    """All events of an SSE response as dicts {id, event, data} (data raw string)."""
    events, cur = [], {}
    async with client.stream(method, path, **kw) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line == "":
                if cur:
                    events.append(cur)
                cur = {}
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                cur[field] = cur.get(field, "") + value if field == "data" else value
    return events


def token_payloads(events: list[dict]) -> list[dict]:
    return [json.loads(e["data"]) for e in events if e.get("data") not in (None, "[DONE]")]


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    return err


def ws_url(base_url: str, path: str = "/ws/stream") -> str:
    return base_url.replace("http://", "ws://") + path


# Request ids of `engine_flushed`'s probes: spies on the engine's outputs leave them out.
PROBE = "flush-probe-"
_probes = itertools.count()


async def engine_flushed(engine) -> None:
    """Return once every output the engine core made so far has reached the front end's
    output processor (where the tests' spies count them). The core takes requests and
    aborts in the order they were sent and answers in order, so a 1-token probe sent now
    comes back after all of them: no sleep guessing how long outputs take on their way."""
    from sluice_server.engine.base import SamplingOptions, StreamRequest

    probe = StreamRequest(request_id=f"{PROBE}{next(_probes)}", prompt="x",
                          options=SamplingOptions(max_tokens=1))  # fmt: skip
    answer = [d async for d in engine.generate(probe)]
    assert answer and answer[-1].finished, answer


def engine_settings(tiny_model_path: Path, **overrides):
    from sluice_server.settings import Settings

    base = dict(
        model=str(tiny_model_path),
        served_model_name="tiny",
        host="127.0.0.1",
        log_level="warning",
        max_model_len=512,
        max_num_seqs=64,
        engine_args=["--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE_KV_BYTES)],
    )
    return Settings(**{**base, **overrides})


def _vllm_collectors() -> list:
    from prometheus_client import REGISTRY

    return [c for c in list(REGISTRY._collector_to_names)
            if getattr(c, "_name", "").startswith("vllm:")]  # fmt: skip


@contextlib.asynccontextmanager
async def another_engine(settings):
    """A second real engine beside the session's (settings fixed at engine start: LoRA
    limits, the scheduling policy). vLLM's Prometheus stat logger, created with each engine,
    unregisters every `vllm:*` collector in the process-wide registry and registers its
    own; so while this one is open the registry shows its numbers, and when it closes the
    session engine's collectors (still counting) go back, and tests that read them
    (backpressure, abort, the dashboard) see them move again."""
    from prometheus_client import REGISTRY
    from sluice_server.engine import open_engine
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    saved = _vllm_collectors()
    try:
        async with open_engine(settings) as engine:
            yield engine
    finally:
        unregister_vllm_metrics()  # what the next engine's stat logger would do
        for collector in saved:
            REGISTRY.register(collector)


class _TestServer:
    """uvicorn.Server without signal handlers (the test process keeps its own)."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return Server(config)


@contextlib.asynccontextmanager
async def serving(config, sockets=None):
    """Serve `config` in this event loop (bounded start-up wait: 10 s) until the block ends."""
    server = _TestServer.make(config)
    task = asyncio.create_task(server.serve(sockets=sockets))

    def started() -> bool:
        if task.done():  # not retried: the server's own error, at once
            task.result()
            raise RuntimeError("test server stopped before it started")
        return server.started

    try:
        await eventually_async(
            started, timeout=10, interval=0.02, message="the test server to start"
        )
        yield server
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)


@contextlib.asynccontextmanager
async def serve_simulator(engine, **overrides):
    """An app over a simulator `engine` with the server's own uvicorn configuration on a free
    loopback port; yields its URL."""
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config
    from sluice_server.settings import Settings

    port = free_port()
    overrides = {"log_level": "warning", **overrides}
    settings = Settings(model="sim", engine="simulator", host="127.0.0.1", port=port, **overrides)
    async with serving(uvicorn_config(settings, build_app(settings, engine))):
        yield f"http://127.0.0.1:{port}"
