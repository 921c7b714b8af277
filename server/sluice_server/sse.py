"""SSE framing for the token stream: pre-encoded bytes, no per-token objects."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError, ensure_bytes
from starlette.types import Message, Receive, Scope, Send

from .sendwatch import SendWatchdog
from .streaming import FAILED, FINISHED, Meter, Stream, StreamFailed, join_batch

_dumps = json.dumps


class Disconnected(Exception):
    """The client went away (ends the response quietly)."""


NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Heartbeat:
    """One timer for every open SSE response on an event loop (per ping interval), instead
    of a sleeping ping task per response.

    Every `interval` it sends a comment to each response that has sent nothing for at least
    half an interval, so no connection stays silent longer than `interval` (what idle
    proxies need during a long prefill), and busy streams get no pings at all. The ping is
    sent from a short task of its own, so one stalled client cannot hold the others' pings;
    its send is covered by the response's send timeout like any other send. The timer stops
    when the last response closes."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop, self.interval = loop, interval
        self.responses: dict[StreamingSSE, Send] = {}
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def on(cls, loop: asyncio.AbstractEventLoop, interval: float) -> Heartbeat:
        per_loop = cls._by_loop.setdefault(loop, {})
        if interval not in per_loop:
            per_loop[interval] = cls(loop, interval)
        return per_loop[interval]

    def add(self, response: StreamingSSE, send: Send) -> None:
        self.responses[response] = send
        if self._timer is None:
            self._timer = self.loop.call_later(self.interval, self._tick)

    def discard(self, response: StreamingSSE) -> None:
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


class StreamingSSE(EventSourceResponse):
    """sse-starlette's EventSourceResponse (framing, headers, HEAD, closing the body on a
    failed send) with a lighter per-response cost for thousands of open streams, and a
    cleanup that runs however the response ends (also when the client left before the
    first byte).

    Per response: the stream runs in the request's own task plus one task that waits for
    the client's disconnect (and then cancels the stream: a client that leaves during a
    long prefill stops the engine work at once). Instead of sse-starlette's task group of
    four (stream, ping loop, shutdown listener, disconnect listener): pings come from one
    app-wide `Heartbeat`, and shutdown is ours (`drain.py` drains streams before uvicorn
    is told to exit).

    The send timeout is enforced by one `SendWatchdog` per response instead of
    sse-starlette's anyio cancel scope per message: a send pending longer than
    `send_timeout` raises `SendTimeoutError` as before (the response ends, `cleanup` aborts
    the engine request). asyncio only (uvicorn)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None], **kw):
        headers = {**NO_BUFFERING, **kw.pop("headers", {})}
        super().__init__(content, headers=headers, **kw)
        self._cleanup = cleanup
        self.watchdog = SendWatchdog(self.send_timeout, SendTimeoutError)
        self._task: asyncio.Task | None = None  # the task streaming the response
        self._ended_by: BaseException | None = None  # why the stream task was cancelled
        self.ping_task: asyncio.Task | None = None

    __hash__ = object.__hash__  # a dict key in the heartbeat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() == "HEAD":
            try:  # rare paths: sse-starlette's own handling
                await super().__call__(scope, receive, send)
            finally:
                self._cleanup()
            return
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.watchdog.start()
        heartbeat = Heartbeat.on(loop, self.ping_interval) if self.ping_interval > 0 else None
        if heartbeat is not None:
            heartbeat.add(self, send)
        listener = loop.create_task(self._end_on_disconnect(receive))
        try:
            await self._stream_response(send)
        except asyncio.CancelledError:
            ended_by = self._ended_by
            if ended_by is None or self._task.uncancel() > 0:
                raise  # cancelled by someone else (server shutdown): let that win
            if not isinstance(ended_by, Disconnected):
                raise ended_by from None  # the heartbeat's send failed
        finally:
            listener.cancel()
            if heartbeat is not None:
                heartbeat.discard(self)
            if self.ping_task is not None:
                self.ping_task.cancel()
            self.watchdog.stop()
            self._cleanup()
        if self.background is not None:
            await self.background()

    def _end(self, reason: BaseException) -> None:
        """Stop the streaming task (from the listener or a ping task)."""
        if self.active and self._ended_by is None:
            self.active = False
            self._ended_by = reason
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
            async with self._send_lock:
                if self.active:
                    body = ensure_bytes(ServerSentEvent(comment="ping"), self.sep)
                    await self._send_with_timeout(
                        send, {"type": "http.response.body", "body": body, "more_body": True}
                    )
        except Exception as e:  # a stalled or gone client: end the response like a data send
            self._end(e)
        finally:
            self.ping_task = None

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """One ASGI send, awaited directly; the watchdog enforces the send timeout."""
        await self.watchdog.send(send, message)


def usage_of(last) -> dict:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }


def error_payload(rid: str, message: str, code: str = "stream_error") -> str:
    return _dumps({"id": rid, "error": {"message": message, "type": "stream_error", "code": code}})


async def token_events(stream: Stream, meter: Meter, rid: str) -> AsyncIterator[bytes]:
    """`data: {"id","index","token","finished":false}` per (coalesced) event, a final event
    with finish_reason and usage, then `data: [DONE]`; `event: error` on failure. Every
    event carries an `id:` (its index)."""
    head = '{"id":' + _dumps(rid) + ',"index":'
    seq = 0
    while True:
        try:
            batch = await stream.next_batch()
        except StreamFailed as e:
            yield f"id: {seq}\nevent: error\ndata: {error_payload(rid, str(e))}\n\n".encode()
            yield f"id: {seq + 1}\ndata: [DONE]\n\n".encode()
            meter.finish(FAILED, stream)
            return
        if batch is None:
            yield f"id: {seq}\nevent: error\ndata: {error_payload(rid, 'Engine stream ended without finishing.')}\n\n".encode()
            yield f"id: {seq + 1}\ndata: [DONE]\n\n".encode()
            meter.finish(FAILED, stream)
            return
        last = batch[-1]
        text, ntok = join_batch(batch)
        if text:
            yield f'id: {seq}\ndata: {head}{seq},"token":{_dumps(text)},"finished":false}}\n\n'.encode()
            meter.wrote(ntok)  # resumed: the bytes were handed to the socket
            seq += 1
        else:
            meter.tokens += ntok
        if last.finished:
            if last.finish_reason == "abort":
                msg = "Generation was aborted by the server."
                yield f"id: {seq}\nevent: error\ndata: {error_payload(rid, msg, 'aborted')}\n\n".encode()
                yield f"id: {seq + 1}\ndata: [DONE]\n\n".encode()
                meter.finish(FAILED, stream)
                return
            final = {"id": rid, "index": seq, "token": "", "finished": True,
                     "finish_reason": last.finish_reason, "usage": usage_of(last)}  # fmt: skip
            yield f"id: {seq}\ndata: {_dumps(final)}\n\n".encode()
            yield f"id: {seq + 1}\ndata: [DONE]\n\n".encode()
            meter.finish(FINISHED, stream)
            return
