"""SSE framing for the token stream: pre-encoded bytes, no per-token objects."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from .streaming import FAILED, FINISHED, Meter, Stream, StreamFailed

_dumps = json.dumps
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamingSSE(EventSourceResponse):
    """EventSourceResponse (disconnect listening, pings, send timeout) whose cleanup runs
    however the response ends: also when the client left before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None], **kw):
        headers = {**NO_BUFFERING, **kw.pop("headers", {})}
        super().__init__(content, headers=headers, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


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
        if len(batch) == 1:
            text, ntok = last.text, last.num_tokens
        else:
            text = "".join([d.text for d in batch])
            ntok = sum([d.num_tokens for d in batch])
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
