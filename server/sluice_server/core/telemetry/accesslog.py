"""What one request leaves behind when it ends: its access-log line and its span.

The edge middleware opens a `Trail` per HTTP request or WebSocket handshake (request id,
arrival time, the caller's trace headers); the routes name the protocol and key id; the
WebSocket opens one more per generation. A trail ends once, in one of three places:
- the stream's `Meter.finish` (core/streaming/events.py): any stream, any outcome;
- a counted refusal of a WebSocket frame (core/services.py);
- the edge, when an HTTP request ended without a stream (refusals before the 200, `/v1/models`,
  unknown paths); probes are not logged.
Everything is taken from numbers the stream keeps anyway, so the cost is per request, never
per token. The path is logged without its query string (`?api_key=` stays out of logs).

With an admission queue (or priority classes) the line also names the caller's `priority`
class and `queue_ms`, the time it waited in the queue for a stream slot (part of its TTFT).

The span (with `--otlp-traces-endpoint`) is made whole at the end too: started at the
request's arrival time in the caller's trace (W3C `traceparent`/`tracestate` kept at the
edge), with events at the times the stream recorded (`queued` when it had to wait for a
slot, `admitted`, `first_output`: the engine's first output, `first_byte`: the first
token's bytes handed to the socket, i.e. TTFT, `end`), and ended now, with the queue wait
and the priority as attributes. So tracing costs nothing until a request ends.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Protocol

from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .tracing import Tracing

ACCESS_LOGGER = "sluice_server.access"
REJECTED = "rejected"
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
TRACE_HEADERS = (b"traceparent", b"tracestate")
_propagator = TraceContextTextMapPropagator()


class Measured(Protocol):
    """What a trail reads from the stream's meter (core/streaming/events.py `Meter`) at the end."""

    tokens: int
    reason: str | None
    first_write: float | None


class Seated(Protocol):
    """What a trail reads from the request's admission ticket (core/limits/queue.py)."""

    priority: str
    queued_at: float
    admitted_at: float | None

    @property
    def queued(self) -> bool:
        """Went through an admission queue."""

    @property
    def waited(self) -> float:
        """Seconds it waited for its slot."""


def new_request_id() -> str:
    return uuid.uuid4().hex


class Recorder:
    """The app's sink for ended trails: the access log (text or JSON) and, when tracing is
    on, the tracer."""

    def __init__(
        self,
        model: str,
        access_log: bool = True,
        fmt: str = "text",
        tracing: Tracing | None = None,
        priorities: bool = False,
    ) -> None:
        self.model = model
        self.priorities = priorities  # priority classes are configured: log each one
        self.enabled = access_log
        self.json = fmt == "json"
        self.log = logging.getLogger(ACCESS_LOGGER)
        self.tracing = tracing

    def open(
        self,
        rid: str,
        t0: float,
        path: str = "",
        method: str = "",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> Trail:
        trail = Trail(self, rid, t0, path, method)
        if self.tracing is not None and headers:
            trail.carrier = {
                k.decode(): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS
            }
        return trail

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled or not self.log.isEnabledFor(logging.INFO):
            return
        if self.json:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
            line = json.dumps({"ts": stamp + "Z", **record}, separators=(",", ":"))
        else:
            line = " ".join(f"{k}={_text(v)}" for k, v in record.items())
        self.log.info(line)


def _text(v: object) -> str:
    if v is None:
        return "-"
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class Trail:
    """One request's identity and end. `protocol`, `kid` (the caller's id: a key's hash or
    a token's subject, never a credential) and `tenant` are set by the route once known;
    `stream` is the client's id of a WebSocket generation."""

    __slots__ = ("rec", "rid", "t0", "path", "method", "protocol", "kid", "tenant", "stream",
                 "status", "ended", "prompt_tokens", "carrier", "admitted_at", "ticket",
                 "model")  # fmt: skip

    def __init__(self, rec: Recorder, rid: str, t0: float, path: str, method: str) -> None:
        self.rec, self.rid, self.t0, self.path, self.method = rec, rid, t0, path, method
        self.protocol: str | None = None
        self.kid: str | None = None
        self.tenant: str | None = None
        self.stream: str | None = None
        self.status: int | None = None
        self.ended = False
        self.prompt_tokens = _zero
        self.carrier: dict[str, str] | None = None  # the caller's trace headers
        self.admitted_at: float | None = None
        self.ticket: Seated | None = None  # its admission (a slot, or a queue's place)
        self.model: str | None = None  # a LoRA adapter's name, when the request named one

    def child(self, stream: str, t0: float) -> Trail:
        """A trail for one generation on a WebSocket: same request id, its own clock."""
        t = Trail(self.rec, self.rid, t0, self.path, self.method)
        t.protocol, t.kid, t.tenant, t.stream = self.protocol, self.kid, self.tenant, stream
        t.carrier = self.carrier
        return t

    def end(
        self,
        outcome: str,
        status: int | None = None,
        meter: Measured | None = None,
        first_output: float | None = None,
    ) -> None:
        """Write the access-log line and export the span, once."""
        if self.ended:
            return
        self.ended = True
        now = time.perf_counter()
        status = status or self.status or _UNSENT.get(outcome, 200)
        ttft = None
        completion = 0
        reason = None
        if meter is not None:
            completion = meter.tokens
            reason = meter.reason
            if meter.first_write is not None:
                ttft = round((meter.first_write - self.t0) * 1000, 1)
        record = {
            "request_id": self.rid,
            "stream": self.stream,
            "key_id": self.kid,
            "tenant": self.tenant,
            "model": self.model or self.rec.model,
            "protocol": self.protocol,
            "method": self.method,
            "path": self.path,
            "status": status,
            "outcome": outcome,
            "finish_reason": reason,
            "ttft_ms": ttft,
            "prompt_tokens": self.prompt_tokens() if meter is not None else 0,
            "completion_tokens": completion,
            "duration_ms": round((now - self.t0) * 1000, 1),
        }
        if self.stream is None:
            del record["stream"]
        ticket = self.ticket
        if ticket is not None:
            if ticket.queued or self.rec.priorities:
                record["priority"] = ticket.priority
            if ticket.queued:
                record["queue_ms"] = round(ticket.waited * 1000, 1)
        self.rec.write(record)
        if self.rec.tracing is not None:
            first_byte = meter.first_write if meter is not None else None
            self._span(record, now, first_output, first_byte)

    def _span(
        self,
        record: dict[str, Any],
        now: float,
        first_output: float | None,
        first_byte: float | None,
    ) -> None:
        # perf_counter times -> epoch nanoseconds, anchored at `now`.
        wall = time.time_ns()

        def ns(t: float) -> int:
            return wall - int((now - t) * 1e9)

        tracing = self.rec.tracing
        assert tracing is not None  # end() calls this only with tracing on
        span = tracing.tracer.start_span(
            f"{self.method} {self.path}",
            context=_propagator.extract(self.carrier) if self.carrier else None,
            kind=SpanKind.SERVER,
            start_time=ns(self.t0),
        )
        if not span.is_recording():  # not sampled
            return
        attrs = {
            "sluice.request_id": self.rid,
            "sluice.model": record["model"],
            "sluice.protocol": record["protocol"] or "",
            "sluice.outcome": record["outcome"],
            "sluice.prompt_tokens": record["prompt_tokens"],
            "sluice.completion_tokens": record["completion_tokens"],
            "http.response.status_code": record["status"],
            "http.route": self.path,
        }
        for key, name in (
            ("finish_reason", "sluice.finish_reason"),
            ("stream", "sluice.stream"),
            ("key_id", "sluice.key_id"),
            ("priority", "sluice.priority"),
            ("queue_ms", "sluice.queue_wait_ms"),
        ):
            if record.get(key) is not None:
                attrs[name] = record[key]
        span.set_attributes(attrs)
        ticket = self.ticket
        queued = ticket.queued_at if ticket is not None and ticket.waited > 0 else None
        admitted = ticket.admitted_at if ticket is not None else self.admitted_at
        for name, t in (
            ("queued", queued),
            ("admitted", admitted),
            ("first_output", first_output),
            ("first_byte", first_byte),
            ("end", now),
        ):
            if t is not None:
                span.add_event(name, timestamp=ns(t))
        if record["outcome"] in ("failed", REJECTED):
            span.set_status(StatusCode.ERROR, f"{record['outcome']} ({record['status']})")
        span.end(end_time=ns(now))

    def close(self, failed: bool = False) -> None:
        """At the edge, when the HTTP exchange is over: end a trail no stream ended (an
        accepted WebSocket's generations have their own; probes are not logged)."""
        if self.ended or self.status == 101 or (self.path in QUIET_PATHS and not failed):
            return
        status = 500 if failed and self.status is None else (self.status or 500)
        if status < 400:
            outcome = "finished"
        elif status < 500 or status == 503:
            outcome = REJECTED
        else:
            outcome = "failed"
        self.end(outcome, status)


# The status of a request that ended before its response started.
_UNSENT = {"failed": 500, "disconnected": 499, "stalled": 499}


def _zero() -> int:
    return 0
