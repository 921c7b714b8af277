"""The app over the simulator engine (no vLLM, seconds): the built-in OpenAI formatter with
the official SDK, coalescing under a slow reader, engine failure -> 503 + /ready false, the
start-up heap frozen once the engine is open, and no reference cycle left by a stream."""

from __future__ import annotations

import asyncio
import gc
import json

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import serve_simulator as serve
from app_helpers import ws_url
from sluice_server.app import build_app
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=1, ttft_per_stream_ms=0, jitter=0)
    yield engine
    await engine.shutdown()


async def test_builtin_openai_with_sdk(sim):
    from openai import AsyncOpenAI

    async with serve(sim) as url:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x")
        assert [m.id for m in (await client.models.list()).data] == ["sim"]
        chat = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert len(text.split()) == 8 and usage.completion_tokens == 8
        comp = await client.completions.create(model="sim", prompt="a", max_tokens=3)
        assert comp.usage.completion_tokens == 3
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
            assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


async def test_slow_reader_gets_every_token_exactly_once(sim):
    """However events are coalesced for a reader that lags, the concatenated tokens are the
    whole text once, in order (coalescing itself is shown deterministically in
    test_stream_core.py; socket buffers make its app-level count timing-dependent)."""
    async with serve(sim) as url, httpx.AsyncClient(base_url=url) as c:
        body = {"prompt": "p", "max_tokens": 200, "seed": 3}
        async with c.stream("POST", "/v1/stream", json=body) as r:
            await asyncio.sleep(0.3)  # tokens pile up while we don't read
            raw = (await r.aread()).decode()
        data = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
        tokens, final = data[:-1], data[-1]
        assert final["usage"]["completion_tokens"] == 200
        assert [t["index"] for t in tokens] == list(range(len(tokens)))
        assert len("".join(t["token"] for t in tokens).split()) == 200
        assert len(tokens) <= 200


class DeadEngine:
    model_name = "sim"
    max_model_len = 100

    async def check_health(self):
        raise RuntimeError("EngineCore died")

    def num_unfinished_requests(self):
        return 0


async def test_engine_failure_is_503_and_not_ready():
    async with serve(DeadEngine()) as url, httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/ready")).status_code == 503
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/stream", json={"prompt": "x"})
        assert r.status_code == 503 and "EngineCore died" in r.json()["error"]["message"]
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 503


async def test_heartbeat_during_a_long_prefill():
    """The simulator's 0.6 s time to first token stands in for a long prefill: comments
    keep the connection busy until the first token, none once tokens flow."""
    engine = SimulatorEngine(model_name="sim", ttft_ms=600, itl_ms=2, ttft_per_stream_ms=0,
                             jitter=0)  # fmt: skip
    try:
        async with serve(engine, heartbeat_seconds=0.1) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                async with c.stream(
                    "POST", "/v1/stream", json={"prompt": "h", "max_tokens": 100}
                ) as r:
                    lines = [line async for line in r.aiter_lines() if line]
    finally:
        await engine.shutdown()
    first_token = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert 4 <= len([x for x in lines[:first_token] if x.startswith(":")]) <= 7, lines[:10]
    assert not [x for x in lines[first_token:] if x.startswith(":")]
    assert lines[-1] == "data: [DONE]"


async def test_startup_heap_is_frozen_once_the_engine_is_open():
    """A full collection while serving walks every object alive since start-up (with vLLM
    and torch imported: over 600,000, 0.9 s per collection on one core): the lifespan
    freezes them once it opened its engine, as vLLM's own server does."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0  # the control: nothing frozen before start-up
    app = build_app(Settings(model="sim", engine="simulator"))
    try:
        async with app.router.lifespan_context(app):
            assert app.state.services.engine is not None
            assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


async def test_a_finished_stream_leaves_no_reference_cycle(sim):
    """Per-stream objects (stream, producer task, meter, trail) must be freed by reference
    counting when the stream ends: a cycle through them lets every stream pile up until a
    full collection, which then walks and frees them all at once (a pause of every stream
    on the loop). Token SSE, the OpenAI route and WebSocket; the collector saves whatever
    it finds unreachable, and no Stream may be among it."""
    msgs = [{"role": "user", "content": "hi"}]
    async with serve(sim) as url:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            async with httpx.AsyncClient(base_url=url) as c:
                r = await c.post("/v1/stream", json={"prompt": "hi", "max_tokens": 5})
                assert r.status_code == 200 and "[DONE]" in r.text
                r = await c.post("/v1/chat/completions",
                                 json={"messages": msgs, "max_tokens": 5, "stream": True})  # fmt: skip
                assert r.status_code == 200 and "[DONE]" in r.text
            async with websockets.connect(ws_url(url)) as ws:
                await ws.send(json.dumps({"id": "a", "prompt": "hi", "params": {"max_tokens": 5}}))
                while not json.loads(await ws.recv())["finished"]:
                    pass
            await asyncio.sleep(0.2)  # the server's side of each stream has ended
            gc.collect()
            cyclic = [type(o).__name__ for o in gc.garbage]
            assert "Stream" not in cyclic, sorted(set(cyclic))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()


def _last_request(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    (value,) = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "sluice_last_request_timestamp_seconds"
    ]
    return value


async def test_last_request_gauge_starts_at_process_start_and_moves_on_admission(sim):
    """What the operator reads to scale a model to zero: set when the app is built (a new
    pod is never idle at once), moved to the admission time by each generation request, and
    not by probes or /metrics scrapes."""
    import time

    before_build = time.time()
    async with serve(sim) as url, httpx.AsyncClient(base_url=url) as c:
        started = _last_request((await c.get("/metrics")).text)
        assert before_build - 1 <= started <= time.time()
        await c.get("/ready")
        assert _last_request((await c.get("/metrics")).text) == started  # probes do not count
        sent = time.time()
        r = await c.post("/v1/stream", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
        moved = _last_request((await c.get("/metrics")).text)
        assert moved >= sent
