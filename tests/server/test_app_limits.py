"""Refusals before the 200, on the real engine: auth, per-key rate limits, capacity, body
size, every kind of bad input (OpenAI-shaped errors) - and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import websockets
from app_helpers import error_of, sse_events, token_payloads, ws_url
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine]

KEYS = ("sk-alpha-0123456789", "sk-bravo-9876543210")


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(f"# mounted from a Secret\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    return path


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def finish_ok(c: httpx.AsyncClient, headers=None, max_tokens=2, **kw) -> dict:
    events = await sse_events(c, "POST", "/v1/stream", headers=headers,
                              json={"prompt": "still serving", "max_tokens": max_tokens}, **kw)  # fmt: skip
    final = token_payloads(events)[-1]
    assert final["finished"] and final["usage"]["completion_tokens"] == max_tokens, final
    return final


async def test_api_keys(make_server, key_file, caplog):
    caplog.set_level(logging.DEBUG)
    url = await make_server(api_key_file=key_file)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/stream", json={"prompt": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["code"] == "missing_api_key"
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer("sk-alpha-01234567"))
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", headers=bearer("nope"),
                         json={"messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert r.status_code == 401
        r = await c.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})
        assert r.status_code == 401
        for key in KEYS:  # several keys in one file
            await finish_ok(c, headers=bearer(key))
        # EventSource cannot set headers: GET accepts ?api_key=
        events = await sse_events(c, "GET", "/v1/stream",
                                  params={"prompt": "q", "max_tokens": "1", "api_key": KEYS[1]})  # fmt: skip
        assert token_payloads(events)[-1]["finished"]
        # probes need no key
        for path in ("/health", "/ready", "/metrics"):
            assert (await c.get(path)).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert 'sluice_rejections_total{model="tiny",protocol="sse",reason="auth"} 2.0' in metrics
    assert 'sluice_rejections_total{model="tiny",protocol="openai",reason="auth"} 2.0' in metrics

    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(ws_url(url)):
            pass
    assert info.value.response.status_code == 401
    for kw in ({"additional_headers": bearer(KEYS[0])}, {}):
        target = ws_url(url) + ("" if kw else f"?api_key={KEYS[1]}")
        async with websockets.connect(target, **kw) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "k", "params": {"max_tokens": 1}}))
            while not json.loads(await asyncio.wait_for(ws.recv(), 30))["finished"]:
                pass
    # keys never reach the server's logs (the test's own client libraries may log them)
    server_side = [r for r in caplog.records if not r.name.startswith(("websockets.client",
                   "httpx", "httpcore", "openai"))]  # fmt: skip
    assert server_side, "expected some server-side log records at DEBUG"
    assert not any(k in r.getMessage() for r in server_side for k in KEYS)


async def test_rate_limit_requests_per_minute(make_server, key_file):
    url = await make_server(api_key_file=key_file, rate_limit_rpm=2)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await finish_ok(c, headers=bearer(KEYS[0]))
        await finish_ok(c, headers=bearer(KEYS[0]))
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer(KEYS[0]))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        err = error_of(r)
        assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]
        # per key: the other key is unaffected
        await finish_ok(c, headers=bearer(KEYS[1]))
        # the WebSocket draws on the same bucket: an error frame, the socket stays open
        async with websockets.connect(ws_url(url), additional_headers=bearer(KEYS[0])) as ws:
            await ws.send(json.dumps({"id": "r", "prompt": "x", "params": {"max_tokens": 1}}))
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert f["type"] == "error" and f["id"] == "r"
            assert f["error"]["code"] == "rate_limit_exceeded"
        metrics = (await c.get("/metrics")).text
    assert 'protocol="sse",reason="rate_limit"} 1.0' in metrics
    assert 'protocol="websocket",reason="rate_limit"} 1.0' in metrics


async def test_rate_limit_tokens_per_minute(make_server, key_file):
    url = await make_server(api_key_file=key_file, rate_limit_tpm=30)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await finish_ok(c, headers=bearer(KEYS[0]), max_tokens=40)  # prompt + 40 > 30
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer(KEYS[0]))
        assert r.status_code == 429
        assert "tokens per minute" in error_of(r)["message"]
        assert int(r.headers["retry-after"]) >= 1


async def test_rate_limit_shared_by_two_replicas_through_redis(make_server, key_file,
                                                                redis_server):  # fmt: skip
    """Two apps (replicas) on the real engine, one Redis: the key's 2 requests per minute
    hold across both, each replica refuses once the other spent them."""
    shared = dict(api_key_file=key_file, rate_limit_rpm=2, rate_limit_backend="redis",
                  redis_url=redis_server.url)  # fmt: skip
    a, b = await make_server(**shared), await make_server(**shared)
    async with httpx.AsyncClient(base_url=a, timeout=60) as ca, \
            httpx.AsyncClient(base_url=b, timeout=60) as cb:  # fmt: skip
        await finish_ok(ca, headers=bearer(KEYS[0]))
        r = await cb.post("/v1/chat/completions", headers=bearer(KEYS[0]),
                          json={**CHAT, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        for c in (ca, cb):
            r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer(KEYS[0]))
            assert r.status_code == 429 and error_of(r)["code"] == "rate_limit_exceeded"
        await finish_ok(cb, headers=bearer(KEYS[1]))  # per key


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
