"""`POST /internal/continue`: continue on this replica a stream another replica started
(the contract is in docs/migration.md; the mechanism in core/streaming/continuation.py).

Only the Sluice router calls it, with the key of `--continuation-key-file` in
`X-Sluice-Continuation-Key` (unset: 404, as every `/internal/` route not enabled; no key:
401; another key: 403). The caller is not named in the body: the continuation carries the
client's own credential (`Authorization`, `X-API-Key`, or `?api_key=` in a GET path) as
the client sent it to the router, and the pod authenticates it as it did the first time,
so tenant, priority class, quotas, adapter access and `cache_salt` are the caller's, and
the key lets its holder act only as callers whose credentials it holds, which the router
already sees on every request it relays.

The entry checks the continuation (a 400 or 422 that says what to change) and hands the
original request, marked with its `Continuation`, to the original route, which streams
the rest in its own protocol: one path for every protocol.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.auth.routerkey import KEY_HEADER, key_refusal
from ..core.errors import error_body
from ..core.params import describe_validation_error
from ..core.streaming.continuation import CONTINUABLE, SCOPE_KEY, Continuation, not_continuable
from .reentry import Original, error, read_body, reentered, replay, route_of

PATH = "/internal/continue"
OFF = (
    f"{PATH} is not served here: start the server with --continuation-key-file (the "
    "operator sets it on models routed by the Sluice router)."
)
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class ContinueBody(BaseModel):
    """A continuation as the router sends it."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["POST", "GET"] = "POST"
    path: str = Field(description="The original path (with its query string for a GET).")
    body: dict[str, Any] | None = Field(None, description="The original JSON body (POST).")
    token_ids: list[TokenId] = Field(description="The output token ids the client received.")
    next_event: int = Field(ge=0, description="The index of the next SSE event to send.")
    response_id: str = Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    created: int | None = Field(None, ge=0)


class ContinueEntry:
    """ASGI middleware in front of the routes: answers `POST /internal/continue` itself
    when the continuation is refused, else re-enters the app with the original request."""

    def __init__(
        self, app: ASGIApp, key_file: Path | None, max_body_bytes: int, root_path: str = ""
    ) -> None:
        self.app, self.key_file, self.root_path = app, key_file, root_path
        self.limit = max_body_bytes + 2**20  # the original body plus the token ids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        refused = self._refused(scope)
        if refused is None:
            body, refused = await read_body(receive, self.limit)
        if refused is not None:
            await refused(scope, receive, send)
            return
        checked = _checked(body, self.root_path)
        if isinstance(checked, JSONResponse):
            await checked(scope, receive, send)
            return
        cont, original = checked
        await self.app(
            reentered(scope, SCOPE_KEY, cont, original), replay(original.body, receive), send
        )

    def _refused(self, scope: Scope) -> JSONResponse | None:
        if self.key_file is None:
            return JSONResponse(error_body(404, OFF, code="not_found"), 404)
        if scope["method"] != "POST":
            return error(405, f"{PATH} takes POST.", None, "method_not_allowed")
        given = next((v for k, v in scope["headers"] if k == KEY_HEADER), None)
        refusal = key_refusal(self.key_file, given)
        return None if refusal is None else error(*refusal, None, None)


def _checked(raw: Any, root_path: str) -> tuple[Continuation, Original] | JSONResponse:
    """The continuation and the original request, or a 422 saying what cannot be continued."""
    try:
        c = ContinueBody.model_validate(raw)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        return error(422, message, param, "invalid_continuation")
    url = urlsplit(c.path)
    url = url._replace(path=route_of(url.path, root_path))
    if url.path not in CONTINUABLE:
        return error(
            422, f"path: {url.path!r} cannot be continued; streamed generations on "
            f"{', '.join(CONTINUABLE)} can.", "path", "not_continuable",
        )  # fmt: skip
    if (c.method == "GET") != (c.body is None) or (c.method == "GET" and url.path != "/v1/stream"):
        return error(
            422, "A GET continues `/v1/stream?...` (its query in `path`, no `body`); a POST "
            "carries the original JSON `body`.", "body", "invalid_continuation",
        )  # fmt: skip
    fields = c.body if c.body is not None else {}
    problem = not_continuable(url.path, fields, len(c.token_ids))
    if problem is not None:
        return error(422, problem[1], problem[0], "not_continuable")
    body = json.dumps(c.body).encode() if c.body is not None else b""
    cont = Continuation(list(c.token_ids), c.next_event, c.response_id, c.created)
    return cont, Original(c.method, url.path, url.query, body)
