"""OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

The engine renders OpenAI's wire format (`Engine.api`); `engine_api` adds Sluice's
streaming behaviour. After the 200 a failure is the same error object as before it, as
`event: error`, then `data: [DONE]` (the official SDK raises `APIError` on it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .engine_api import Api, gate, generate
from .openapi import api_body, streamed

router = APIRouter(tags=["openai"])


API = Api(flag="sse", label="openai")


@router.get("/v1/models", responses=streamed(stream=False))
async def list_models(request: Request) -> Response:
    """The served models (OpenAI's model list): the base and each Ready LoRA adapter, with
    the base as `parent`; a key or token limited to some names (`models=`) sees only those."""
    svc, who = gate(request, API, "/v1/models")
    engine = await svc.require_engine()
    return JSONResponse(svc.adapters.visible(await engine.api.models(), who))


@router.post("/v1/chat/completions", openapi_extra=api_body("chat"), responses=streamed())
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streamed (`"stream": true`, SSE) or not."""
    return await generate(request, API, "/v1/chat/completions", "chat")


@router.post("/v1/completions", openapi_extra=api_body("completion"), responses=streamed())
async def completions(request: Request) -> Response:
    """OpenAI (legacy) completions, streamed or not."""
    return await generate(request, API, "/v1/completions", "completion")
