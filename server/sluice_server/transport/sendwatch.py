"""The send timeout and early coalescing: one watchdog per connection that watches the
connection's transport, not the app's sends.

What a slow reader looks like from the server. ASGI shows the app only `await send(...)`,
and under uvicorn a send waits only while the transport is paused: once the transport's
own buffer (64 KiB by default) is full, and then until it drained to a quarter. Below it,
the kernel's socket buffer (megabytes once autotuned) absorbs more. Judged by sends, a
steady reader at 4 KB/s looks stalled (a send pending for 12 s while the transport drains
48 KiB at its pace), and coalescing (core/streaming/stream.py: the consumer takes everything
buffered at once) starts only after tens of kilobytes of one-token events are queued in
front of the reader. A watchdog re-armed by completed sends has the same blind spot, and
ASGI has no extension that shows a connection's progress; the transport does.

So the watchdog looks at the connection, through public asyncio calls on the transport and
two socket options:
- `set_write_buffer_limits(high=0)`: the transport pauses as soon as anything waits in it,
  so uvicorn's next send waits until it drained; meanwhile the engine's output piles up in
  the stream's buffer and goes out as one event. Coalescing starts when the transport
  backs up, and the process holds at most one event in front of a slow reader;
- `TCP_NOTSENT_LOWAT` (`UNSENT_BYTES`): the kernel holds at most that much not yet sent,
  so the backlog comes back to the process instead of waiting, uncoalesced, in the
  kernel's buffer (bytes in flight are not limited, so neither is throughput);
- progress: `TCP_INFO`'s count of bytes the reader's TCP stack acknowledged, read on each
  check while something waits in the transport. Without it (not TCP, not Linux): the
  transport's buffer shrinking, or a send completing (at `high=0`, one only completes
  once the buffer drained).
A reader is cut off when bytes waited and none moved for `timeout` seconds: the watchdog
resets the connection (SO_LINGER 0, so the kernel drops what the reader never took) and
aborts the transport. The server sees the connection lost, as for a client that left:
pending sends return (HTTP) or raise a disconnect (WebSocket), the response ends quietly
(no exception escapes the app, so uvicorn logs no error), and the owner reads `stalled` to
record the outcome. Two things here are uvicorn's, not ASGI's: the connection's transport
is found from the `receive` callable (`transport_of`), and a send waits while the
transport is paused. Both are pinned with uvicorn in server/pyproject.toml and checked by
tests/server/unit/test_uvicorn_contract.py.

Measured (tests/server/test_slow_readers.py: 3,000 tokens at 500 tokens/s, readers with a
receive buffer of about 2 KiB): SSE readers at 64, 16, 4, 2 and 1 KB/s all finish, with
about 0.55-0.65, 0.21, 0.035, 0.015 and 0.013 events per token (WebSocket at 4 and 1 KB/s:
0.08 and 0.03); a reader that stops is cut 10-12.5 s later. Judged by sends instead, with
uvicorn's default transport buffer and a 64 KiB kernel send buffer, the 4 KB/s reader is
cut after about 900 events.

Cost. Each send reads the loop's clock (for the heartbeat's idle check) and counts itself:
no timeout scope, no timer and no task lookup per send (a cancel scope per send was about
a third of the server's CPU under SSE fan-out: docs/benchmarks.md, "How the server spends
memory and CPU"). One timer per connection checks every `timeout / CHECKS` seconds; a check is two method calls while
nothing waits in the transport, plus one `getsockopt` while something does. A check that
runs late (the process itself did not run) judges nothing: a reader is never cut for the
server's own stall. So a reader is cut between `timeout` and `timeout * (1 + 2 / CHECKS)`
after its last byte moved, and never while bytes move at least once per `timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

CHECKS = 8  # checks per timeout
UNSENT_BYTES = 4096  # TCP_NOTSENT_LOWAT while a stream is on the connection
_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_ACKED = struct.Struct("=Q")  # struct tcp_info.tcpi_bytes_acked (Linux >= 4.1)
_ACKED_AT = 120
_INFO_LEN = _ACKED_AT + _ACKED.size
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset
_REQUIRED = ("get_write_buffer_size", "set_write_buffer_limits", "abort", "is_closing")
_warned = False


def transport_of(receive: Callable[..., Any]) -> Any | None:
    """The connection's transport, from the `receive` callable the ASGI server passed to
    the app, or None. uvicorn's is a bound method of the object that owns the connection
    (its HTTP request cycle, or its WebSocket protocol), which keeps the transport as
    `.transport`: true of each of its HTTP and WebSocket implementations."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is None or not all(hasattr(transport, name) for name in _REQUIRED):
        return None
    return transport


class SendWatchdog:
    """One per connection. `start(transport)` (None: an ASGI server that shows no transport;
    then no send timeout and no early coalescing), `send(...)` for every message, `stop()`
    when the response or socket is done; `stalled` is True once it cut the reader off."""

    __slots__ = ("timeout", "stalled", "last_send", "sends", "_transport", "_time", "_timer",
                 "_loop", "_limit", "_interval", "_checked_at", "_moved_at", "_acked",
                 "_seen", "_sock", "_tcp", "_restore")  # fmt: skip

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.stalled = False
        self.last_send = 0.0  # loop time the last send started (the heartbeat's idle check)
        self.sends = 0  # sends completed
        self._transport: Any | None = None
        self._time: Callable[[], float] = _not_started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._limit = self._interval = 0.0
        self._checked_at = self._moved_at = 0.0
        self._acked: int | None = None  # bytes acknowledged at the last check (TCP)
        self._seen = (0, 0)  # sends and buffered bytes at the last check (without TCP_INFO)
        self._sock: Any | None = None  # the connection's socket
        self._tcp = False  # TCP_INFO can be read from it
        self._restore: Callable[[], None] | None = None

    def start(self, transport: Any | None) -> bool:
        """Arm on the running loop for `transport` (see the module docstring). False when
        the transport is already closed: the client left before anything was sent (its
        socket is gone too: uvloop's stand-in for it then has no file descriptor), so
        nothing is armed and the caller ends as for a client that left."""
        global _warned
        self._loop = loop = asyncio.get_running_loop()
        self._time = loop.time
        self.last_send = now = loop.time()
        if transport is None:
            if self.timeout is not None and not _warned:
                _warned = True
                log.warning(
                    "the ASGI server shows no transport: slow readers are neither "
                    "coalesced early nor cut off by the send timeout"
                )
            return True
        if transport.is_closing():
            return False
        self._transport = transport
        self._shape(transport)
        if self.timeout is not None:
            self._limit = self.timeout - 1e-9  # a check due exactly then judges it reached
            self._interval = self.timeout / CHECKS
            self._checked_at = self._moved_at = now
            self._timer = loop.call_at(now + self._interval, self._check)
        return True

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        restore, self._restore = self._restore, None
        if restore is not None and self._transport is not None:
            if not self._transport.is_closing():  # kept alive: the next request as before
                restore()
        self._transport = self._sock = None

    async def send(self, send: Callable[[Any], Awaitable[None]], message: Any) -> None:
        """`await send(message)`, counted."""
        self.last_send = self._time()
        await send(message)
        self.sends += 1

    def _shape(self, transport: Any) -> None:
        """Pause the transport at the first byte it holds, bound the kernel's unsent bytes,
        and find the socket to read progress from; remember how to undo the first two."""
        limits = None
        try:
            limits = transport.get_write_buffer_limits()
            transport.set_write_buffer_limits(high=0)
        except (AttributeError, NotImplementedError, RuntimeError):
            limits = None
        sock = transport.get_extra_info("socket")
        lowat = None
        if sock is not None and _NOTSENT_LOWAT is not None:
            try:
                lowat = sock.getsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT)
                sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, UNSENT_BYTES)
            except (OSError, AttributeError):
                lowat = None
        self._sock = sock
        self._tcp = sock is not None and _TCP_INFO is not None and _acked(sock) is not None

        def restore() -> None:
            try:
                if limits is not None:
                    low, high = limits
                    transport.set_write_buffer_limits(high=high, low=low)
                if lowat is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, lowat)
            except (OSError, AttributeError, RuntimeError):
                pass

        self._restore = restore

    def _check(self) -> None:
        """Judge progress since the last check; cut the reader or re-arm."""
        transport, loop, now = self._transport, self._loop, self._time()
        if transport is None or loop is None or transport.is_closing():
            self._timer = None
            return
        late = now - self._checked_at > 2 * self._interval
        self._checked_at = now
        waiting = transport.get_write_buffer_size()
        if not waiting or late:  # nothing to judge, or we did not run to see it
            self._moved_at, self._acked = now, None
            self._seen = (self.sends, waiting)
        else:
            if self._tcp:
                acked = _acked(self._sock)
                moved = acked is None or acked != self._acked
                self._acked = acked
            else:
                sends, before = self._seen
                moved = self.sends != sends or waiting < before
            self._seen = (self.sends, waiting)
            if moved:
                self._moved_at = now
            elif now - self._moved_at >= self._limit:
                self._cut(transport)
                return
        self._timer = loop.call_at(now + self._interval, self._check)

    def _cut(self, transport: Any) -> None:
        """Reset the connection: the kernel drops what the reader never took (a plain close
        would keep the socket, and its buffers, waiting for the reader), and the server sees
        the connection lost."""
        self._timer = None
        self.stalled = True
        if self._sock is not None:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except (OSError, AttributeError):
                pass
        transport.abort()


def _not_started() -> float:
    return 0.0


def _acked(sock: Any) -> int | None:
    """Bytes the peer acknowledged (TCP_INFO), or None where that cannot be read."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
    except (OSError, AttributeError):
        return None
    if len(info) < _INFO_LEN:
        return None
    return int(_ACKED.unpack_from(info, _ACKED_AT)[0])
