"""SSEResponse's send path: direct sends, the per-response watchdog on the connection's
transport (a reader that takes no bytes for the send timeout is cut off: the response ends
quietly and the cleanup learns it stalled; one that keeps taking bytes never is), the
app-wide heartbeat, and the disconnect listener."""

from __future__ import annotations

import asyncio

import pytest
from fake_connection import FakeConnection
from sluice_server.transport.sse import Heartbeat, SSEResponse
from testkit.clock import virtual_time

# Every test runs on a virtual clock (testkit.clock): the timers under test (send timeout,
# heartbeat, simulator pacing) fire exactly when they ask to, however busy the machine is.


def now() -> float:
    return asyncio.get_running_loop().time()


SCOPE = {"type": "http", "method": "GET", "path": "/", "headers": []}


class Body:
    """Async generator of n events that records whether it was closed."""

    def __init__(self, n: int, gap: float = 0.0) -> None:
        self.n, self.gap, self.closed = n, gap, False

    async def gen(self):
        try:
            for i in range(self.n):
                if self.gap:
                    await asyncio.sleep(self.gap)
                yield f"data: {i}\n\n".encode()
        finally:
            self.closed = True


def client(stall_after: int | None = None, disconnect_at: float | None = None):
    """ASGI send/receive: records bodies; the send of body number `stall_after` (1-based,
    pings included) never returns; `receive` reports a disconnect after `disconnect_at` s."""
    got: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body":
            if stall_after is not None and len(got) + 1 >= stall_after:
                await asyncio.Event().wait()
            got.append(message["body"])

    async def receive():
        if disconnect_at is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_at)
        return {"type": "http.disconnect"}

    return got, send, receive


def response(body: Body, cleaned: list, **kw) -> SSEResponse:
    """`cleaned` gets the cleanup's `stalled` argument."""
    return SSEResponse(body.gen(), cleaned.append, **kw)


def on(conn: FakeConnection) -> dict:
    """A request scope on `conn`: its transport, as the edge middleware puts it there."""
    return {**SCOPE, "sluice.transport": conn.transport}


@pytest.fixture
def no_cancel_scopes(monkeypatch):
    """Fail if a send goes through a per-send timeout scope."""

    def boom(*a, **k):
        raise AssertionError("per-send timeout scope used")

    monkeypatch.setattr(asyncio, "timeout", boom)
    monkeypatch.setattr(asyncio, "wait_for", boom)


@virtual_time
async def test_sends_directly_and_delivers_everything(no_cancel_scopes):
    body, cleaned = Body(200), []
    conn = FakeConnection(fast=True)
    resp = response(body, cleaned, send_timeout=5, ping=0)
    await resp(on(conn), conn.receive, conn.send)
    got = [m["body"] for m in conn.sent if m["type"] == "http.response.body"]
    assert got[:-1] == [f"data: {i}\n\n".encode() for i in range(200)] and got[-1] == b""
    assert cleaned == [False] and resp.watchdog._timer is None and resp.watchdog.sends == 202


@virtual_time
async def test_a_slow_reader_that_keeps_taking_bytes_is_never_cut():
    """50 bytes/s, so every event waits for the one before it to drain, and the stream
    lasts many send timeouts: it is delivered whole."""
    body, cleaned = Body(40, gap=0.01), []
    conn = FakeConnection()
    reader = conn.reader(rate=50)
    t0 = now()
    await asyncio.wait_for(response(body, cleaned, send_timeout=0.2, ping=0)(
        on(conn), conn.receive, conn.send), 60)  # fmt: skip
    reader.cancel()
    bodies = [m["body"] for m in conn.sent if m["type"] == "http.response.body"]
    assert b"".join(bodies) == b"".join(f"data: {i}\n\n".encode() for i in range(40))
    assert now() - t0 > 10 * 0.2 and cleaned == [False] and not conn.lost


@virtual_time
async def test_a_reader_that_stops_is_cut_off_and_the_response_ends_quietly():
    """The reader stops after 30 bytes: one send timeout later the connection is reset, the
    response returns (nothing for the server to log), the body is closed and the cleanup
    is told the reader stalled."""
    body, cleaned = Body(10_000, gap=0.001), []
    conn = FakeConnection()
    resp = response(body, cleaned, send_timeout=0.3, ping=0)
    task = asyncio.create_task(resp(on(conn), conn.receive, conn.send))
    await asyncio.sleep(0.01)
    conn.read(30)
    stopped = now()
    await asyncio.wait_for(task, 5)  # no exception
    took = now() - stopped
    assert conn.lost and resp.watchdog.stalled and body.closed and cleaned == [True]
    assert 0.3 <= took <= 0.3 * 1.25 + 0.01, took
    assert resp.watchdog._timer is None
    assert asyncio.current_task().cancelling() == 0


@virtual_time
async def test_a_stalled_ping_on_an_idle_stream_is_cut_off():
    """No data for a while, the heartbeat's comments pile up unread: the watchdog covers
    them too."""
    body, cleaned = Body(2, gap=10), []
    conn = FakeConnection()
    t0 = now()
    await asyncio.wait_for(response(body, cleaned, send_timeout=0.2, ping=0.05)(
        on(conn), conn.receive, conn.send), 5)  # fmt: skip
    assert conn.lost and now() - t0 < 1.5 and cleaned == [True]


@virtual_time
async def test_disconnect_during_a_pending_send_is_not_a_stall():
    body, cleaned = Body(100), []
    conn = FakeConnection()
    resp = response(body, cleaned, send_timeout=0.5, ping=0)
    task = asyncio.create_task(resp(on(conn), conn.receive, conn.send))
    await asyncio.sleep(0.05)
    conn.lose()  # the client went away while a send waited
    await asyncio.wait_for(task, 5)  # ends quietly
    assert cleaned == [False] and body.closed and not resp.watchdog.stalled
    await asyncio.sleep(0.6)  # the watchdog is gone: nothing fires later
    assert resp.watchdog._timer is None


@virtual_time
async def test_without_send_timeout_no_watchdog():
    body, cleaned = Body(3), []
    got, send, receive = client()
    resp = response(body, cleaned, ping=0)
    await resp(SCOPE, receive, send)
    assert len(got) == 4 and resp.watchdog._timer is None and cleaned == [False]


def timed_client():
    """ASGI send that records (loop time, body) for every body message."""
    got: list[tuple[float, bytes]] = []
    loop = asyncio.get_running_loop()

    async def send(message):
        if message["type"] == "http.response.body":
            got.append((loop.time(), message["body"]))

    async def receive():
        await asyncio.Event().wait()

    return got, send, receive


@virtual_time
async def test_idle_stream_gets_heartbeats_no_gap_longer_than_the_interval():
    """A long 'prefill' (0.5 s before the first event): comments at most one interval apart."""
    body, cleaned = Body(3, gap=0.5), []
    got, send, receive = timed_client()
    t0 = asyncio.get_running_loop().time()
    await response(body, cleaned, ping=0.05)(SCOPE, receive, send)
    pings = [t for t, b in got if b.startswith(b":")]
    assert len(pings) >= 8, got
    times = [t0] + [t for t, _ in got]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < 0.05 * 1.8, max(gaps)  # timer slack on a busy machine
    assert cleaned == [False]


@virtual_time
async def test_busy_stream_gets_no_heartbeats():
    body, cleaned = Body(100, gap=0.005), []
    got, send, receive = timed_client()
    await response(body, cleaned, ping=0.05)(SCOPE, receive, send)
    assert not [b for _, b in got if b.startswith(b":")]
    assert len(got) == 101


@virtual_time
async def test_one_timer_for_all_responses_and_none_when_idle():
    loop = asyncio.get_running_loop()
    bodies = [Body(2, gap=0.2) for _ in range(50)]
    cleaned: list = []
    clients = [timed_client() for _ in bodies]
    tasks = [
        asyncio.create_task(response(b, cleaned, ping=0.04)(SCOPE, r, s))
        for b, (_, s, r) in zip(bodies, clients, strict=True)
    ]
    await asyncio.sleep(0.1)
    beat = Heartbeat.on(loop, 0.04)
    assert len(beat.responses) == 50 and beat._timer is not None
    await asyncio.gather(*tasks)
    assert not beat.responses and beat._timer is None  # stopped with the last response
    assert all(any(b.startswith(b":") for _, b in got) for got, _, _ in clients)


@virtual_time
async def test_stalled_client_does_not_hold_other_streams_heartbeats():
    stalled_body, idle_body, cleaned = Body(2, gap=10), Body(2, gap=0.4), []
    _, stalled_send, stalled_receive = client(stall_after=1)
    got, send, receive = timed_client()
    stalled = asyncio.create_task(
        response(stalled_body, cleaned, ping=0.05, send_timeout=5)(
            SCOPE, stalled_receive, stalled_send
        )
    )
    await response(idle_body, cleaned, ping=0.05)(SCOPE, receive, send)
    assert len([b for _, b in got if b.startswith(b":")]) >= 5
    stalled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stalled


@virtual_time
async def test_disconnect_while_waiting_for_the_first_event_ends_at_once():
    """The client leaves during a long prefill: the body is closed and the cleanup (engine
    abort) runs right away, not when the first token would have been sent."""
    body, cleaned = Body(2, gap=30), []
    got, send, receive = client(disconnect_at=0.1)
    t0 = now()
    await asyncio.wait_for(response(body, cleaned, ping=0.05)(SCOPE, receive, send), 5)
    assert now() - t0 < 1.0
    assert cleaned == [False] and body.closed
    assert asyncio.current_task().cancelling() == 0


@virtual_time
async def test_outside_cancel_still_propagates():
    """Server shutdown cancels the request task: not swallowed as a disconnect."""
    body, cleaned = Body(2, gap=30), []
    got, send, receive = client()
    task = asyncio.create_task(response(body, cleaned, ping=0.05)(SCOPE, receive, send))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [False] and body.closed
