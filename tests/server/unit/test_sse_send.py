"""SSEResponse's send path: direct sends, the per-response watchdog that enforces the
send timeout (a send pending that long ends the response and runs the cleanup), the
app-wide heartbeat, and the disconnect listener."""

from __future__ import annotations

import asyncio

import pytest
from sluice_server.transport.sse import Heartbeat, SendTimeoutError, SSEResponse
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


def client(stall_after: int | None = None, delay: float = 0.0, disconnect_at: float | None = None):
    """ASGI send/receive: records bodies; the send of body number `stall_after` (1-based,
    pings included) never returns; `receive` reports a disconnect after `disconnect_at` s."""
    got: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body":
            if stall_after is not None and len(got) + 1 >= stall_after:
                await asyncio.Event().wait()
            if delay:
                await asyncio.sleep(delay)
            got.append(message["body"])

    async def receive():
        if disconnect_at is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_at)
        return {"type": "http.disconnect"}

    return got, send, receive


def response(body: Body, cleaned: list, **kw) -> SSEResponse:
    return SSEResponse(body.gen(), lambda: cleaned.append(True), **kw)


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
    got, send, receive = client()
    resp = response(body, cleaned, send_timeout=5, ping=0)
    await resp(SCOPE, receive, send)
    assert got[:-1] == [f"data: {i}\n\n".encode() for i in range(200)] and got[-1] == b""
    assert cleaned == [True] and resp.watchdog._timer is None and not resp.watchdog._pending


@virtual_time
async def test_timeout_is_per_send_not_per_stream():
    """Each send takes 0.4 of the timeout; the stream as a whole takes several timeouts."""
    body, cleaned = Body(8), []
    got, send, receive = client(delay=0.08)
    await response(body, cleaned, send_timeout=0.2, ping=0)(SCOPE, receive, send)
    assert len(got) == 9 and cleaned == [True]


@virtual_time
async def test_stalled_send_is_cut_off_after_the_timeout():
    body, cleaned = Body(10_000, gap=0.001), []
    got, send, receive = client(stall_after=5)
    resp = response(body, cleaned, send_timeout=0.3, ping=0)
    t0 = now()
    with pytest.raises(SendTimeoutError):
        await asyncio.wait_for(resp(SCOPE, receive, send), 5)
    took = now() - t0
    assert len(got) == 4 and body.closed and cleaned == [True]
    assert 0.3 <= took < 1.5, took
    assert resp.watchdog._timer is None and not resp.watchdog._pending
    assert asyncio.current_task().cancelling() == 0


@virtual_time
async def test_stalled_ping_on_an_idle_stream_is_cut_off():
    """No data for a while, the heartbeat's send stalls: the watchdog covers it too."""
    body, cleaned = Body(2, gap=10), []
    got, send, receive = client(stall_after=1)
    resp = response(body, cleaned, send_timeout=0.2, ping=0.05)
    t0 = now()
    with pytest.raises(SendTimeoutError):
        await asyncio.wait_for(resp(SCOPE, receive, send), 5)
    assert now() - t0 < 1.5 and cleaned == [True]


@virtual_time
async def test_disconnect_during_a_pending_send_is_not_a_timeout():
    body, cleaned = Body(100), []
    got, send, receive = client(stall_after=3, disconnect_at=0.05)
    resp = response(body, cleaned, send_timeout=0.5, ping=0)
    await asyncio.wait_for(resp(SCOPE, receive, send), 5)  # ends quietly
    assert cleaned == [True] and body.closed and resp.watchdog._expired is None
    await asyncio.sleep(0.6)  # the watchdog is gone: nothing fires later
    assert resp.watchdog._timer is None


@virtual_time
async def test_without_send_timeout_no_watchdog():
    body, cleaned = Body(3), []
    got, send, receive = client()
    resp = response(body, cleaned, ping=0)
    await resp(SCOPE, receive, send)
    assert len(got) == 4 and resp.watchdog._timer is None and cleaned == [True]


@virtual_time
async def test_watchdog_is_idle_while_sends_complete():
    """One timer per response, re-armed about once per timeout, not once per event."""
    body, cleaned = Body(300, gap=0.001), []
    got, send, receive = client()
    resp = response(body, cleaned, send_timeout=0.1, ping=0)
    checks = []
    orig = resp.watchdog._check

    def counting():
        checks.append(1)
        orig()

    resp.watchdog._check = counting
    t0 = now()
    await resp(SCOPE, receive, send)
    elapsed = now() - t0
    assert len(got) == 301
    assert len(checks) <= elapsed / 0.1 * 2 + 2, (len(checks), elapsed)


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
    assert cleaned == [True]


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
    assert cleaned == [True] and body.closed
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
    assert cleaned == [True] and body.closed
