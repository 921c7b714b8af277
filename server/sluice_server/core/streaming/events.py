"""The one loop every protocol streams through: a `Stream` of engine deltas in, typed events
out, with the edge metrics recorded once (`Meter`).

Protocols only format: `async for event in events(stream, meter)` and write each event in
their wire format. The loop records a token event's timing when the protocol asks for the
next event, that is right after the event's bytes were handed to the socket (TTFT and
inter-token latency at the edge). Outcomes are recorded before a terminal event is
written, except `Finished`, which counts once the final event went out (a client that
leaves during the last write is a disconnect, as for any other write).

Events:
- `Tokens(text, index)`: new text (everything a slow reader let pile up, as one event),
  numbered per stream from 0;
- `Finished(reason, usage)`: the engine finished ("stop", "length", ...);
- `Failed(message, code, status)`: after the 200 the stream cannot go on (buffer cap, time
  limit, drain, engine error, engine-side abort, engine ended without finishing; or, for a
  stream still waiting in the admission queue, the queue's refusal: 429 `queue_timeout`,
  503 `draining`);
- `Stopped()`: the client asked to stop (WebSocket); the engine request is aborted;
- `Waiting(waited)`: a keep-alive while the stream waits in the admission queue (before
  any token; the protocol writes it in its own form: an SSE comment, a WebSocket frame).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

from .stream import HANDED_OVER, KEEPALIVE, Stream, StreamFailed, engine_failure_code, join_batch

if TYPE_CHECKING:
    from ...engine.base import Delta
    from ..telemetry.accesslog import Trail
    from ..telemetry.metrics import Bound

# Outcomes (for logs and metrics). STALLED: the reader accepted no bytes for the send
# timeout and was cut off (counted as a disconnect: it is a client gone from the stream).
FINISHED, DISCONNECTED, FAILED, STOPPED = "finished", "disconnected", "failed", "stopped"
STALLED = "stalled"
HANDED = "handed_over"  # handed to the router: a drain (Stream.hand_over) or an engine failure
ENDED_EARLY = "Engine stream ended without finishing."
ABORTED_BY_SERVER = "Generation was aborted by the server."


class Tokens:
    __slots__ = ("text", "index", "ids")

    def __init__(self, text: str, index: int, ids: list[int] | None = None) -> None:
        self.text, self.index = text, index
        self.ids = ids  # on a marked stream: the token ids this event's text carries


class Finished:
    __slots__ = ("reason", "usage")

    def __init__(self, reason: str | None, usage: dict[str, Any]) -> None:
        self.reason, self.usage = reason, usage


class Failed:
    __slots__ = ("message", "code", "status")

    def __init__(self, message: str, code: str = "stream_error", status: int = 500) -> None:
        self.message, self.code, self.status = message, code, status


class Stopped:
    __slots__ = ()


class Waiting:
    __slots__ = ("waited",)

    def __init__(self, waited: float) -> None:
        self.waited = waited  # seconds in the admission queue so far


Event = Tokens | Finished | Failed | Stopped | Waiting


def usage_of(last: Delta | None) -> dict[str, Any]:
    """OpenAI-style usage from the last delta of a stream; `prompt_tokens_details` with the
    cached prompt tokens when the engine reports them (prefix cache, a KV transfer)."""
    p = last.prompt_tokens if last is not None else 0
    c = last.completion_tokens if last is not None else 0
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if last is not None and last.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": last.cached_tokens}
    return usage


class Meter:
    """Edge timings for one stream. `t0` is when the request arrived (middleware). Per
    delivered chunk (a token event, however many tokens it carries) one ITL observation on
    children bound once per protocol and model (`metrics.bind`); tokens are summed here and
    counted with one `inc(n)` when the stream ends. The stream's end is recorded once
    (`finish`): metrics, then the request's trail (access log line, span) from the same
    numbers. A request counts as accepted when its meter is made; its stream counts as
    active (`sluice_active_streams`) only from `seated()`, while it holds a stream slot, so
    a stream answered 200 that still waits in the admission queue is not one of them (the
    queue's depth counts it)."""

    __slots__ = (
        "m",
        "t0",
        "first_write",
        "last_write",
        "tokens",
        "outcome",
        "reason",
        "trail",
        "active",
    )

    def __init__(self, bound: Bound, t0: float, trail: Trail | None = None) -> None:
        self.m = bound
        self.t0 = t0
        self.first_write: float | None = None
        self.last_write = 0.0
        self.tokens = 0
        self.outcome: str | None = None
        self.reason: str | None = None  # the engine's finish reason
        self.trail = trail
        self.active = False  # counted in sluice_active_streams (holds a stream slot)
        bound.requests.inc()
        bound.last_request.set_to_current_time()

    def seated(self) -> None:
        """The stream holds a stream slot: active until it ends (once)."""
        if not self.active and self.outcome is None:
            self.active = True
            self.m.active.inc()

    def wrote(self, tokens: int) -> None:
        """Call right after a token event's bytes were handed to the socket. A write that
        carries no token (an API's opening events, such as Responses' `response.created`,
        sent before the engine answers) is no token event: TTFT and ITL skip it."""
        if not tokens:
            return
        now = time.perf_counter()
        if self.first_write is None:
            self.first_write = now
            self.m.ttft.observe(now - self.t0)
        else:
            self.m.itl.observe(now - self.last_write)
        self.last_write = now
        self.tokens += tokens

    def finish(self, outcome: str, stream: Stream[Delta] | None = None) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        m = self.m
        if self.active:
            m.active.dec()
        m.e2e.observe(time.perf_counter() - self.t0)
        if self.tokens:
            m.output_tokens.inc(self.tokens)
        if stream is not None and stream.first_output_at is not None:
            m.first_output.observe(stream.first_output_at - self.t0)
        if outcome == DISCONNECTED or outcome == STALLED:
            m.disconnects.inc()
            m.aborts.inc()
        elif outcome == FAILED:
            m.stream_errors.inc()
            m.aborts.inc()
        elif outcome == STOPPED:
            m.aborts.inc()
        elif outcome == HANDED:
            m.aborts.inc()
            m.handed_over.inc()
        if self.trail is not None:
            first = stream.first_output_at if stream is not None else None
            self.trail.end(outcome, meter=self, first_output=first)


def _engine_failed(stream: Stream[Delta], meter: Meter, message: str, code: str) -> Failed:
    """The engine ended the request without finishing it: handed to the router on a stream
    it can continue elsewhere, else the protocol's error event (`engine_failure_code`)."""
    code = engine_failure_code(stream.marked, code=code)
    meter.finish(HANDED if code == HANDED_OVER else FAILED, stream)
    return Failed(message, code)


async def events(
    stream: Stream[Delta], meter: Meter, start: int | None = None
) -> AsyncIterator[Event]:
    """Typed events of one stream; see the module docstring for when metrics are taken.

    Token events are numbered from the stream's first index (`Tokens.index`,
    `stream.n_events` is the next). A replayable stream read again from `start` first
    replays the token events from that index (and the terminal event if it was already
    handed out), then goes on live. On a marked stream each token event carries the ids of
    its tokens, and of earlier tokens that decoded to no text."""
    sent, first, sent_ids = stream.sent, stream.first, stream.sent_ids
    if start is not None and sent is not None:
        for i in range(max(start, first), first + len(sent)):
            yield Tokens(sent[i - first], i, sent_ids[i - first] if sent_ids else None)
        if stream.ended is not None:
            yield cast(Finished, stream.ended)  # only this loop sets it, to its Finished
            meter.finish(FINISHED, stream)
            return
    marked = stream.marked
    pending: list[int] = []
    while True:
        try:
            batch = await stream.next_batch()
        except StreamFailed as e:
            meter.finish(HANDED if e.code == HANDED_OVER else FAILED, stream)
            yield Failed(str(e), e.code, e.status)
            return
        if batch is KEEPALIVE:
            yield Waiting(stream.waited)
            continue
        if batch is None:
            if stream.stopped:
                meter.reason = "abort"
                meter.finish(STOPPED, stream)
                yield Stopped()
            else:
                yield _engine_failed(stream, meter, ENDED_EARLY, "stream_error")
            return
        last = batch[-1]
        text, ntok = join_batch(batch)
        if marked:
            for d in batch:
                if d.token_ids:
                    pending.extend(d.token_ids)
        if text:
            index = stream.n_events
            stream.n_events = index + 1
            ids = None
            if marked:
                ids, pending = pending, []
                if sent_ids is not None:
                    sent_ids.append(ids)
            if sent is not None:
                sent.append(text)
            yield Tokens(text, index, ids)
            meter.wrote(ntok)  # resumed: the bytes were handed to the socket
        else:
            meter.tokens += ntok
        if last.finished:
            if last.finish_reason == "abort":
                meter.reason = "abort"
                yield _engine_failed(stream, meter, ABORTED_BY_SERVER, "aborted")
                return
            meter.reason = last.finish_reason
            ended = Finished(last.finish_reason, usage_of(last))
            if sent is not None:
                stream.ended = ended
            yield ended
            meter.finish(FINISHED, stream)
            return
