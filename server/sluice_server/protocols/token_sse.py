"""The plain token stream: `POST /v1/stream` (JSON body) and `GET /v1/stream?...`
(browsers' EventSource), as SSE.

Events: `data: {"id","index","token","finished":false}` per (coalesced) token event, a
final event with `finish_reason` and `usage`, then `data: [DONE]`; after the 200 a failure
is `event: error` with `{"id","error":{...}}`, then `[DONE]`. Every event has an `id:`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..core.errors import ApiError
from ..core.events import Failed, Finished, Meter, Tokens, events
from ..core.identity import Principal
from ..core.lifecycle import open_stream
from ..core.params import to_stream_request
from ..core.services import Services, read_json, received_at, services, trail_of
from ..core.stream import Stream
from ..transport.sse import SSEResponse
from .openapi import stream_body, stream_query, streamed

router = APIRouter(tags=["token stream"])
PROTOCOL = "sse"
_dumps = json.dumps


@router.post("/v1/stream", openapi_extra=stream_body(), responses=streamed())
async def stream_post(request: Request) -> Response:
    """Generate and stream tokens as SSE."""
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    who = svc.authorize(request, PROTOCOL)
    body = await read_json(request, svc, PROTOCOL)
    return await _start(request, svc, who, body)


@router.get("/v1/stream", openapi_extra=stream_query(), responses=streamed())
async def stream_get(request: Request) -> Response:
    """Query parameters mirror the POST body; `messages` is JSON; `api_key` is accepted
    because EventSource cannot set headers."""
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    who = svc.authorize(request, PROTOCOL, allow_query=True)
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
    rid = f"stream-{trail.rid}"  # the engine's request id and the events' `id`
    try:
        req = to_stream_request(body, rid, engine, svc.settings.model_label)
    except ApiError as e:
        raise svc.count(PROTOCOL, e) from None
    await svc.admit(PROTOCOL, who)
    req.trace_headers = trail.carrier
    n_prompt = len(req.prompt_token_ids or ())
    stream, meter, cleanup = open_stream(
        svc, trail, who, engine.generate(req), received_at(request), lambda: n_prompt
    )
    return SSEResponse(
        token_events(stream, meter, rid),
        cleanup,
        ping=svc.settings.heartbeat_seconds,
        send_timeout=svc.settings.send_timeout_seconds,
    )


def error_payload(rid: str, message: str, code: str = "stream_error") -> str:
    return _dumps({"id": rid, "error": {"message": message, "type": "stream_error", "code": code}})


async def token_events(stream: Stream, meter: Meter, rid: str) -> AsyncIterator[bytes]:
    head = '{"id":' + _dumps(rid) + ',"index":'
    seq = 0
    async for ev in events(stream, meter):
        if type(ev) is Tokens:
            yield f'id: {seq}\ndata: {head}{seq},"token":{_dumps(ev.text)},"finished":false}}\n\n'.encode()
            seq += 1
        elif type(ev) is Finished:
            final = {"id": rid, "index": seq, "token": "", "finished": True,
                     "finish_reason": ev.reason, "usage": ev.usage}  # fmt: skip
            yield f"id: {seq}\ndata: {_dumps(final)}\n\nid: {seq + 1}\ndata: [DONE]\n\n".encode()
        elif type(ev) is Failed:
            yield (f"id: {seq}\nevent: error\ndata: {error_payload(rid, ev.message, ev.code)}\n\n"
                   f"id: {seq + 1}\ndata: [DONE]\n\n").encode()  # fmt: skip
