"""OpenAI Responses: `POST /v1/responses`, streamed (`"stream": true`) or not.

vLLM's `OpenAIServingResponses` renders it (templates, parameters, the event sequence
`response.created` ... `response.completed`); `engine_api` adds Sluice's streaming
behaviour. After the 200 a failure is Responses' own `error` event (`type`, `code`,
`message`, `param`, `sequence_number` continuing the stream's numbering); the stream has
no `[DONE]`.

Not served: `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`. vLLM answers
them only from an in-process store (`VLLM_ENABLE_RESPONSES_API_STORE`, off by default,
never evicted, and per replica: behind a Service the next request lands on another pod), so
here every response is `store: false`, as in vLLM's default.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .engine_api import Api, generate
from .openapi import api_body, streamed

router = APIRouter(tags=["openai responses"])


def error_event(message: str, code: str = "stream_error", sent: int = 0, status: int = 500) -> str:
    data = {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sent,
    }
    return f"event: error\ndata: {json.dumps(data)}\n\n"


API = Api(flag="responses", label="responses", error_event=error_event)


@router.post("/v1/responses", openapi_extra=api_body("responses"), responses=streamed())
async def create_response(request: Request) -> Response:
    """OpenAI Responses, streamed (SSE events) or not."""
    return await generate(request, API, "/v1/responses", "responses")
