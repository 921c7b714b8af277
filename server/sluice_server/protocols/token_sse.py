"""The plain token stream: `POST /v1/stream` (JSON body) and `GET /v1/stream?...`
(browsers' EventSource), as SSE.

Events: `data: {"id","index","token","finished":false}` per (coalesced) token event, a
final event with `finish_reason` and `usage`, then `data: [DONE]`; after the 200 a failure
is `event: error` with `{"id","error":{...}}`, then `[DONE]`. Every event has an
`id: <stream id>:<index>` and the first carries `retry:` (EventSource's reconnect delay).

With a queue, a request that waits for a stream slot gets its 200 after
`--heartbeat-seconds` of waiting, then `: queued` comments every heartbeat until its first
token (a refusal after that is the error event with the queue's code). A request with
`Last-Event-ID` (EventSource sends it when it reconnects) never starts a generation: it resumes that stream after that event (core/lifecycle.py), gets 204 when the
stream has ended (which stops EventSource), or a 4xx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from json.encoder import encode_basestring_ascii

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..core.auth.cachesalt import ROUTER_HEADER
from ..core.auth.identity import Principal
from ..core.errors import ApiError
from ..core.kvtransfer import PREFILL_KEY, PREFILL_PARAMS, transfer_in
from ..core.lifecycle import open_stream, resume_stream
from ..core.params import to_stream_request
from ..core.services import ClientGone, Services, read_json, received_at, services, trail_of
from ..core.streaming.continuation import (
    MARKED_HEADER,
    SCOPE_KEY,
    Continuation,
    continued,
    event_id,
)
from ..core.streaming.continuation import marked as is_marked
from ..core.streaming.events import (
    DISCONNECTED,
    FINISHED,
    Failed,
    Finished,
    Meter,
    Tokens,
    Waiting,
    events,
)
from ..core.streaming.stream import HANDED_OVER, Stream
from ..core.telemetry.metrics import bind
from ..engine.base import Delta
from ..transport.sse import QUEUED, HandedOver, SSEResponse
from .engine_api import received, unless_disconnected
from .openapi import stream_body, stream_query, streamed

router = APIRouter(tags=["token stream"])
PROTOCOL = "sse"
_dumps = json.dumps
# A token's text as JSON, byte for byte what json.dumps writes, without its Python-level
# layers: 0.09 us instead of 0.58 (orjson: 0.15 us, so no new dependency for it).
_json_str = encode_basestring_ascii


@router.post("/v1/stream", openapi_extra=stream_body(), responses=streamed())
async def stream_post(request: Request) -> Response:
    """Generate and stream tokens as SSE."""
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    who = svc.authorize(request, PROTOCOL)
    if "last-event-id" in request.headers:
        return await _resume(request, svc, who)
    body = await read_json(request, svc, PROTOCOL)
    return await _start(request, svc, who, body)


@router.get("/v1/stream", openapi_extra=stream_query(), responses=streamed())
async def stream_get(request: Request) -> Response:
    """Query parameters mirror the POST body; `messages` is JSON; `api_key` is accepted
    because EventSource cannot set headers."""
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    who = svc.authorize(request, PROTOCOL, allow_query=True)
    if "last-event-id" in request.headers:
        return await _resume(request, svc, who)
    body: dict = {k: v for k, v in request.query_params.items() if k != "api_key"}
    if "messages" in body:
        try:
            body["messages"] = json.loads(body["messages"])
        except ValueError:
            raise svc.bad_input(PROTOCOL, "messages: must be a JSON array", "messages") from None
    if "stop" in request.query_params and len(request.query_params.getlist("stop")) > 1:
        body["stop"] = request.query_params.getlist("stop")
    return await _start(request, svc, who, body)


async def _start(request: Request, svc: Services, who: Principal, body: dict) -> Response:
    engine = await svc.require_engine()
    trail = trail_of(request)
    engine_rid = trail.rid
    cont: Continuation | None = request.scope.get(SCOPE_KEY)
    if cont is not None:  # the stream another replica started: its id, its next events
        trail.rid = cont.response_id
    # The request id is the stream's: its events' `id`, the engine's request id (a
    # continuation's engine request has its own, whatever the stream's id was elsewhere).
    rid = trail.rid
    prefill = bool(request.scope.get(PREFILL_KEY))
    try:
        req = to_stream_request(body, engine_rid, engine, lambda m: svc.route(trail, who, m))
        s = svc.settings
        if prefill:  # validated as sent, run for one token (core/kvtransfer.py)
            req.options.max_tokens = 1
            req.kv_transfer_params = dict(PREFILL_PARAMS)
        else:
            req.kv_transfer_params = transfer_in(
                request.headers, s.continuation_key_file, s.disaggregation_role
            )
    except ApiError as e:
        raise svc.count(PROTOCOL, e) from None
    ticket = await svc.admit(PROTOCOL, who, trail, continuation=cont is not None)
    try:
        # Waits up to a heartbeat for a slot with a real status; past it, commits to 200.
        await svc.wait_admitted(request, PROTOCOL, ticket, svc.settings.heartbeat_seconds)
    except ClientGone:
        trail.end(DISCONNECTED, 499)
        return Response(status_code=499)
    req.trace_headers = trail.carrier
    req.priority = svc.engine_priority(who)
    req.cache_salt = svc.cache_salt(who, req.cache_salt)
    n_prompt = len(req.prompt_token_ids or ())
    if prefill:
        return await _prefill(request, svc, engine, req, ticket, trail)
    source = engine.generate(req)
    if req.kv_transfer_params is not None:
        source = received(source, svc)
    if cont is not None:
        req.resume_ids = cont.token_ids
        source = continued(source, cont, framed=False)
    handle = open_stream(
        svc, trail, who, source, received_at(request), lambda: n_prompt, rid, ticket,
        marked=is_marked(cont is not None, ROUTER_HEADER in request.headers,
                         svc.settings.continuation_key_file),
        first_event=cont.next_event if cont is not None else 0,
        continued=cont is not None,
    )  # fmt: skip
    return _respond(svc, handle, rid, None)


async def _prefill(request: Request, svc: Services, engine, req, ticket, trail) -> Response:
    """A remote prefill on the token stream (core/kvtransfer.py): the engine's params for
    the decode pod and the prompt's size, as JSON."""
    t0 = received_at(request)

    async def run() -> Delta | None:
        last = None
        async for d in engine.generate(req):
            last = d
        return last

    try:
        last = await unless_disconnected(request, run())
    finally:
        ticket.release()
    meter = Meter(bind(svc.metrics, PROTOCOL, trail.model), t0, trail)
    if last is None:
        meter.finish(DISCONNECTED)
        return Response(status_code=499)
    meter.tokens = last.completion_tokens
    meter.finish(FINISHED)
    svc.kv_transferred("out", last.prompt_tokens)
    return JSONResponse(
        {"kv_transfer_params": last.kv_transfer_params, "prompt_tokens": last.prompt_tokens}
    )


async def _resume(request: Request, svc: Services, who: Principal) -> Response:
    last = request.headers["last-event-id"]
    # A client behind the router has the router's form, `<id>:<index>;<token ids>`.
    rid, _, index = last.split(";", 1)[0].rpartition(":")
    if not rid or not index.isdigit():
        raise svc.bad_input(
            PROTOCOL,
            f"Last-Event-ID must be <stream id>:<index> as sent in "
            f"the stream's `id:` fields, got {last!r}.",
            "Last-Event-ID",
        )
    start = int(index) + 1
    handle = await resume_stream(svc, PROTOCOL, rid, who.id, start)
    trail_of(request).rid = rid  # this request continues that stream (X-Request-Id, log)
    if handle is None:
        return Response(status_code=204)
    return _respond(svc, handle, rid, start)


def _respond(svc: Services, handle, rid: str, start: int | None) -> Response:
    stream, meter, cleanup = handle
    grace = svc.settings.resume_grace_seconds
    # Reconnect well inside the resume window (EventSource's default is about 3 s).
    retry_ms = 1000 if grace == 0 else max(100, min(1000, int(grace * 250)))
    return SSEResponse(
        token_events(stream, meter, rid, start, retry_ms),
        cleanup,
        ping=svc.settings.heartbeat_seconds,
        send_timeout=svc.settings.send_timeout_seconds,
        headers={MARKED_HEADER: "1"} if stream.marked else None,
    )


def error_payload(rid: str, message: str, code: str = "stream_error") -> str:
    return _dumps({"id": rid, "error": {"message": message, "type": "stream_error", "code": code}})


def error_event(rid: str, message: str, code: str = "stream_error") -> str:
    """The error after the 200 of a stream that sent no token yet (a proxy in front of the
    server ends a held stream with it), then `[DONE]`."""
    return f"event: error\ndata: {error_payload(rid, message, code)}\n\ndata: [DONE]\n\n"


def status_event(phase: str, waited: float) -> str:
    """A progress event for pages that show why nothing streams yet (`event: status`,
    asked for with `X-Sluice-Status: 1`): the phase (`starting`: the model has no ready
    replica) and the seconds waited so far."""
    return (
        f"event: status\ndata: {_dumps({'phase': phase, 'waited_seconds': round(waited, 3)})}\n\n"
    )


async def token_events(
    stream: Stream, meter: Meter, rid: str, start: int | None = None, retry_ms: int = 1000
) -> AsyncIterator[bytes]:
    """The SSE bytes of one stream; `start`: resume at that event index (replaying). A
    token event is assembled as bytes from parts encoded once per stream."""
    id_head = f"id: {rid}:".encode()
    head = ('\ndata: {"id":' + _dumps(rid) + ',"index":').encode()
    prefix = f"retry: {retry_ms}\n".encode()  # goes with the first event
    if stream.first:  # a continuation: the first replica sent it
        prefix = b""
    marked = stream.marked  # relayed by the router: each id also names the event's tokens
    async for ev in events(stream, meter, start):
        if type(ev) is Waiting:
            yield QUEUED
            continue
        if type(ev) is Tokens:
            i = ev.index
            if marked:
                ids = event_id(rid, i, ev.ids).encode()
                yield b'%sid: %s%s%d,"token":%s,"finished":false}\n\n' % (
                    prefix, ids, head, i, _json_str(ev.text).encode()
                )  # fmt: skip
                prefix = b""
                continue
            yield b'%s%s%d%s%d,"token":%s,"finished":false}\n\n' % (
                prefix,
                id_head,
                i,
                head,
                i,
                _json_str(ev.text).encode(),
            )
        else:
            i = stream.n_events
            if type(ev) is Finished:
                final = {
                    "id": rid,
                    "index": i,
                    "token": "",
                    "finished": True,
                    "finish_reason": ev.reason,
                    "usage": ev.usage,
                }
                event = f"data: {_dumps(final)}"
            elif type(ev) is Failed:
                if marked and ev.code == HANDED_OVER:
                    raise HandedOver
                event = f"event: error\ndata: {error_payload(rid, ev.message, ev.code)}"
            else:
                continue
            if marked:
                last_ids = (event_id(rid, i, ()), event_id(rid, i + 1, ()))
            else:
                last_ids = (f"{rid}:{i}", f"{rid}:{i + 1}")
            yield (
                prefix
                + f"id: {last_ids[0]}\n{event}\n\nid: {last_ids[1]}\ndata: [DONE]\n\n".encode()
            )
        prefix = b""
