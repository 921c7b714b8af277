"""Streaming behaviour on the real engine that is the server core's job: the whole-stream
timeout, abort on disconnect (before and after the first token), and errors after the 200
ending the stream cleanly."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from app_helpers import sse_events, token_payloads, ws_url
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine]


async def settled(engine, within: float = 5.0) -> None:
    """No engine request left unfinished (within `within` seconds)."""
    await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=within,
                           message=lambda: f"{engine.num_unfinished_requests()} unfinished")  # fmt: skip


async def test_stream_timeout_sends_error_event_and_aborts(make_server, engine):
    url = await make_server(stream_timeout_seconds=0.4)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        events = await sse_events(c, "POST", "/v1/stream", json={"prompt": "t", "max_tokens": 480})
        errors = [e for e in events if e.get("event") == "error"]
        assert len(errors) == 1 and events[-1]["data"] == "[DONE]"
        assert "time limit" in json.loads(errors[0]["data"])["error"]["message"]
        assert len(token_payloads(events)) < 480
        # OpenAI route: error event then data: [DONE]
        async with c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "t"}], "max_tokens": 480, "stream": True,
        }) as r:  # fmt: skip
            body = (await r.aread()).decode()
        assert "event: error" in body and body.rstrip().endswith("data: [DONE]")
        metrics = (await c.get("/metrics")).text
    await settled(engine)
    assert 'sluice_stream_errors_total{model="tiny",protocol="sse"} 1.0' in metrics

    async with websockets.connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"id": "t", "prompt": "t", "params": {"max_tokens": 480}}))
        while "error" not in (f := json.loads(await asyncio.wait_for(ws.recv(), 30))):
            assert not f["finished"]
        assert "time limit" in f["error"]["message"] and f["id"] == "t"
    await settled(engine)


async def test_disconnect_before_first_token_aborts(server_url, engine):
    """The client leaves while the prompt is still in prefill: nothing is left running."""
    prompt = " ".join(["prefill"] * 70)  # ~420 tokens: a long prefill
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as c:
        for _ in range(3):
            async with c.stream(
                "POST", "/v1/stream", json={"prompt": prompt, "max_tokens": 50}
            ) as r:
                assert r.status_code == 200
            # closed right after the headers: before the first token
    await settled(engine)


async def test_websocket_close_aborts_all_requests(server_url, engine):
    async with websockets.connect(ws_url(server_url)) as ws:
        for i in range(3):
            await ws.send(json.dumps({"id": i, "prompt": "w", "params": {"max_tokens": 480}}))
        await asyncio.wait_for(ws.recv(), 30)
        assert engine.num_unfinished_requests() >= 1
    await settled(engine)


async def test_drain_in_process(make_server, engine):
    """Gate-level drain: new streams 503, /ready 503, in-flight past the grace gets an
    error event (the SIGTERM path with a real process is in test_app_drain.py)."""
    url = await make_server()
    app = make_server.apps[url]
    gate = app.state.services.gate
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/stream", json={"prompt": "d", "max_tokens": 480}) as r:
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass
            drain = asyncio.create_task(gate.drain(0.3))
            await eventually_async(lambda: gate.draining, timeout=5, message="the drain to begin")
            assert (await c.get("/ready")).status_code == 503
            refused = await c.post("/v1/stream", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            rest = [line async for line in lines]
        assert await drain == 1
        assert "event: error" in rest and rest[-2] == "data: [DONE]"
        assert any("drain" in line for line in rest)
    await settled(engine)


async def test_sse_heartbeat_only_when_idle(make_server):
    """Heartbeat comments keep idle proxies from cutting a long prefill or slow stream; a
    stream that is sending tokens needs none, so the real engine's stream carries none
    (the idle case, a long prefill, is in tests/server/unit/test_sse_send.py and
    test_app_simulator.py)."""
    # 1 s: a busy machine may pause the engine for a fraction of a second between tokens,
    # and a pause past the heartbeat rightly gets a ping; the stream lasts longer than 1 s,
    # so a server that pinged on a fixed beat would still be caught.
    url = await make_server(heartbeat_seconds=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/stream", json={"prompt": "h", "max_tokens": 400}) as r:
            lines = [line async for line in r.aiter_lines()]
    assert not [line for line in lines if line.startswith(":")]
    assert lines[-2] == "data: [DONE]"
