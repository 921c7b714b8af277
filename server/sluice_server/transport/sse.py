"""The SSE response: headers, pre-encoded body chunks, heartbeats, the send timeout, and
the client's disconnect, for thousands of open streams at once.

Owned here completely (no SSE library): the framing is the protocols' (pre-encoded bytes),
and what is left is small enough to read in one go and to keep exact.

Per response the stream runs in the request's own task plus one task that waits for the
client's disconnect (and then cancels the stream: a client that leaves during a long
prefill stops the engine work at once). Pings come from one app-wide `Heartbeat`; the send
timeout and early coalescing are one `SendWatchdog` per response on the connection's
transport (sendwatch.py), not a timeout scope per event: a reader it cuts off ends the
response the way a client that left does; shutdown is the server's (serve.py drains
streams before uvicorn is told to exit). `cleanup(stalled)` runs however the response ends,
also when the client left before the first byte (a connection already closed when the
response starts sends nothing); `stalled` says the send timeout cut the reader off.
asyncio only (uvicorn).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .sendwatch import SendWatchdog

NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = b": ping\n\n"
# The keep-alive of a stream waiting for a stream slot (the events loop's `Waiting`).
QUEUED = b": queued\n\n"


class Disconnected(Exception):
    """The client went away (ends the response quietly)."""


class Heartbeat:
    """One timer for every open SSE response on an event loop (per ping interval), instead
    of a sleeping ping task per response.

    Every `interval` it sends a comment to each response that has sent nothing for at least
    half an interval, so no connection stays silent longer than `interval` (what idle
    proxies need during a long prefill), and busy streams get no pings at all. The ping is
    sent from a short task of its own, so one stalled client cannot hold the others' pings;
    its send is covered by the response's send timeout like any other send. The timer stops
    when the last response closes."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, Heartbeat]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop, self.interval = loop, interval
        self.responses: dict[SSEResponse, Send] = {}
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def on(cls, loop: asyncio.AbstractEventLoop, interval: float) -> Heartbeat:
        per_loop = cls._by_loop.setdefault(loop, {})
        if interval not in per_loop:
            per_loop[interval] = cls(loop, interval)
        return per_loop[interval]

    def add(self, response: SSEResponse, send: Send) -> None:
        self.responses[response] = send
        if self._timer is None:
            self._timer = self.loop.call_later(self.interval, self._tick)

    def discard(self, response: SSEResponse) -> None:
        self.responses.pop(response, None)
        if not self.responses and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        idle_since = self.loop.time() - self.interval / 2
        for response, send in self.responses.items():
            if response.watchdog.last_send <= idle_since and response.ping_task is None:
                response.ping_task = self.loop.create_task(response.ping_once(send))
        self._timer = self.loop.call_later(self.interval, self._tick)


class HandedOver(Exception):
    """Raised by a response's body iterator for a stream handed to the router (a draining
    pod that takes continuations): the connection is ended without the body's end, which
    the router reads as a break and continues the stream on another replica."""


class SSEResponse(Response):
    """An ASGI response streaming `content` (pre-encoded SSE bytes) as `text/event-stream`.

    `ping` is the heartbeat interval in seconds (0: none); `send_timeout`: a reader that
    accepts no bytes for that long is cut off (None: never); the response then ends
    quietly and `cleanup(True)` aborts the engine request."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cleanup: Callable[[bool], None],
        *,
        ping: float = 15.0,
        send_timeout: float | None = None,
        headers: dict[str, str] | None = None,
        status_code: int = 200,
    ) -> None:
        self.body_iterator = content
        self.background: BackgroundTask | None = None  # FastAPI may set it
        self._cleanup = cleanup
        self.ping_interval = ping
        self.status_code = status_code
        # No hop-by-hop header (Connection, Transfer-Encoding, ...): the HTTP server frames the
        # body and owns the connection, and a proxy that copies one onto an HTTP/2 response
        # breaks the stream (RFC 9113 8.2.2). tests/server/test_stream_hop_headers.py.
        raw = {**NO_BUFFERING, **(headers or {})}
        raw["Content-Type"] = f"{self.media_type}; charset=utf-8"
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in raw.items()
        ]
        self.watchdog = SendWatchdog(send_timeout)
        self.active = True
        self.ping_task: asyncio.Task[None] | None = None
        self._task: asyncio.Task[Any] | None = None  # the task streaming the response
        self._ended_by: BaseException | None = None  # why the stream task was cancelled

    __hash__ = object.__hash__  # a dict key in the heartbeat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["method"].upper() == "HEAD":  # headers only; the body is never started
                await self._start(send)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await self._stream(
                receive, send, scope.get("sluice.send", send), scope.get("sluice.transport")
            )
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            self._cleanup(self.watchdog.stalled)
        if self.background is not None:
            await self.background()

    async def _start(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )

    async def _stream(
        self, receive: Receive, send: Send, raw_send: Send, transport: object | None
    ) -> None:
        loop = asyncio.get_running_loop()
        self._task = task = asyncio.current_task()
        assert task is not None  # a response is sent from a task
        if not self.watchdog.start(transport):
            self.active = False  # the client left before the response started: nothing to
            return  # send; the cleanup ends the stream as a disconnect
        heartbeat = Heartbeat.on(loop, self.ping_interval) if self.ping_interval > 0 else None
        if heartbeat is not None:
            heartbeat.add(self, send)
        listener = loop.create_task(self._end_on_disconnect(receive))
        try:
            await self._send_all(send, raw_send)
        except HandedOver:
            await _hang_up(transport)
        except asyncio.CancelledError:
            ended_by = self._ended_by
            if ended_by is None or task.uncancel() > 0:
                raise  # cancelled by someone else (server shutdown): let that win
            if not isinstance(ended_by, Disconnected):
                raise ended_by from None  # the heartbeat's send failed
        finally:
            self.active = False
            listener.cancel()
            if heartbeat is not None:
                heartbeat.discard(self)
            if self.ping_task is not None:
                self.ping_task.cancel()
            self.watchdog.stop()

    async def _send_all(self, send: Send, raw_send: Send) -> None:
        """Each chunk is one whole event (or several), written with one ASGI send: a ping
        sent from its own task between two of them cannot split an event. The start goes
        through the middlewares (`send`); body messages skip them (`raw_send`, the send
        app.py's Edge received: the middlewares inside it only look at the start)."""
        watched = self.watchdog.send
        await watched(
            send,
            {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": self.raw_headers,
            },
        )
        async for chunk in self.body_iterator:
            await watched(
                raw_send, {"type": "http.response.body", "body": chunk, "more_body": True}
            )
        self.active = False
        await watched(raw_send, {"type": "http.response.body", "body": b"", "more_body": False})

    def _end(self, reason: BaseException) -> None:
        """Stop the streaming task (from the listener or a ping task)."""
        if self.active and self._ended_by is None:
            self.active = False
            self._ended_by = reason
            assert self._task is not None  # set before the listener and pings start
            self._task.cancel()

    async def _end_on_disconnect(self, receive: Receive) -> None:
        while self.active:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._end(Disconnected())
                return

    async def ping_once(self, send: Send) -> None:
        """One heartbeat comment (a task started by `Heartbeat`)."""
        try:
            if self.active:  # not after the final (empty) body message
                await self.watchdog.send(
                    send, {"type": "http.response.body", "body": PING, "more_body": True}
                )
        except Exception as e:  # not a client that left (its sends return): end with it
            self._end(e)
        finally:
            self.ping_task = None


async def _hang_up(transport: object | None) -> None:
    """End the connection without the body's end (`HandedOver`). Aborted, then a turn of the
    loop for the server to hear it (a connection it knows is lost is not one whose answer
    was left unfinished, which it would log as an error)."""
    abort = getattr(transport, "abort", None)
    if abort is not None:
        abort()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
