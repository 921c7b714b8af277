"""The three protocols on the real engine: token SSE (POST and GET), OpenAI routes
(vLLM's serving layer), WebSocket multiplexing/stop/bad frames, protocol gating."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from app_helpers import error_of, sse_events, token_payloads, ws_url
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine]


async def test_token_sse_post_and_get(server_url):
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as c:
        events = await sse_events(c, "POST", "/v1/stream",
                                  json={"prompt": "hello there", "max_tokens": 12})  # fmt: skip
        assert all("id" in e for e in events), events
        assert events[-1]["data"] == "[DONE]"
        payloads = token_payloads(events)
        tokens, final = payloads[:-1], payloads[-1]
        assert tokens and all(p["finished"] is False for p in tokens)
        assert [p["index"] for p in tokens] == list(range(len(tokens)))
        assert final["finished"] is True and final["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == 12
        assert final["usage"]["prompt_tokens"] > 0
        # GET for EventSource, messages as JSON, same shape
        msgs = json.dumps([{"role": "user", "content": "hi"}])
        events = await sse_events(c, "GET", "/v1/stream",
                                  params={"messages": msgs, "max_tokens": "5"})  # fmt: skip
        final = token_payloads(events)[-1]
        assert final["usage"]["completion_tokens"] == 5
        async with c.stream("POST", "/v1/stream", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.headers["cache-control"] == "no-cache"
            assert r.headers["x-accel-buffering"] == "no"


async def test_openai_chat_and_completions_with_sdk(server_url):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server_url + "/v1", api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=7, seed=1
    )
    assert chat.usage.completion_tokens == 7 and chat.choices[0].message.content

    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9,
        stream=True, stream_options={"include_usage": True}, temperature=0.5, top_p=0.9,
    )  # fmt: skip
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text and usage.completion_tokens == 9

    comp = await client.completions.create(model="tiny", prompt="abc", max_tokens=4)
    assert comp.usage.completion_tokens == 4
    stream = await client.completions.create(model="tiny", prompt="abc", max_tokens=6,
                                             stream=True)  # fmt: skip
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(pieces)


async def test_websocket_multiplexes_requests(server_url):
    async with websockets.connect(ws_url(server_url)) as ws:
        await ws.send(json.dumps({"id": "a", "prompt": "one", "params": {"max_tokens": 20}}))
        await ws.send(json.dumps({"id": 7, "messages": [{"role": "user", "content": "two"}],
                                  "params": {"max_tokens": 11}}))  # fmt: skip
        frames: dict = {"a": [], 7: []}
        finals = {}
        while len(finals) < 2:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert "error" not in f, f
            if f["finished"]:
                finals[f["id"]] = f
            else:
                frames[f["id"]].append(f)
        for rid, n in (("a", 20), (7, 11)):
            assert [f["index"] for f in frames[rid]] == list(range(len(frames[rid])))
            assert finals[rid]["usage"]["completion_tokens"] == n
            assert finals[rid]["finish_reason"] == "length"


async def test_websocket_stop_and_reuse(server_url, engine):
    async with websockets.connect(ws_url(server_url)) as ws:
        await ws.send(json.dumps({"id": "long", "prompt": "go", "params": {"max_tokens": 480}}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert first["id"] == "long" and not first["finished"]
        await ws.send(json.dumps({"type": "stop", "id": "long"}))
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if f.get("finished"):
                break
        assert f["finish_reason"] == "abort"
        await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=2,
                               message="the stopped request to leave the engine")  # fmt: skip
        # the same socket serves the next request
        await ws.send(json.dumps({"id": "next", "prompt": "again", "params": {"max_tokens": 3}}))
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if f.get("finished"):
                break
        assert f["id"] == "next" and f["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "frame, code",
    [
        ("not json", "invalid_json"),
        ("[1, 2]", "bad_frame"),
        (json.dumps({"prompt": "no id"}), "bad_frame"),
        (json.dumps({"id": "x", "type": "dance"}), "bad_frame"),
        (json.dumps({"id": "x", "prompt": "p", "params": {"max_tokens": -1}}), None),
        (json.dumps({"id": "x", "prompt": "p", "params": {"bogus": 1}}), None),
        (json.dumps({"id": "x", "prompt": "p", "model": "gpt-4"}), "model_not_found"),
        (json.dumps({"id": "x"}), None),
        (b"\x00binary", "bad_frame"),
    ],
)
async def test_websocket_bad_frame_gets_error_and_socket_stays_usable(server_url, frame, code):
    async with websockets.connect(ws_url(server_url)) as ws:
        await ws.send(frame)
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["message"], err
        if code:
            assert err["error"]["code"] == code, err
        await ws.send(json.dumps({"id": "ok", "prompt": "fine", "params": {"max_tokens": 2}}))
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if f.get("finished"):
                break
        assert f["id"] == "ok" and f["usage"]["completion_tokens"] == 2


async def test_protocol_gating(make_server):
    ws_only = await make_server(protocols=["websocket"])
    async with httpx.AsyncClient(base_url=ws_only, timeout=30) as c:
        for method, path in (("POST", "/v1/stream"), ("GET", "/v1/stream"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):  # fmt: skip
            r = await c.request(method, path, json={"prompt": "x"})
            assert r.status_code == 404, (path, r.text)
            assert "protocol 'sse' is disabled" in error_of(r)["message"]
        assert (await c.get("/ready")).status_code == 200
    async with websockets.connect(ws_url(ws_only)) as ws:
        await ws.send(json.dumps({"id": 1, "prompt": "x", "params": {"max_tokens": 1}}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["id"] == 1

    sse_only = await make_server(protocols=["sse"])
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(ws_url(sse_only)):
            pass
    assert info.value.response.status_code == 404
    assert b"protocol 'websocket' is disabled" in info.value.response.body
