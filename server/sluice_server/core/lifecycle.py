"""Starting and finishing one stream: metrics, capacity slot, drain registry, token bill;
and, for token-SSE streams (which have an id clients can come back with), the record of
recent streams and resuming one after its client dropped.

Resume (`--resume-grace-seconds` > 0): when the response of a live stream ends without its
terminal event (client gone, stalled reader), the stream is *detached* instead of
finished: the engine keeps generating into the same bounded buffer, the slot stays taken,
and a timer of the grace window runs. A request carrying `Last-Event-ID` for it within the
window *attaches* a new response, which replays what the stream had already handed out
after that id and then goes on live. When the window passes, the stream is finished as a
disconnect (engine request aborted, counted as an expired resume). With grace 0 a dropped
client's request is aborted at once, as for every other protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from ..engine.base import Delta
from .auth.identity import Principal
from .limits.queue import Ticket
from .services import Services
from .streaming.events import DISCONNECTED, STALLED, Meter
from .streaming.events import FINISHED as DONE
from .streaming.reconnects import ABORTED, DETACHED, FINISHED, LIVE
from .streaming.stream import Stream
from .telemetry.accesslog import Trail
from .telemetry.metrics import bind

# The cleanup takes `stalled`: the send timeout cut the reader off (transport/sendwatch.py).
Handle = tuple[Stream[Delta], Meter, Callable[[bool], None]]
ATTACH_WAIT_SECONDS = 2.0  # a reconnect may overtake the server noticing the disconnect


def open_stream(
    svc: Services,
    trail: Trail,
    who: Principal,
    source: AsyncIterator[Delta],
    t0: float,
    prompt_tokens: Callable[[], int] = lambda: 0,
    rid: str | None = None,
    ticket: Ticket | None = None,
    marked: bool = False,
    first_event: int = 0,
    continued: bool = False,
) -> Handle:
    """Start producing at once (the engine works while headers go out), or, with a `ticket`
    still waiting in the admission queue, once it is admitted (keep-alives meanwhile: the
    stream core's `Waiting` events). The returned cleanup(stalled) is idempotent and must
    run however the response ends: it aborts an unfinished engine request, frees the slot
    (or the queue place) and bills the caller's tokens; a stream that did not end on its own
    ends as a disconnect, or with `stalled` as a reader cut off. The stream's end also ends
    `trail` (its protocol and caller are the stream's). With `rid` the stream is recorded in
    `svc.recent` (and detached instead when it may be resumed). `marked`: a stream the
    router relays (its events carry token ids); `first_event`: the index its events start
    at; `continued`: a continuation, which bills only the tokens it generates (the first
    replica billed the prompt and what it delivered)."""
    protocol = trail.protocol or ""
    trail.prompt_tokens = prompt_tokens
    trail.admitted_at = time.perf_counter()
    if ticket is not None:
        trail.ticket = ticket
        if ticket.queued:
            source = ticket.metered(source)  # its tokens to its tenant's fair share
    meter = Meter(bind(svc.metrics, protocol, trail.model), t0, trail)
    s = svc.settings
    grace = s.resume_grace_seconds if rid is not None else 0.0
    seat = _Seat(ticket, meter) if ticket is not None and ticket.waiting else None
    if seat is None:
        meter.seated()
    stream = Stream(
        source,
        cap=s.stream_buffer_tokens,
        timeout=s.stream_timeout_seconds,
        replayable=grace > 0,
        admission=seat,
        keepalive=s.heartbeat_seconds,
        marked=marked,
        first_event=first_event,
    )
    svc.gate.streams.add(stream)
    done = False

    def finish(stalled: bool = False) -> None:
        nonlocal done
        if done:
            return
        done = True
        stream.close()
        svc.gate.streams.discard(stream)
        if ticket is not None:
            ticket.release()
        if meter.outcome is None:
            meter.finish(STALLED if stalled else DISCONNECTED, stream)
        svc.bill(who, (0 if continued else prompt_tokens()) + meter.tokens)
        if rid is not None:
            state = ABORTED if meter.outcome in (DISCONNECTED, STALLED) else FINISHED
            svc.recent.end(rid, state)
            if state == FINISHED and grace > 0:
                # Its last events may have been lost on the way (written to a proxy that
                # then saw the client go): replayable for the grace window, then dropped.
                # Its cleanup already ran (`_ended`, not `finish`: a closure naming
                # itself is a reference cycle, and it would keep the whole stream, its
                # task and trail alive until a full garbage collection).
                entry.handle = (stream, meter, _ended)
                entry.timer = asyncio.get_running_loop().call_later(grace, forget)

    if rid is None:
        return stream, meter, finish

    entry = svc.recent.add(rid, who.id, None)
    cut = False  # the last response ended because its reader stalled

    def forget() -> None:
        entry.handle = entry.timer = None

    def expire() -> None:
        if entry.state == DETACHED:
            svc.metrics.resumes_expired.labels(protocol, svc.metrics.model).inc()
            finish(cut)

    def end_response(stalled: bool = False) -> None:
        nonlocal cut
        if done:
            return
        if meter.outcome is None and grace > 0:
            cut = stalled
            entry.state = DETACHED
            entry.timer = asyncio.get_running_loop().call_later(grace, expire)
            return
        finish(stalled)

    handle: Handle = (stream, meter, end_response)
    entry.handle = handle
    return handle


class _Seat:
    """The admission a stream that waits in the queue reads (stream.Admitting): its
    ticket's wait, after which the stream holds a slot and counts as active."""

    __slots__ = ("ticket", "meter")

    def __init__(self, ticket: Ticket, meter: Meter) -> None:
        self.ticket, self.meter = ticket, meter

    @property
    def waited(self) -> float:
        return self.ticket.waited

    async def wait(self) -> None:
        await self.ticket.wait()
        self.meter.seated()


def _ended(stalled: bool = False) -> None:
    """The cleanup of a stream whose cleanup already ran."""


async def resume_stream(
    svc: Services, protocol: str, rid: str, kid: str, start: int
) -> Handle | None:
    """The stream `rid` re-attached to a new response that starts at event `start`, or None
    when the client has everything (the caller answers 204, which stops a browser's
    EventSource from reconnecting). Raises a 4xx when it cannot be resumed; never starts a
    generation."""
    entry = svc.recent.get(rid)
    if entry is None or entry.kid != kid:
        raise svc.bad_input(
            protocol,
            f"No stream {rid} on this server (unknown, expired, or "
            "served by another replica); send the request again without "
            "Last-Event-ID.",
            "Last-Event-ID",
            status=404,
            code="stream_not_found",
        )
    deadline = time.monotonic() + ATTACH_WAIT_SECONDS
    while entry.state == LIVE:  # still attached: its response has not seen the drop yet
        if time.monotonic() > deadline:
            raise svc.bad_input(
                protocol,
                f"Stream {rid} is still being read by another connection.",
                "Last-Event-ID",
                status=409,
                code="stream_attached",
            )
        await asyncio.sleep(0.01)
    if entry.state == FINISHED:
        handle: Handle | None = entry.handle  # replayable for the grace window after its end
        if handle is None or start > handle[0].n_events:
            return None
        svc.metrics.resumes.labels(protocol, svc.metrics.model).inc()
        return handle
    if entry.state == ABORTED:
        raise svc.bad_input(
            protocol,
            f"Stream {rid} was aborted when its client went away "
            "(resume is off, or its grace window passed); send the request "
            "again without Last-Event-ID.",
            "Last-Event-ID",
            status=410,
            code="stream_aborted",
        )
    detached: Handle = entry.handle
    stream, meter, end_response = detached
    if start > stream.n_events:
        if stream.ended is None:
            raise svc.bad_input(
                protocol,
                f"Last-Event-ID: stream {rid} has sent only {stream.n_events} events.",
                "Last-Event-ID",
            )
        meter.finish(DONE, stream)  # the client saw the final event
        entry.timer.cancel()
        end_response(False)
        return None
    entry.timer.cancel()
    entry.timer = None
    entry.state = LIVE
    svc.metrics.resumes.labels(protocol, svc.metrics.model).inc()
    return detached
