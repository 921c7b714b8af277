"""Abort on disconnect, proven from the engine's own records.

Every batch of tokens the engine core makes carries the core's monotonic timestamp of the
step that made it (`EngineCoreOutputs.timestamp`, CLOCK_MONOTONIC, comparable across
processes on Linux). A spy on the front end's output processor logs each batch before any
filtering, including batches for a request that is already aborted, and a spy on
`AsyncLLM.abort` logs when the server asked the core to stop. Tokens generated after the
abort = tokens in batches stamped after that moment: at most 2 are allowed, on every route
(token SSE, WebSocket, OpenAI streamed and not, Responses, Messages), the server must have
asked at all, the request must have been cut short, and `engine.num_unfinished_requests()`
must return to 0. The tokens made after the client went away are printed beside: how soon
the server gets to run once the socket closes is the machine's doing (tens of ms on a
loaded 2-core machine, over 10 tokens of the tiny model), so they are no verdict.

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
from app_helpers import PROBE, engine_flushed
from testkit.nginx_proxy import NginxProxy, find_nginx
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

LONG = {"prompt": "The river", "max_tokens": 400, "ignore_eos": True}
MAX_AFTER = 2  # tokens the core may make after the server asked it to abort


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
    """Wait until the engine has no unfinished request, and until every batch the core
    made before it saw the abort has been counted (`engine_flushed`); returns how long the
    first took."""
    t0 = time.perf_counter()
    await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=limit_s,
                           interval=0.005, message="the engine request to finish")  # fmt: skip
    took = time.perf_counter() - t0
    await engine_flushed(engine)
    return took


async def read_sse_tokens(response: httpx.Response, n: int) -> int:
    got = 0
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            got += 1
            if got >= n:
                return got
    raise AssertionError(f"stream ended after {got} events")


CORE_LOG: list[tuple[float, int]] = []  # (core step timestamp, tokens) of every batch


ABORTS: list[float] = []  # when the server asked the engine core to abort (AsyncLLM.abort)


def core_tokens_after(t: float) -> int:
    return sum(n for ts, n in CORE_LOG if ts > t)


def tokens_after_abort(t_gone: float) -> int:
    """Tokens the core made after the server asked it to abort (its first abort at or after
    `t_gone`, when the client left); fails when the server never asked."""
    asked = [t for t in ABORTS if t >= t_gone]
    assert asked, "the server never asked the engine to abort"
    return core_tokens_after(asked[0])


@pytest.fixture(autouse=True)
async def idle_engine(engine):
    """Start idle, with the spies on the engine's output processor and its aborts."""
    await settle(engine)
    op = engine.llm.output_processor
    real = op.process_outputs

    def spy(outputs, engine_core_timestamp=None, *args, **kwargs):
        stamp = engine_core_timestamp or time.monotonic()
        made = sum(len(o.new_token_ids) for o in outputs if not o.request_id.startswith(PROBE))
        CORE_LOG.append((stamp, made))
        return real(outputs, engine_core_timestamp, *args, **kwargs)

    llm = engine.llm
    real_abort = llm.abort

    async def abort_spy(request_id, internal=False):
        ABORTS.append(time.monotonic())
        return await real_abort(request_id, internal)

    CORE_LOG.clear()
    ABORTS.clear()
    op.process_outputs = spy
    llm.abort = abort_spy  # AsyncLLM's every abort path calls self.abort
    try:
        yield
    finally:
        del op.process_outputs  # back to the class's methods
        del llm.abort


@pytest.mark.parametrize("via", ["direct", "nginx"])
async def test_sse_disconnect_mid_stream(server_url, engine, via):
    if via == "nginx" and find_nginx() is None:
        pytest.skip("nginx not installed")
    proxy = NginxProxy(server_url, "ingress").start() if via == "nginx" else None
    try:
        base = proxy.url if proxy else server_url
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
        after, left = tokens_after_abort(t_gone), core_tokens_after(t_gone)
        print(f"\nTIMING sse disconnect ({via}): engine tokens after the abort={after}, after "
              f"the client left={left} (front-end counter: {counted:.0f}); engine idle after "
              f"{took * 1e3:.0f}ms")  # fmt: skip
        # Through nginx the server learns of it when nginx closes the upstream connection:
        # 30-400 ms after the client left on a loaded 2-core machine (hundreds of tokens of
        # the tiny model at ~3 ms each). From then on the server's share is the same.
        assert core_tokens_after(0.0) < LONG["max_tokens"]  # it really was cut short
        assert after <= MAX_AFTER
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
    after, left = tokens_after_abort(t_gone), core_tokens_after(t_gone)
    print(f"\nTIMING websocket close: engine tokens after the abort={after}, after the client "
          f"left={left} (front-end counter: {generated_tokens() - at_disconnect:.0f}); engine "
          f"idle after {took * 1e3:.0f}ms")  # fmt: skip
    assert at_disconnect - before < LONG["max_tokens"]
    assert after <= MAX_AFTER

    # A polite close handshake aborts too.
    async with websockets.connect(ws_url, open_timeout=10) as ws:
        await ws.send(_gen_frame("b"))
        await _ws_tokens(ws, "b", 10)
        t_gone = time.monotonic()
    await settle(engine)
    assert tokens_after_abort(t_gone) <= MAX_AFTER


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
        after, left = tokens_after_abort(t_stop), core_tokens_after(t_stop)
        print(f"\nTIMING websocket stop: engine tokens after the abort={after}, after the stop "
              f"frame={left}; engine idle after {took * 1e3:.0f}ms")  # fmt: skip
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
    after, left = tokens_after_abort(t_gone), core_tokens_after(t_gone)
    made = core_tokens_after(0.0)
    print(f"\nTIMING {api} disconnect: engine tokens after the abort={after}, after the client "
          f"left={left} (of {made}); engine idle after {took * 1e3:.0f}ms")  # fmt: skip
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
        await eventually_async(engine.num_unfinished_requests, timeout=5, interval=0,
                               message="the request to reach the engine")  # fmt: skip
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
          f"(after the abort: {tokens_after_abort(t_gone)}, after the client left: "
          f"{core_tokens_after(t_gone)})")  # fmt: skip
    assert tokens_after_abort(t_gone) <= MAX_AFTER


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
    await eventually_async(lambda: core_tokens_after(0.0) >= 20, timeout=10, interval=0.001,
                           message="20 tokens from the engine")  # fmt: skip
    t_gone = time.monotonic()
    writer.transport.abort()
    took = await settle(engine)
    after, left = tokens_after_abort(t_gone), core_tokens_after(t_gone)
    total = core_tokens_after(0.0)
    print(f"\nTIMING openai {route} non-streamed disconnect: engine tokens after the abort="
          f"{after}, after the client left={left} (of {total}); engine idle after "
          f"{took * 1e3:.0f}ms")  # fmt: skip
    assert total < body["max_tokens"]
    assert after <= MAX_AFTER
