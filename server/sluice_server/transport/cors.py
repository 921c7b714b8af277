"""Cross-origin access for browser pages on another origin: Starlette's `CORSMiddleware`
on every HTTP route (preflights, `Access-Control-*` headers, and the response headers a
page may read: `X-Request-Id`, `Retry-After`), plus the Origin check WebSocket upgrades
need (CORS does not cover WebSockets: a browser sends `Origin` and lets the server decide).

Off when `--cors-allowed-origins` is empty: then no CORS header is sent and browsers allow
same-origin pages only (a preflight gets 405, as for any unknown method).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from ..settings import Settings

EXPOSED_HEADERS = ("X-Request-Id", "Retry-After")
METHODS = ("GET", "POST")


def install_cors(app: Starlette, settings: Settings) -> None:
    """Add CORSMiddleware (outside the error handlers, so errors carry CORS headers too)
    when an allow-list is set."""
    if not settings.cors_allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.cors_allowed_origins,
        allow_methods=METHODS,
        allow_headers=settings.cors_allowed_headers,
        expose_headers=EXPOSED_HEADERS,
        max_age=settings.cors_max_age_seconds,
    )


def websocket_origin_allowed(settings: Settings, origin: str | None, host: str | None) -> bool:
    """May a WebSocket upgrade carrying `origin` proceed? Always with CORS off, without an
    Origin header (not a browser), or from the server's own origin (the playground);
    otherwise only from an allowed origin."""
    allowed = settings.cors_allowed_origins
    if not allowed or origin is None or "*" in allowed or origin in allowed:
        return True
    netloc = urlsplit(origin).netloc
    if host and (netloc == host or (":" not in host and urlsplit(origin).hostname == host)):
        return True
    return False
