"""A WebSocket reader that stops reading: the send timeout ends its streams and frees the
engine (the app over the simulator engine, driven through ASGI with a send() that stalls
the way a full socket does; no socket, so the stall is exact)."""

from __future__ import annotations

import asyncio
import json

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


async def run_socket(
    send_timeout: float, stall_after: int | None, streams: int = 2, max_tokens: int = 100_000
):
    """Open /ws/stream, start `streams` generations, stall after `stall_after` frames; the
    client leaves once every stream finished or the server closed the socket.
    Returns (frames sent, close message or None, seconds, engine requests left)."""
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=2, jitter=0)
    settings = Settings(model="sim", engine="simulator", send_timeout_seconds=send_timeout)
    app = build_app(settings, engine)
    inbox = [{"type": "websocket.connect"}] + [
        {"type": "websocket.receive",
         "text": json.dumps({"id": str(i), "prompt": "x", "params": {"max_tokens": max_tokens}})}
        for i in range(streams)
    ]  # fmt: skip
    sent: list[dict] = []
    closed = asyncio.Event()

    async def receive():
        if inbox:
            return inbox.pop(0)
        await closed.wait()
        return {"type": "websocket.disconnect", "code": 1008}

    async def send(message):
        if message["type"] == "websocket.close":
            sent.append(message)
            closed.set()
            return
        if message["type"] == "websocket.send" and stall_after is not None:
            if len([m for m in sent if m["type"] == "websocket.send"]) >= stall_after:
                await asyncio.Event().wait()  # the socket buffer is full: never drains
        sent.append(message)
        finals = [m for m in sent if '"finished": true' in (m.get("text") or "")]
        if len(finals) == streams:
            closed.set()

    async with app.router.lifespan_context(app):
        t0 = now()
        await asyncio.wait_for(app(SCOPE, receive, send), 10)
        took = now() - t0
        await asyncio.sleep(0.05)
        in_flight = engine.num_unfinished_requests()
    await engine.shutdown()
    frames = [m for m in sent if m["type"] == "websocket.send"]
    close = next((m for m in sent if m["type"] == "websocket.close"), None)
    return frames, close, took, in_flight


@virtual_time
async def test_stalled_reader_is_cut_off_and_the_engine_freed():
    frames, close, took, in_flight = await run_socket(send_timeout=0.3, stall_after=20)
    assert len(frames) == 20
    assert close is not None and close["code"] == 1008, close
    assert 0.3 <= took < 2.0, took
    assert in_flight == 0  # both generations aborted


@virtual_time
async def test_reader_that_keeps_up_is_not_cut_off():
    """Negative control: without the stall, two streams of 400 tokens (about 0.8 s, several
    send timeouts long) finish normally; the watchdog re-arms and never closes the socket."""
    frames, close, took, in_flight = await run_socket(
        send_timeout=0.3, stall_after=None, max_tokens=400
    )
    finals = [json.loads(m["text"]) for m in frames if '"finished": true' in m["text"]]
    assert [f["finish_reason"] for f in finals] == ["length", "length"]
    assert close is None and took > 0.6 and in_flight == 0
