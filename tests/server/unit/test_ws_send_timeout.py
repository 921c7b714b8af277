"""A WebSocket reader that stops reading: the send watchdog cuts the socket off, which ends
its streams (each recorded as `stalled`) and frees the engine; a reader that keeps taking
bytes, however slowly, is never cut. The app over the simulator engine, driven through ASGI
on a connection as uvicorn and the kernel show it (fake_connection.py; no socket, so the
stall is exact)."""

from __future__ import annotations

import asyncio
import json

from fake_connection import FakeConnection
from sluice_server.app import build_app
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings
from testkit.clock import virtual_time

# Every test runs on a virtual clock (testkit.clock): the timers under test (send timeout,
# heartbeat, simulator pacing) fire exactly when they ask to, however busy the machine is.


def now() -> float:
    return asyncio.get_running_loop().time()


SCOPE = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1",
         "scheme": "ws", "path": "/ws/stream", "raw_path": b"/ws/stream", "query_string": b"",
         "root_path": "", "headers": [], "subprotocols": [], "client": ("127.0.0.1", 1),
         "server": ("127.0.0.1", 8000), "state": {},
         "extensions": {"websocket.http.response": {}}}  # fmt: skip


async def run_socket(send_timeout: float, rate: float | None, streams: int = 2,
                     max_tokens: int = 100_000):  # fmt: skip
    """Open /ws/stream, start `streams` generations; the reader takes `rate` bytes/s (None:
    stops after the first 200 bytes). The client leaves once every stream finished.
    Returns (frames, seconds, engine requests left, the connection, disconnects counted)."""
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=2, jitter=0)
    settings = Settings(model="sim", engine="simulator", send_timeout_seconds=send_timeout)
    app = build_app(settings, engine)
    inbox = [{"type": "websocket.connect"}] + [
        {"type": "websocket.receive",
         "text": json.dumps({"id": str(i), "prompt": "x", "params": {"max_tokens": max_tokens}})}
        for i in range(streams)
    ]  # fmt: skip
    conn = FakeConnection("websocket", inbox=inbox)
    reader = conn.reader(rate) if rate is not None else None

    async def leave_when_done() -> None:
        while not conn.lost:
            finals = [m for m in conn.sent if '"finished": true' in (m.get("text") or "")]
            if len(finals) == streams:
                conn.inbox.append({"type": "websocket.disconnect", "code": 1000})
                conn.lose()
                return
            if reader is None and conn.taken < 200:
                conn.read(200 - conn.taken)
            await asyncio.sleep(0.01)

    async with app.router.lifespan_context(app):
        t0 = now()
        leaving = asyncio.create_task(leave_when_done())
        await asyncio.wait_for(app(SCOPE, conn.receive, conn.send), 60)
        took = now() - t0
        leaving.cancel()
        if reader is not None:
            reader.cancel()
        await asyncio.sleep(0.05)
        in_flight = engine.num_unfinished_requests()
        metrics = app.state.services.metrics
        disconnects = metrics.disconnects.labels("websocket", "sim")._value.get()
    await engine.shutdown()
    frames = [m for m in conn.sent if m["type"] == "websocket.send"]
    return frames, took, in_flight, conn, disconnects


@virtual_time
async def test_stalled_reader_is_cut_off_and_the_engine_freed():
    frames, took, in_flight, conn, disconnects = await run_socket(send_timeout=0.3, rate=None)
    assert conn.lost and conn.taken == 200 and frames
    assert 0.3 <= took < 0.3 * 1.25 + 0.1, took
    assert in_flight == 0  # both generations aborted
    assert disconnects == 2  # each generation ended as a reader gone (`stalled`)


@virtual_time
async def test_reader_that_keeps_up_slowly_is_not_cut_off():
    """Negative control: a reader at 2 KB/s, two streams of 400 tokens (one token's frame
    is about 60 bytes, so frames wait for the reader; the streams last several send
    timeouts): both finish, coalesced, and the socket is never cut."""
    frames, took, in_flight, conn, disconnects = await run_socket(
        send_timeout=0.3, rate=2048, max_tokens=400
    )
    finals = [json.loads(m["text"]) for m in frames if '"finished": true' in m["text"]]
    assert [f["finish_reason"] for f in finals] == ["length", "length"]
    assert took > 3 * 0.3 and in_flight == 0 and disconnects == 0
    assert len(frames) < 2 * 400 / 2  # fewer frames than tokens: coalesced
