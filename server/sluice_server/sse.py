"""SSE framing for the token stream: pre-encoded bytes, no per-token objects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import Message, Receive, Scope, Send

from .streaming import FAILED, FINISHED, Meter, Stream, StreamFailed, join_batch

_dumps = json.dumps
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamingSSE(EventSourceResponse):
    """EventSourceResponse (disconnect listening, pings, send timeout) whose cleanup runs
    however the response ends: also when the client left before the first byte.

    The send timeout is enforced by one watchdog timer per response instead of
    sse-starlette's anyio cancel scope per message (about a third of the server's CPU under
    SSE fan-out, docs/benchmarks.md "Hot spots"): each send records when it started, and
    the watchdog cancels a send pending longer than `send_timeout`, which then raises
    `SendTimeoutError` as before (the response ends, `cleanup` aborts the engine request).
    The watchdog fires about once per `send_timeout` while sends complete, and at the
    oldest pending send's deadline otherwise. asyncio only (uvicorn)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None], **kw):
        headers = {**NO_BUFFERING, **kw.pop("headers", {})}
        super().__init__(content, headers=headers, **kw)
        self._cleanup = cleanup
        self._pending: dict[asyncio.Task, float] = {}  # task -> when its send started
        self._expired: asyncio.Task | None = None  # the task whose send the watchdog cut
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.send_timeout is not None:
            self._loop = loop = asyncio.get_running_loop()
            self._watchdog = loop.call_at(loop.time() + self.send_timeout, self._check_sends)
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            self._cleanup()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """One ASGI send, awaited directly; the watchdog enforces the send timeout."""
        if self._watchdog is None:  # no send timeout
            await send(message)
            return
        task = asyncio.current_task()
        pending = self._pending
        pending[task] = self._loop.time()
        try:
            await send(message)
        except asyncio.CancelledError:
            if task is not self._expired:
                raise
            self._expired = None
            if task.uncancel() > 0:  # also cancelled by someone else: let that win
                raise
            raise SendTimeoutError() from None
        finally:
            del pending[task]

    def _check_sends(self) -> None:
        """Watchdog: cancel a send pending for `send_timeout`; re-arm for the next deadline."""
        loop, timeout = self._loop, self.send_timeout
        now = loop.time()
        next_at = now + timeout
        for task, since in self._pending.items():
            if task is self._expired:
                continue  # already cancelled, unwinding
            deadline = since + timeout
            if deadline <= now + 1e-3:
                if self._expired is None:
                    self._expired = task
                    task.cancel()  # raises in its `await send(...)`, never elsewhere
            elif deadline < next_at:
                next_at = deadline
        self._watchdog = loop.call_at(next_at, self._check_sends)


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
