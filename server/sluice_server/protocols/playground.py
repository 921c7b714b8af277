"""`GET /playground`: one self-contained page (no build step, no CDN) to try the model from
a browser: chat over EventSource (`/v1/stream`), over `fetch()` streaming of
`/v1/chat/completions`, and over the WebSocket with a Stop button, with live TTFT and
tokens/s. Its URLs are relative, so it works under a path prefix. `--playground false`
turns it off (404). The page needs no key; the calls it makes do.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from ..core.errors import ApiError
from ..core.services import services

router = APIRouter(tags=["playground"])
# Scripts and styles are inline; the page may talk to its own origin only.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'"
)


@cache
def page() -> str:
    return files(__package__).joinpath("playground.html").read_text(encoding="utf-8")


@router.get("/playground", include_in_schema=False)
async def playground(request: Request) -> Response:
    if not services(request).settings.playground:
        raise ApiError(404, "The playground is off (--playground false).", code="not_found")
    return HTMLResponse(
        page(), headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}
    )
