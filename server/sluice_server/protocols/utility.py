"""vLLM's utility routes: `POST /tokenize`, `POST /detokenize`, `GET /version`.

Served with the OpenAI routes (`--protocols sse`), through vLLM's `ServingTokenization`
(the same tokenizer and chat template as generation), counted under the `openai` label.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .engine_api import Api, answer, gate
from .openapi import api_body, streamed

router = APIRouter(tags=["utility"])
API = Api(flag="sse", label="openai")


@router.post("/tokenize", openapi_extra=api_body("tokenize"), responses=streamed(stream=False))
async def tokenize(request: Request) -> Response:
    """Token ids (and count) of a prompt, or of chat messages rendered with the template."""
    return await answer(request, API, "/tokenize", "tokenize")


@router.post("/detokenize", openapi_extra=api_body("detokenize"), responses=streamed(stream=False))
async def detokenize(request: Request) -> Response:
    """The text of token ids."""
    return await answer(request, API, "/detokenize", "detokenize")


@router.get("/version", responses=streamed(stream=False))
async def version(request: Request) -> Response:
    """The version of the engine that renders the APIs (`{"version": ...}`)."""
    svc, _ = gate(request, API, "/version")
    engine = await svc.require_engine()
    return JSONResponse(engine.api.version())
