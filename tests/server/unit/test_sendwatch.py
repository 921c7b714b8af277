"""The send watchdog judges a reader by progress (transport/sendwatch.py): bytes waiting
and none moving for the send timeout cuts the reader off; bytes that keep moving, however
slowly, never do; nothing waiting is never a stall. On a connection as uvicorn and the
kernel show it (fake_connection.py), on virtual time (testkit.clock): the checks fire
exactly when they ask to, so the cut-off window is asserted exactly."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fake_connection import FakeConnection
from sluice_server.transport import sendwatch
from sluice_server.transport.sendwatch import CHECKS, UNSENT_BYTES, SendWatchdog, transport_of
from testkit.clock import virtual_time
from testkit.wait import eventually_async

TIMEOUT = 1.0
EVENT = {"type": "http.response.body", "body": b"x" * 100, "more_body": True}
PROGRESS = pytest.mark.parametrize("tcp", [True, False], ids=["tcp-info", "buffer-only"])


def now() -> float:
    return asyncio.get_running_loop().time()


async def run_until_cut(conn: FakeConnection, limit: float) -> float:
    """Loop time once the watchdog has cut the connection (seen to 1/100 of the timeout);
    AssertionError if it has not within `limit` seconds."""
    await eventually_async(lambda: conn.lost, timeout=limit, interval=TIMEOUT / 100,
                           message="the watchdog to cut the connection")  # fmt: skip
    return now()


@PROGRESS
@virtual_time
async def test_a_reader_that_stops_is_cut_after_the_timeout_and_not_long_after(tcp):
    conn = FakeConnection(tcp=tcp)
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    await w.send(conn.send, EVENT)  # the kernel took nothing: 100 bytes wait, then never move
    stopped = now()
    cut = await run_until_cut(conn, 10 * TIMEOUT)
    assert conn.lost and w.stalled
    assert TIMEOUT <= cut - stopped <= TIMEOUT * (1 + 2 / CHECKS) + 1e-6, cut - stopped
    if tcp:  # reset, so the kernel drops what the reader never took
        assert conn.transport.socket.options[(socket.SOL_SOCKET, socket.SO_LINGER)] == (
            sendwatch._RESET
        )
    w.stop()


@PROGRESS
@virtual_time
async def test_a_slow_reader_that_keeps_moving_is_never_cut(tcp):
    """One byte taken every 0.9 timeouts, for 20 timeouts, with bytes waiting all along."""
    conn = FakeConnection(tcp=tcp)
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    await w.send(conn.send, EVENT)
    for _ in range(22):
        await asyncio.sleep(0.9 * TIMEOUT)
        conn.read(1)
    assert not conn.lost and not w.stalled and conn.buffered > 0
    w.stop()


@virtual_time
async def test_sends_that_complete_after_each_drain_are_progress_without_tcp_info():
    """Without TCP_INFO: the buffer drained and the next event refilled it (larger) between
    two checks; that is progress, not a stall."""
    conn = FakeConnection(tcp=False)
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    size = 100
    for _ in range(30):
        await w.send(conn.send, {**EVENT, "body": b"x" * size})
        await asyncio.sleep(0.6 * TIMEOUT)
        conn.read(conn.buffered)  # drained at once...
        size += 50  # ...and the next event is larger
    assert not conn.lost and not w.stalled
    w.stop()


@PROGRESS
@virtual_time
async def test_nothing_waiting_is_never_a_stall(tcp):
    """Everything was taken (or nothing was sent): however long the stream is idle."""
    conn = FakeConnection(tcp=tcp)
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    await w.send(conn.send, EVENT)
    conn.read(100)
    await asyncio.sleep(20 * TIMEOUT)
    assert not conn.lost and not w.stalled
    w.stop()


@virtual_time
async def test_a_check_that_runs_late_judges_nothing():
    """The process itself did not run (a blocked loop): no reader is cut for that; a reader
    that really stopped is cut one timeout after the server runs again."""
    loop = asyncio.get_running_loop()
    conn = FakeConnection()
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    await w.send(conn.send, EVENT)
    await asyncio.sleep(TIMEOUT / 2)
    loop.advance(5 * TIMEOUT)  # the loop was blocked for five timeouts
    await asyncio.sleep(0)
    back = now()
    assert not conn.lost
    cut = await run_until_cut(conn, 10 * TIMEOUT)
    assert conn.lost and TIMEOUT <= cut - back <= TIMEOUT * (1 + 2 / CHECKS) + 1e-6
    w.stop()


@virtual_time
async def test_transport_pauses_at_the_first_byte_while_streaming_then_as_before():
    """`high=0` while a stream is on the connection (coalescing starts as soon as anything
    waits), the kernel's unsent bytes bounded, both undone for a kept-alive connection."""
    conn = FakeConnection()
    w = SendWatchdog(TIMEOUT)
    w.start(conn.transport)
    assert conn.transport.get_write_buffer_limits() == (0, 0)
    lowat = (socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
    assert conn.transport.socket.options[lowat] == UNSENT_BYTES
    send = asyncio.create_task(w.send(conn.send, EVENT))
    await asyncio.sleep(0)
    assert send.done()  # nothing waited: the send went through
    second = asyncio.create_task(w.send(conn.send, EVENT))
    await asyncio.sleep(TIMEOUT / 10)
    assert not second.done()  # 100 bytes wait in the transport: the next send waits
    conn.read(100)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert second.done() and w.sends == 2
    conn.read(100)
    w.stop()
    assert conn.transport.get_write_buffer_limits() == (16384, 65536)
    assert conn.transport.socket.options[lowat] == 0


@virtual_time
async def test_one_timer_per_connection_whatever_the_number_of_sends(monkeypatch):
    """No timeout scope and no timer per send: the checks are the same for 3 sends and for
    3,000 over the same time."""

    def boom(*a, **k):
        raise AssertionError("per-send timeout scope used")

    monkeypatch.setattr(asyncio, "timeout", boom)
    monkeypatch.setattr(asyncio, "wait_for", boom)

    counted: list[SendWatchdog] = []
    check = SendWatchdog._check

    def counting(self: SendWatchdog) -> None:
        counted.append(self)
        check(self)

    monkeypatch.setattr(SendWatchdog, "_check", counting)

    async def checks(sends: int) -> int:
        conn = FakeConnection()
        w = SendWatchdog(TIMEOUT)
        w.start(conn.transport)
        for _ in range(sends):
            await w.send(conn.send, EVENT)
            conn.read(100)
            await asyncio.sleep(5 * TIMEOUT / sends)
        w.stop()
        return counted.count(w)

    few, many = await checks(3), await checks(3000)
    assert few == many and CHECKS * 5 - 1 <= many <= CHECKS * 5 + 1, (few, many)


@virtual_time
async def test_without_a_timeout_or_a_transport_no_timer():
    conn = FakeConnection()
    w = SendWatchdog(None)
    w.start(conn.transport)
    assert w._timer is None and conn.transport.get_write_buffer_limits() == (0, 0)
    w.stop()
    w = SendWatchdog(TIMEOUT)
    w.start(None)  # an ASGI server that shows no transport
    assert w._timer is None
    await w.send(conn.send, EVENT)
    assert w.sends == 1
    w.stop()


@virtual_time
async def test_a_closed_transport_is_a_client_gone_not_an_error():
    """The client left before the response started: uvloop's transport is closed and its
    socket has no file descriptor. `start` says so (False) without touching the socket, arms
    nothing, and `stop` has nothing to undo."""
    conn = FakeConnection()
    conn.lose(told=False)
    w = SendWatchdog(TIMEOUT)
    assert w.start(conn.transport) is False
    assert w._timer is None and w._transport is None and not w.stalled
    w.stop()
    assert SendWatchdog(TIMEOUT).start(FakeConnection().transport) is True


def test_transport_of_finds_what_uvicorn_keeps_on_the_receive_callable():
    conn = FakeConnection()
    assert transport_of(conn.receive) is conn.transport

    async def receive():  # a plain function: no connection behind it
        return {}

    class NoTransport:
        transport = object()  # lacks the asyncio calls the watchdog needs

        async def receive(self):
            return {}

    assert transport_of(receive) is None and transport_of(NoTransport().receive) is None
