"""Refusals before the 200 that vLLM's serving layer takes part in, on the real engine:
capacity, body size, every kind of bad input (OpenAI-shaped errors) - and the server keeps
serving. Auth and per-key rate limits refuse before the engine is asked anything: they are
proven on the simulator (test_identity.py, test_limits_redis.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from app_helpers import error_of, sse_events, token_payloads
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine]


async def finish_ok(c: httpx.AsyncClient, headers=None, max_tokens=2, **kw) -> dict:
    events = await sse_events(c, "POST", "/v1/stream", headers=headers,
                              json={"prompt": "still serving", "max_tokens": max_tokens}, **kw)  # fmt: skip
    final = token_payloads(events)[-1]
    assert final["finished"] and final["usage"]["completion_tokens"] == max_tokens, final
    return final


async def test_capacity_limit_is_immediate_429(make_server, engine):
    url = await make_server(max_concurrent_streams=1)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/stream", json={"prompt": "hold", "max_tokens": 480}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass
            for method, path, body in (
                ("POST", "/v1/stream", {"prompt": "x"}),
                ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ):
                r2 = await asyncio.wait_for(c.request(method, path, json=body), 2)
                assert r2.status_code == 429, r2.text
                assert r2.headers["retry-after"] == "1"
                assert error_of(r2)["code"] == "capacity_exceeded"
        # the first stream is gone (closed early -> aborted); capacity is back
        await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=5,
                               message="the closed stream's engine request to end")  # fmt: skip
        await finish_ok(c)
        metrics = (await c.get("/metrics")).text
    assert 'protocol="sse",reason="capacity"} 1.0' in metrics
    assert 'protocol="openai",reason="capacity"} 1.0' in metrics
    assert 'sluice_active_streams{model="tiny",protocol="sse"} 0.0' in metrics


async def test_body_size_limit(make_server):
    url = await make_server(max_body_bytes=4096)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        big = {"prompt": "x" * 8000}
        r = await c.post("/v1/stream", json=big)
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
        r = await c.post("/v1/completions", json=big)
        assert r.status_code == 413

        async def chunked():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b" " * 1000

        r = await c.post("/v1/stream", content=chunked(),
                         headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 413
        await finish_ok(c)


LONG_PROMPT = " ".join(["overflowing"] * 2000)  # far past max_model_len=512

BAD_STREAM = [
    ("not json", b"{nope", "Invalid JSON body", None),
    ("array", b"[1]", "JSON object", None),
    ("no prompt", {"max_tokens": 3}, "exactly one of `prompt` or `messages`", None),
    ("both", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one", None),
    ("wrong type", {"prompt": "a", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("negative max_tokens", {"prompt": "a", "max_tokens": -5}, "greater than or equal to 1", "max_tokens"),
    ("temperature type", {"prompt": "a", "temperature": "hot"}, "temperature", "temperature"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, "role", None),
    ("unknown field", {"prompt": "a", "max_token": 3}, "max_token", "max_token"),
    ("unknown model", {"prompt": "a", "model": "gpt-5"}, "does not exist", "model"),
    ("too long", {"prompt": LONG_PROMPT}, "maximum context length is 512", "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("name, body, says, param", BAD_STREAM, ids=[b[0] for b in BAD_STREAM])
async def test_bad_input_token_stream(server_url, name, body, says, param):
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as c:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(
            body, bytes) else {"json": body}  # fmt: skip
        r = await c.post("/v1/stream", **kw)
        # An unknown model is a 404 listing what is served (LoRA adapters: docs), not a 400.
        assert r.status_code == (404 if name == "unknown model" else 400), r.text
        err = error_of(r)
        assert err["type"] == (
            "not_found_error" if name == "unknown model" else "invalid_request_error"
        )
        assert says in err["message"], err
        if param:
            assert err["param"] == param
        await finish_ok(c)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD_OPENAI = [
    ("chat", b"{nope", "Invalid JSON body"),
    ("chat", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ("chat", {**CHAT, "temperature": "warm"}, "temperature"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {**CHAT, "model": "gpt-5"}, "does not exist"),
    ("chat", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "context length"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, "context length"),
    ("completions", {"prompt": "x", "model": "nope"}, "does not exist"),
]


@pytest.mark.parametrize("route, body, says", BAD_OPENAI)
async def test_bad_input_openai(server_url, route, body, says):
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as c:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(
            body, bytes) else {"json": body}  # fmt: skip
        r = await c.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", **kw)
        assert r.status_code == 404 if says == "does not exist" else r.status_code in (400, 422), (
            r.text
        )
        err = error_of(r)
        assert says.lower() in err["message"].lower(), err
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
