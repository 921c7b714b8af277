"""What clients normally do is an outcome, not an error: a reader cut off as stalled, a
client that disconnects (before the first token, mid-stream, by closing the socket or with
a WebSocket close frame), a refused WebSocket handshake. Each leaves one access-log line
with its outcome, and the server process's log holds no ERROR record and no traceback
(operators alert on those).

The server is a real process (`python -m sluice_server`, simulator engine, API keys, CORS,
a 1 s send timeout, its listening socket at a 64 KiB send buffer so a stalled reader is
felt soon); its whole output is read back.

A client whose connection is already closed when its stream would start (it left as a slot
freed for it, or before its response began) is the same outcome. No real client can time
that moment, so those cases call the app as uvicorn does, on connections as uvloop shows
them (fake_connection.py: a closed transport's socket has no file descriptor), and check
the slot: back, or handed to the next request waiting."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct

import pytest
from fake_connection import FakeConnection
from slow_client import Pace, Refused, SimServer, open_ws, post_stream, read
from sluice_server.app import build_app
from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = "sk-outcomes"
LONG = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
CHAT = {"model": "sim", "stream": True, "max_tokens": 4000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip


def ws_headers(origin: str | None = None, key: str = KEY) -> str:
    extra = f"Authorization: Bearer {key}\r\n"
    return extra + (f"Origin: {origin}\r\n" if origin else "")


async def post(port: int, path: str, body: dict):
    return await post_stream(port, body, path, headers=f"Authorization: Bearer {KEY}\r\n")


async def take(s, n: int) -> None:
    """Read `n` bytes, then leave the socket to the caller."""
    loop, got = asyncio.get_running_loop(), 0
    while got < n:
        chunk = await loop.sock_recv(s, n - got)
        assert chunk, "the server closed early"
        got += len(chunk)


def generate(rid: str) -> dict:
    return {"id": rid, "prompt": "hi", "params": {"max_tokens": 4000, "ignore_eos": True}}


def close_frame() -> bytes:
    mask = os.urandom(4)
    payload = struct.pack("!H", 1000)
    return b"\x88\x82" + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.mark.slow
async def test_client_behaviour_is_an_outcome_never_an_error(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    flags = ("--api-key-file", str(keys), "--send-timeout-seconds", "1", "--sim-ttft-ms", "200",
             "--sim-itl-ms", "5", "--heartbeat-seconds", "120",
             "--cors-allowed-origins", "https://app.example.com")  # fmt: skip
    loop = asyncio.get_running_loop()
    with SimServer(tmp_path, *flags, sndbuf=65536) as server:
        port, outcomes = server.port, []

        async def case(name: str, expected: str, run) -> None:
            """Run one client; once its access-log line is there, close what it left open."""
            left_open = await run()
            lines = await server.wait_access(len(outcomes) + 1)
            if left_open is not None:
                left_open.close()
            outcomes.append((name, expected, lines[-1]["outcome"], lines[-1]["status"]))

        def stalls(opening):
            async def run():
                s = await opening()
                await take(s, 2000)
                return s  # and reads no more

            return run

        def leaves(opening, first: int = 2000):
            async def run():
                s = await opening()
                await take(s, first)
                s.close()

            return run

        def sse():
            return post(port, "/v1/stream", LONG)

        def openai():
            return post(port, "/v1/chat/completions", CHAT)

        def ws(rid: str):
            return lambda: open_ws(port, [generate(rid)], headers=ws_headers())

        async def ws_sends_a_close_frame():
            s = await ws("c")()
            await take(s, 2000)
            await loop.sock_sendall(s, close_frame())
            got = await read(s, Pace(1 << 20), lambda d: False, limit_s=30)  # the server closes
            assert got.error in ("closed", "ConnectionResetError"), got.error

        def refused(origin: str | None, key: str, status: bytes):
            async def run():
                with pytest.raises(Refused) as answer:
                    await open_ws(port, [], headers=ws_headers(origin, key))
                assert answer.value.args[0].startswith(b"HTTP/1.1 " + status), answer.value

            return run

        await case("sse stalled", "stalled", stalls(sse))
        await case("websocket stalled", "stalled", stalls(ws("a")))
        await case("openai stalled", "stalled", stalls(openai))
        await case("sse left mid-stream", "disconnected", leaves(sse))
        # The first token comes after 200 ms; the client is gone before it.
        await case("sse left before the first token", "disconnected", leaves(sse, 0))
        await case("openai left mid-stream", "disconnected", leaves(openai))
        await case("websocket closed its socket", "disconnected", leaves(ws("b")))
        await case("websocket sent a close frame", "disconnected", ws_sends_a_close_frame)
        await case("websocket refused: bad key", "rejected", refused(None, "sk-wrong", b"401"))
        await case("websocket refused: origin", "rejected",
                   refused("https://evil.example", KEY, b"403"))  # fmt: skip
        problems = server.problems()
    print("\nRESULT " + "; ".join(f"{n}: {o} ({st})" for n, _, o, st in outcomes))
    assert problems == [], "\n".join(problems)
    assert [(n, o) for n, o, _, _ in outcomes] == [(n, e) for n, e, _, _ in outcomes], outcomes


class Logs(logging.Handler):
    """The access log's JSON lines, and every record at ERROR or above from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.errors.append(f"{record.name}: {record.getMessage()}")
        elif record.name == ACCESS_LOGGER:
            self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def logs():
    handler, root, access = Logs(), logging.getLogger(), logging.getLogger(ACCESS_LOGGER)
    levels = root.level, access.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    access.setLevel(logging.INFO)
    propagate, access.propagate = access.propagate, True
    yield handler
    root.removeHandler(handler)
    root.setLevel(levels[0])
    access.setLevel(levels[1])
    access.propagate = propagate


def in_process(**flags):
    """The app over a simulator engine (a token every 5 ms), one stream slot."""
    settings = Settings(model="sim", engine="simulator", host="127.0.0.1", port=1,
                        max_concurrent_streams=1, access_log_format="json",
                        log_level="warning", **flags)  # fmt: skip
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=5, ttft_per_stream_ms=0,
                             jitter=0)  # fmt: skip
    return build_app(settings, engine), engine


def request(app, conn: FakeConnection, path: str = "/v1/stream") -> asyncio.Task:
    """`POST path` with a long generation on `conn`, as uvicorn hands it to the app
    (`receive` and `send` are the connection's bound methods, so the app finds its
    transport)."""
    body = json.dumps(CHAT if path == "/v1/chat/completions" else LONG).encode()
    conn.inbox.append({"type": "http.request", "body": body, "more_body": False})
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80), "state": {}}  # fmt: skip
    return asyncio.create_task(app(scope, conn.receive, conn.send))


def streaming(conn: FakeConnection) -> bool:
    return any(m.get("body") for m in conn.sent)


async def test_a_slot_freed_as_a_queued_client_leaves_goes_to_the_next_one(logs):
    """Two clients close together: A, streaming in the one slot, and B, waiting in the queue
    for it; A's slot reaches B before the server told the app B left. B ends as a client
    that left (one access-log line, 499, no ERROR, nothing streamed to it) and the slot goes
    on to C, waiting behind it; at the end every slot is free again."""
    app, engine = in_process(queue_size=4, heartbeat_seconds=60)
    svc = app.state.services
    queue = svc.gate.queue
    slots_free = queue.slots - queue.t.held.value
    try:
        a = FakeConnection(fast=True)
        tasks = {"a": request(app, a)}
        await eventually_async(lambda: streaming(a), timeout=10, message="A streaming")
        b, c = FakeConnection(fast=True), FakeConnection(fast=True)
        tasks["b"] = request(app, b)
        await eventually_async(lambda: queue.depth == 1, timeout=10, message="B queued")
        tasks["c"] = request(app, c)
        await eventually_async(lambda: queue.depth == 2, timeout=10, message="C queued")
        b.lose(told=False)  # B is gone; uvicorn has not said so to the app yet
        a.lose()  # A leaves too: its slot is freed, for B first
        await asyncio.wait_for(asyncio.gather(tasks["a"], tasks["b"]), 10)  # B: no exception
        await eventually_async(lambda: streaming(c), timeout=10, message="C streaming")
        assert (queue.depth, queue.t.held.value) == (0, 1)  # C holds the slot
        assert not b.sent, b.sent  # nothing was sent to the client that left
        c.lose()
        await asyncio.wait_for(tasks["c"], 10)
        assert queue.slots - queue.t.held.value == slots_free and svc.gate.active == 0
        lines = await eventually_async(lambda: len(logs.lines) == 3 and logs.lines,
                                       timeout=10, message="three access-log lines")  # fmt: skip
        ends = sorted((x["status"], x["outcome"]) for x in lines)
        assert ends == [(200, "disconnected")] * 2 + [(499, "disconnected")], lines
        assert logs.errors == []
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/chat/completions"])
async def test_a_client_gone_before_its_stream_starts_is_a_disconnect(logs, path):
    """The connection is closed when the response would start (no queue: the slot was free
    at once): nothing is sent, one access-log line (499, disconnected), no ERROR, and the
    slot and the active-streams gauge are back for the next request."""
    app, engine = in_process()
    svc = app.state.services
    try:
        gone = FakeConnection(fast=True)
        gone.lose(told=False)
        await asyncio.wait_for(request(app, gone, path), 10)
        assert not gone.sent and svc.gate.active == 0
        active = svc.metrics.active.labels("sse" if path == "/v1/stream" else "openai", "sim")
        assert active._value.get() == 0
        assert [(x["status"], x["outcome"]) for x in logs.lines] == [(499, "disconnected")]
        nxt = FakeConnection(fast=True)
        task = request(app, nxt, path)
        await eventually_async(lambda: streaming(nxt), timeout=10, message="the slot reused")
        nxt.lose()
        await asyncio.wait_for(task, 10)
        assert logs.errors == []
    finally:
        await engine.shutdown()
