"""How a router hashes this model's prompts: `GET /internal/prefix-cache` and the tokenizer
files at `GET /internal/prefix-cache/files/{name}`.

For a router that places requests by the KV cache its pods hold (vLLM's block hashes): it
runs in another namespace, without the model's volumes or Hub token, so the pod tells it the
engine's block size, hash algorithm, NONE_HASH seed, loaded adapters and tokenizer (the JSON
shape is in `kvcache/describe.py`). No API key, as for the probes: nothing here is secret
(tokenizer files, a chat template and hashing parameters are what a model's public
repository ships; adapter paths are folders inside the pod), and a router has no key. Not
in the OpenAPI document: it is for routers, not clients. Served only with
`--describe-prefix-cache` (the operator sets it on models the router places, whose public
route goes to the router, which forwards no `/internal/` path): elsewhere a 404 says so.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ..core.services import services
from ..kvcache.describe import TOKENIZER_FILES

router = APIRouter(tags=["internal"], include_in_schema=False)
PATH = "/internal/prefix-cache"


OFF = (
    f"{PATH} is not served here: start the server with --describe-prefix-cache (the "
    "operator sets it on models routed by the Sluice router: spec.routing.router.enabled)."
)


def _described(request: Request) -> tuple[dict[str, Any], Any] | None:
    engine = services(request).engine
    describe = getattr(engine, "prefix_cache", None)
    return None if describe is None else describe()


@router.get(PATH)
async def prefix_cache(request: Request) -> Response:
    """The engine's prefix-cache hashing parameters and tokenizer (503 while loading)."""
    if not services(request).settings.describe_prefix_cache:
        return JSONResponse({"error": OFF}, status_code=404)
    described = _described(request)
    if described is None:
        return JSONResponse({"error": "the engine is not loaded"}, status_code=503)
    return JSONResponse(described[0])


@router.get(PATH + "/files/{name}")
async def tokenizer_file(request: Request, name: str) -> Response:
    """One of the tokenizer files the description lists (only those names)."""
    if not services(request).settings.describe_prefix_cache:
        return JSONResponse({"error": OFF}, status_code=404)
    described = _described(request)
    if described is None:
        return JSONResponse({"error": "the engine is not loaded"}, status_code=503)
    desc, folder = described
    if folder is None or name not in TOKENIZER_FILES or name not in desc["tokenizer"]["files"]:
        return JSONResponse({"error": f"no tokenizer file {name!r}"}, status_code=404)
    return FileResponse(folder / name, media_type="application/octet-stream")
