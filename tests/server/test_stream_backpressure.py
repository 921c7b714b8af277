"""A stalled reader: a raw-socket client with a tiny receive buffer stops reading. The
server must notice (buffer cap or send timeout), abort the engine request, end the stream
with an error event, and keep its memory bounded. And a slow reader that keeps reading is
never cut off, and gets coalesced events.

The server's send watchdog keeps little in front of a slow reader while a stream runs (the
transport pauses at its first buffered byte, the kernel holds at most 4 KiB unsent:
transport/sendwatch.py), so a client's small receive buffer (per socket) is enough for the
server to feel the reader at once. The stall tests also give the server's listening socket
a 4 KiB send buffer (accepted sockets inherit it): a slow network in miniature. Everything
above the socket is the production code path (`build_app`, the session engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import psutil
import pytest
from test_stream_abort import generated_tokens, settle
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MAX_TOKENS = 480  # the session engine's max_model_len is 512
TRIALS = 3  # stalled-reader trials before a send timeout test gives up (see its docstring)
BODY = json.dumps({"prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()


@contextlib.asynccontextmanager
async def small_buffer_server(engine, tiny_model_path, **overrides):
    import uvicorn
    from app_helpers import engine_settings, serving
    from sluice_server.app import build_app

    sock = socket.socket()
    # Accepted connections inherit the listener's (locked) send buffer size on Linux.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = engine_settings(tiny_model_path, port=port, **overrides)
    config = uvicorn.Config(build_app(settings, engine), log_level="warning", lifespan="on")
    try:
        async with serving(config, sockets=[sock]):
            yield port
    finally:
        sock.close()


async def stalled_request(port: int, path: str = "/v1/stream",
                          body: bytes = BODY) -> tuple[socket.socket, float]:  # fmt: skip
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel makes it ~2.3 KiB
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(s, ("127.0.0.1", port))
    before = generated_tokens()
    await loop.sock_sendall(s, (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)  # fmt: skip
    return s, before


async def started(before: float) -> None:
    """The engine made tokens for the stalled request (its counter moved past `before`)."""
    await eventually_async(lambda: generated_tokens() > before, timeout=60,
                           message="the engine to start on the request")  # fmt: skip


async def read_all(s: socket.socket, limit_s: float = 10.0) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(limit_s):
            while True:
                chunk = await loop.sock_recv(s, 65536)
                if not chunk:
                    break
                data += chunk
                if data.endswith(b"0\r\n\r\n"):  # end of the chunked response
                    break
    return data


async def test_buffer_cap_aborts_and_reports_error(engine, tiny_model_path):
    """The reader stalls; past 16 undelivered events the request is aborted. When the
    reader comes back it gets what was sent, then the error event and [DONE]."""
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    async with small_buffer_server(engine, tiny_model_path, stream_buffer_tokens=16,
                                   send_timeout_seconds=30) as port:  # fmt: skip
        s, before = await stalled_request(port)
        t0 = time.perf_counter()
        await started(before)
        took = await settle(engine, limit_s=20)  # the engine request ends while we stall
        generated = generated_tokens() - before
        rss1 = proc.memory_info().rss
        data = await read_all(s)
        s.close()
    text = data.decode(errors="replace")
    print(f"\nTIMING stalled reader (buffer cap 16): engine stopped after {generated:.0f}/"
          f"{MAX_TOKENS} tokens, {time.perf_counter() - t0:.2f}s (idle wait {took:.2f}s); "
          f"client got {len(data)} bytes; RSS delta {(rss1 - rss0) / 2**20:+.1f} MiB")  # fmt: skip
    assert generated < MAX_TOKENS * 0.8, "the request was not aborted early"
    assert "event: error" in text and "too slow" in text.lower(), text[-600:]
    assert text.rstrip("\r\n0 ").endswith("data: [DONE]"), text[-300:]
    assert rss1 - rss0 < 64 * 2**20


async def test_send_timeout_aborts_a_reader_that_never_returns(engine, tiny_model_path):
    """A reader that stops reading is cut `send_timeout_seconds` after its last byte moved,
    and its engine request is aborted.

    The engine runs in its own process: while the server's loop is starved (a busy
    machine), the engine may produce all its tokens before the server's watchdog runs, and
    that trial cannot show an abort. Such a trial is recorded by the engine itself (every
    token counted) and repeated, up to `TRIALS`; without the watchdog every trial runs to
    the end (send_timeout_seconds=30 here fails)."""
    trials = []
    for _ in range(TRIALS):
        async with small_buffer_server(engine, tiny_model_path, stream_buffer_tokens=4096,
                                       send_timeout_seconds=0.2) as port:  # fmt: skip
            s, before = await stalled_request(port)
            await started(before)
            took = await settle(engine, limit_s=20)
            generated = generated_tokens() - before
            data = await read_all(s, limit_s=10)  # the server closes the connection
            s.close()
        text = data.decode(errors="replace")
        has_error = "event: error" in text
        trials.append(generated)
        print(f"\nTIMING stalled reader (send timeout 0.2s): engine stopped after "
              f"{generated:.0f}/{MAX_TOKENS} tokens (idle wait {took:.2f}s); client got "
              f"{len(data)} bytes; error event delivered: {has_error}")  # fmt: skip
        # Cut off: the reader never gets a clean end, whoever won the race.
        assert not text.rstrip("\r\n0 ").endswith("data: [DONE]") or has_error
        if generated < MAX_TOKENS:
            break
    assert trials[-1] < MAX_TOKENS, f"the request was not aborted in {TRIALS} trials: {trials}"


# The streamed APIs the engine renders: path, body, and how each says "error" after the 200.
API_STREAMS = {
    "responses": ("/v1/responses", {"model": "tiny", "input": "Hi", "stream": True,
                                    "max_output_tokens": MAX_TOKENS - 40},
                  '"type": "error", "code": "stream_error"'),
    "anthropic": ("/v1/messages", {"model": "tiny", "max_tokens": MAX_TOKENS - 40, "stream": True,
                                   "messages": [{"role": "user", "content": "Hi"}]},
                  '"type": "error", "error": {"type": "api_error"'),
}  # fmt: skip


@pytest.mark.parametrize("api", list(API_STREAMS))
async def test_stalled_reader_is_cut_off_with_the_apis_error_event(engine, tiny_model_path, api):
    """The buffer cap on every streamed API: the engine request is aborted early, and the
    reader, when it comes back, finds the API's own error event last."""
    path, body, error_shape = API_STREAMS[api]
    limit = body.get("max_output_tokens") or body["max_tokens"]
    async with small_buffer_server(engine, tiny_model_path, stream_buffer_tokens=16,
                                   send_timeout_seconds=30) as port:  # fmt: skip
        s, before = await stalled_request(port, path, json.dumps(body).encode())
        await started(before)
        await settle(engine, limit_s=20)
        generated = generated_tokens() - before
        data = await read_all(s)
        s.close()
    text = data.decode(errors="replace")
    print(f"\nTIMING stalled {api} reader (buffer cap 16): engine stopped after "
          f"{generated:.0f}/{limit} tokens; client got {len(data)} bytes")  # fmt: skip
    assert generated < limit * 0.8, "the request was not aborted early"
    last = text.rstrip("\r\n0 ").rsplit("event: ", 1)[-1]
    assert last.startswith("error\n") and error_shape in last and "too slow" in last, last


async def test_a_steady_slow_reader_is_never_cut_and_gets_coalesced_events(make_server):
    """The real engine, the server's own uvicorn configuration, a 2 s send timeout: a reader
    at 2 KB/s through a small receive buffer takes a whole 480-token answer (longer than
    the send timeout), in fewer events than tokens, and the server counts it finished."""
    from slow_client import Pace, post_stream, read, sse_done

    url = await make_server(send_timeout_seconds=2)
    metrics = make_server.apps[url].state.services.metrics
    port = int(url.rsplit(":", 1)[1])
    t0 = time.perf_counter()
    got = await read(await post_stream(port, json.loads(BODY)), Pace(2048), sse_done, 120)
    took = time.perf_counter() - t0
    events = got.sse_events()
    tokens = [e for e in events if e.get("finished") is False]
    final = events[-1] if events else {}
    print(f"\nRESULT real engine, reader at 2 KB/s: {len(tokens)} events for "
          f"{MAX_TOKENS} tokens ({len(tokens) / MAX_TOKENS:.3f} per token) in {took:.1f} s")  # fmt: skip
    assert got.error is None and final.get("finish_reason") == "length", (got.error, events[-2:])
    assert final["usage"]["completion_tokens"] == MAX_TOKENS
    assert metrics.disconnects.labels("sse", "tiny")._value.get() == 0
    assert metrics.stream_errors.labels("sse", "tiny")._value.get() == 0
    assert len(tokens) < MAX_TOKENS / 2 and took > 2, (len(tokens), took)
