"""Anthropic Messages: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`.

vLLM's `AnthropicServingMessages` renders it (the request mapped onto vLLM's chat
template, the event sequence `message_start` ... `message_stop`); `engine_api` adds
Sluice's streaming behaviour. Errors are Anthropic's shape, before the 200
(`{"type": "error", "error": {"type", "message"}}` with the HTTP status) and after it
(`event: error` with the same object). The key may come as `x-api-key` (Anthropic's SDK)
or `Authorization: Bearer`.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .engine_api import Api, answer, generate
from .openapi import api_body, streamed

router = APIRouter(tags=["anthropic"])

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    """Anthropic's error object (`api_error` for any other status)."""
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def error_event(message: str, code: str = "stream_error", sent: int = 0, status: int = 500) -> str:
    return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"


API = Api(flag="anthropic", label="anthropic", error_event=error_event, error_body=error_body)


@router.post("/v1/messages", openapi_extra=api_body("messages"), responses=streamed())
async def create_message(request: Request) -> Response:
    """Anthropic Messages, streamed (SSE events) or not."""
    return await generate(request, API, "/v1/messages", "messages")


@router.post(
    "/v1/messages/count_tokens",
    openapi_extra=api_body("count_tokens"),
    responses=streamed(stream=False),
)
async def count_tokens(request: Request) -> Response:
    """Anthropic's token count of a Messages request (the rendered prompt's tokens)."""
    return await answer(request, API, "/v1/messages/count_tokens", "count_tokens")
