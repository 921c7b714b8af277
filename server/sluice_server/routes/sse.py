"""`POST /v1/stream` (JSON body) and `GET /v1/stream?...` (browsers' EventSource)."""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import ApiError
from ..params import to_stream_request
from ..services import Services, api_key_of, read_json, received_at, services
from ..sse import StreamingSSE, token_events
from .common import open_stream

router = APIRouter()
PROTOCOL = "sse"


@router.post("/v1/stream")
async def stream_post(request: Request) -> Response:
    request.state.protocol = PROTOCOL
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    kid = svc.authorize(PROTOCOL, api_key_of(request))
    body = await read_json(request, svc, PROTOCOL)
    return await _start(request, svc, kid, body)


@router.get("/v1/stream")
async def stream_get(request: Request) -> Response:
    """Query parameters mirror the POST body; `messages` is JSON; `api_key` is accepted
    because EventSource cannot set headers."""
    request.state.protocol = PROTOCOL
    svc = services(request)
    svc.require_protocol(PROTOCOL, "/v1/stream")
    kid = svc.authorize(PROTOCOL, api_key_of(request, allow_query=True))
    body: dict = {k: v for k, v in request.query_params.items() if k != "api_key"}
    if "messages" in body:
        try:
            body["messages"] = json.loads(body["messages"])
        except ValueError:
            raise svc.bad_input(PROTOCOL, "messages: must be a JSON array", "messages") from None
    if "stop" in request.query_params and len(request.query_params.getlist("stop")) > 1:
        body["stop"] = request.query_params.getlist("stop")
    return await _start(request, svc, kid, body)


async def _start(request: Request, svc: Services, kid: str, body: dict) -> Response:
    engine = await svc.require_engine()
    rid = f"stream-{uuid.uuid4().hex}"
    try:
        req = to_stream_request(body, rid, engine, svc.settings.model_label)
    except ApiError as e:
        raise svc.count(PROTOCOL, e) from None
    svc.admit(PROTOCOL, kid)
    n_prompt = len(req.prompt_token_ids or ())
    stream, meter, cleanup = open_stream(
        svc, PROTOCOL, kid, engine.generate(req), received_at(request), lambda: n_prompt
    )
    return StreamingSSE(
        token_events(stream, meter, rid),
        cleanup,
        ping=svc.settings.heartbeat_seconds,
        send_timeout=svc.settings.send_timeout_seconds,
        headers={"X-Request-Id": rid},
    )
