"""Abort on disconnect, proven from the engine's own records.

Every batch of tokens the engine core makes carries the core's monotonic timestamp of the
step that made it (`EngineCoreOutputs.timestamp`, CLOCK_MONOTONIC, comparable across
processes on Linux). A spy on the front end's output processor logs each batch before any
filtering, including batches for a request that is already aborted. Tokens generated
after the disconnect = tokens in batches stamped after the moment the client went away.
At most 2 are allowed, on every route (token SSE, WebSocket, OpenAI streamed and not,
Responses, Messages). `engine.num_unfinished_requests()` must return to 0.

vLLM's `vllm:generation_tokens_total` counter is printed too, but it is no proof: the
front end counts a token when it processes it, which can lag the core by many steps on a
busy machine (tokens made before the disconnect, counted after it).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httpx
import pytest
import websockets
from nginx_proxy import NginxProxy, find_nginx

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

LONG = {"prompt": "The river", "max_tokens": 400, "ignore_eos": True}
MAX_AFTER = 2  # tokens the issue tolerates after a disconnect


def generated_tokens() -> float:
    """vLLM's generation token counter (all requests; tests here run one at a time)."""
    from prometheus_client import REGISTRY

    total, seen = 0.0, False
    for metric in REGISTRY.collect():
        if metric.name == "vllm:generation_tokens":
            for s in metric.samples:
                if s.name == "vllm:generation_tokens_total":
                    total += s.value
                    seen = True
    assert seen, "vLLM's Prometheus stat logger is not registered (log stats disabled?)"
    return total


async def settle(engine, limit_s: float = 5.0) -> float:
    """Wait until the engine has no unfinished request; returns how long it took."""
    t0 = time.perf_counter()
    while engine.num_unfinished_requests():
        assert time.perf_counter() - t0 < limit_s, "engine request left unfinished"
        await asyncio.sleep(0.005)
    # One more beat so any output already in flight to the front end is counted too.
    await asyncio.sleep(0.05)
    return time.perf_counter() - t0


async def read_sse_tokens(response: httpx.Response, n: int) -> int:
    got = 0
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            got += 1
            if got >= n:
                return got
    raise AssertionError(f"stream ended after {got} events")


CORE_LOG: list[tuple[float, int]] = []  # (core step timestamp, tokens) of every batch


def core_tokens_after(t: float) -> int:
    return sum(n for ts, n in CORE_LOG if ts > t)


@pytest.fixture(autouse=True)
async def idle_engine(engine):
    """Start idle, with the spy on the engine's output processor."""
    await settle(engine)
    op = engine.llm.output_processor
    real = op.process_outputs

    def spy(outputs, engine_core_timestamp=None, *args, **kwargs):
        stamp = engine_core_timestamp or time.monotonic()
        CORE_LOG.append((stamp, sum(len(o.new_token_ids) for o in outputs)))
        return real(outputs, engine_core_timestamp, *args, **kwargs)

    CORE_LOG.clear()
    op.process_outputs = spy
    try:
        yield
    finally:
        del op.process_outputs  # back to the class's method


@pytest.mark.parametrize("via", ["direct", "nginx"])
async def test_sse_disconnect_mid_stream(server_url, engine, via):
    if via == "nginx" and find_nginx() is None:
        pytest.skip("nginx not installed")
    proxy = NginxProxy(server_url, "ingress").start() if via == "nginx" else None
    try:
        base = proxy.url if proxy else server_url
        before = generated_tokens()
        client = httpx.AsyncClient(timeout=30)
        async with client.stream("POST", base + "/v1/stream", json=LONG) as r:
            assert r.status_code == 200
            await read_sse_tokens(r, 20)
            at_disconnect = generated_tokens()
            t_gone = time.monotonic()
            # Drop the TCP connection, not just the response (httpx would otherwise keep
            # reading to reuse the connection).
            await client.aclose()
        took = await settle(engine)
        counted = generated_tokens() - at_disconnect
        after = core_tokens_after(t_gone)
        print(f"\nTIMING sse disconnect ({via}): engine tokens after disconnect={after} "
              f"(front-end counter: {counted:.0f}); engine idle after {took * 1e3:.0f}ms")  # fmt: skip
        assert at_disconnect - before < LONG["max_tokens"]  # it really was cut short
        if via == "direct":
            assert after <= MAX_AFTER
        else:
            # nginx notices the client left and closes its upstream connection first; that
            # hop took 30-140 ms on a loaded 2-core machine (tens of tokens of the tiny
            # model at ~3 ms each). The server's own share is the direct case above.
            assert counted + (at_disconnect - before) < LONG["max_tokens"] - 100
    finally:
        if proxy:
            proxy.stop()


async def test_sse_disconnect_before_first_token(server_url, engine):
    """Raw socket: send the request, close as soon as the engine has it, before any token
    reaches us. At most 2 tokens are ever generated for it."""
    await _disconnect_before_first_token(server_url, engine, "/v1/stream", LONG)


async def _ws_tokens(ws, rid: str, n: int) -> int:
    got = 0
    while got < n:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert msg["id"] == rid and msg.get("type") != "error", msg
        assert not msg["finished"], msg
        got += 1
    return got


def _gen_frame(rid: str) -> str:
    params = {k: v for k, v in LONG.items() if k != "prompt"}
    return json.dumps({"id": rid, "prompt": LONG["prompt"], "params": params})


async def test_websocket_close_aborts(server_url, engine):
    ws_url = server_url.replace("http://", "ws://") + "/ws/stream"
    before = generated_tokens()
    ws = await websockets.connect(ws_url, open_timeout=10)
    await ws.send(_gen_frame("a"))
    await _ws_tokens(ws, "a", 20)
    at_disconnect = generated_tokens()
    t_gone = time.monotonic()
    ws.transport.abort()  # the client vanishes (no close handshake)
    took = await settle(engine)
    after = core_tokens_after(t_gone)
    print(f"\nTIMING websocket close: engine tokens after disconnect={after} (front-end counter: "
          f"{generated_tokens() - at_disconnect:.0f}); engine idle after {took * 1e3:.0f}ms")  # fmt: skip
    assert at_disconnect - before < LONG["max_tokens"]
    assert after <= MAX_AFTER

    # A polite close handshake aborts too.
    async with websockets.connect(ws_url, open_timeout=10) as ws:
        await ws.send(_gen_frame("b"))
        await _ws_tokens(ws, "b", 10)
        t_gone = time.monotonic()
    await settle(engine)
    assert core_tokens_after(t_gone) <= MAX_AFTER


async def test_websocket_stop_aborts_and_socket_stays_usable(server_url, engine):
    ws_url = server_url.replace("http://", "ws://") + "/ws/stream"
    async with websockets.connect(ws_url, open_timeout=10) as ws:
        await ws.send(_gen_frame("s1"))
        await _ws_tokens(ws, "s1", 20)
        t_stop = time.monotonic()
        await ws.send(json.dumps({"type": "stop", "id": "s1"}))
        # Frames already on the way may still arrive; then the final one.
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert msg["id"] == "s1" and msg.get("type") != "error", msg
            if msg["finished"]:
                break
        assert msg["finish_reason"] == "abort"
        took = await settle(engine)
        after = core_tokens_after(t_stop)
        print(f"\nTIMING websocket stop: engine tokens after stop={after} engine idle after "
              f"{took * 1e3:.0f}ms")  # fmt: skip
        assert after <= MAX_AFTER
        # The same socket serves the next request to the end.
        await ws.send(json.dumps({"id": "s2", "prompt": "Hi", "params": {"max_tokens": 5}}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert msg["id"] == "s2", msg
            if msg["finished"]:
                break
        assert msg["finish_reason"] == "length" and msg["usage"]["completion_tokens"] == 5


# The streamed APIs the engine renders (OpenAI Responses, Anthropic Messages, OpenAI chat
# and completions):
# path and a long streamed body.
API_STREAMS = {
    "responses": ("/v1/responses", {"model": "tiny", "input": "The river",
                                    "max_output_tokens": 400, "stream": True}),
    "anthropic": ("/v1/messages", {"model": "tiny", "max_tokens": 400, "stream": True,
                                   "messages": [{"role": "user", "content": "The river"}]}),
    "openai": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 400, "stream": True,
                                        "ignore_eos": True,
                                        "messages": [{"role": "user", "content": "The river"}]}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "The river",
                                        "max_tokens": 400, "ignore_eos": True, "stream": True}),
}  # fmt: skip


@pytest.mark.parametrize("api", list(API_STREAMS))
async def test_api_disconnect_mid_stream(server_url, engine, api):
    path, body = API_STREAMS[api]
    client = httpx.AsyncClient(timeout=30)
    async with client.stream("POST", server_url + path, json=body) as r:
        assert r.status_code == 200
        await read_sse_tokens(r, 20)
        t_gone = time.monotonic()
        await client.aclose()
    took = await settle(engine)
    after = core_tokens_after(t_gone)
    made = core_tokens_after(0.0)
    print(f"\nTIMING {api} disconnect: engine tokens after disconnect={after} "
          f"(of {made}); engine idle after {took * 1e3:.0f}ms")  # fmt: skip
    assert made < 400  # it really was cut short
    assert after <= MAX_AFTER


@pytest.mark.parametrize("api", list(API_STREAMS))
async def test_api_disconnect_before_first_token(server_url, engine, api):
    path, body = API_STREAMS[api]
    await _disconnect_before_first_token(server_url, engine, path, body)


async def _disconnect_before_first_token(server_url, engine, path: str, body: dict) -> None:
    """Raw socket: send the request, close as soon as the engine has it, before any token
    reaches us (retried until no token had been made at that moment)."""
    u = urlsplit(server_url)
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()  # fmt: skip
    for _attempt in range(5):
        CORE_LOG.clear()
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head + raw)
        await writer.drain()
        t0 = time.perf_counter()
        while not engine.num_unfinished_requests():
            assert time.perf_counter() - t0 < 5, "request never reached the engine"
            await asyncio.sleep(0)
        t_gone = time.monotonic()
        seen = core_tokens_after(0.0)
        writer.transport.abort()
        await settle(engine)
        total = core_tokens_after(0.0)
        if seen == 0:
            break  # we did disconnect before the first token
    else:
        pytest.fail("could not disconnect before the first token in 5 tries")
    print(f"\nTIMING {path} disconnect before first token: engine tokens in total={total} "
          f"(after the disconnect: {core_tokens_after(t_gone)})")  # fmt: skip
    assert core_tokens_after(t_gone) <= MAX_AFTER


CHAT_LONG = {"model": "tiny", "messages": [{"role": "user", "content": "The river"}],
             "max_tokens": 400, "ignore_eos": True}  # fmt: skip


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_openai_non_streamed_disconnect_aborts(server_url, engine, route):
    """Raw socket: send a non-streamed request, close once the engine has made some tokens
    (no byte of the answer exists yet: it comes whole at the end)."""
    body = dict(CHAT_LONG)
    if route == "/v1/completions":
        body = {"model": "tiny", "prompt": "The river", "max_tokens": 400, "ignore_eos": True}
    u = urlsplit(server_url)
    raw = json.dumps(body).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()  # fmt: skip
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(head + raw)
    await writer.drain()
    t0 = time.perf_counter()
    while core_tokens_after(0.0) < 20:
        assert time.perf_counter() - t0 < 10, "the engine made no tokens"
        await asyncio.sleep(0.001)
    t_gone = time.monotonic()
    writer.transport.abort()
    took = await settle(engine)
    after = core_tokens_after(t_gone)
    total = core_tokens_after(0.0)
    print(f"\nTIMING openai {route} non-streamed disconnect: engine tokens after disconnect="
          f"{after} (of {total}); engine idle after {took * 1e3:.0f}ms")  # fmt: skip
    assert total < body["max_tokens"]
    assert after <= MAX_AFTER
