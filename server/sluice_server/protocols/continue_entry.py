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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.auth.routerkey import KEY_HEADER, key_refusal
from ..core.errors import error_body
from ..core.params import describe_validation_error
from ..core.streaming.continuation import CONTINUABLE, SCOPE_KEY, Continuation, not_continuable

PATH = "/internal/continue"
OFF = (
    f"{PATH} is not served here: start the server with --continuation-key-file (the "
    "operator sets it on models routed by the Sluice router)."
)
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
# Headers of the continuation request that do not go to the original route.
_DROPPED = frozenset({b"content-length", b"content-type", KEY_HEADER, b"last-event-id"})


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

    def __init__(self, app: ASGIApp, key_file: Path | None, max_body_bytes: int) -> None:
        self.app, self.key_file = app, key_file
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
        checked = _checked(body)
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
            return _error(405, f"{PATH} takes POST.", None, "method_not_allowed")
        given = next((v for k, v in scope["headers"] if k == KEY_HEADER), None)
        refusal = key_refusal(self.key_file, given)
        return None if refusal is None else _error(*refusal, None, None)


async def read_body(receive: Receive, limit: int) -> tuple[Any, JSONResponse | None]:
    """An internal entry's JSON body, or the refusal to answer with."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, _error(400, "The router left before the body arrived.", None, None)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None, _error(413, f"Body over {limit} bytes.", None, "body_too_large")
        more = message.get("more_body", False)
    try:
        return json.loads(b"".join(chunks)), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, _error(400, f"Invalid JSON body: {e}", None, "invalid_json")


class Original:
    __slots__ = ("method", "path", "query", "body")

    def __init__(self, method: str, path: str, query: str, body: bytes) -> None:
        self.method, self.path, self.query, self.body = method, path, query, body


def _checked(raw: Any) -> tuple[Continuation, Original] | JSONResponse:
    """The continuation and the original request, or a 422 saying what cannot be continued."""
    try:
        c = ContinueBody.model_validate(raw)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        return _error(422, message, param, "invalid_continuation")
    url = urlsplit(c.path)
    if url.path not in CONTINUABLE:
        return _error(
            422, f"path: {url.path!r} cannot be continued; streamed generations on "
            f"{', '.join(CONTINUABLE)} can.", "path", "not_continuable",
        )  # fmt: skip
    if (c.method == "GET") != (c.body is None) or (c.method == "GET" and url.path != "/v1/stream"):
        return _error(
            422, "A GET continues `/v1/stream?...` (its query in `path`, no `body`); a POST "
            "carries the original JSON `body`.", "body", "invalid_continuation",
        )  # fmt: skip
    fields = c.body if c.body is not None else {}
    problem = not_continuable(url.path, fields, len(c.token_ids))
    if problem is not None:
        return _error(422, problem[1], problem[0], "not_continuable")
    body = json.dumps(c.body).encode() if c.body is not None else b""
    cont = Continuation(list(c.token_ids), c.next_event, c.response_id, c.created)
    return cont, Original(c.method, url.path, url.query, body)


def reentered(scope: Scope, key: str, value: Any, original: Original) -> Scope:
    """The original request's scope, marked with `key` (what the route reads), without the
    internal request's own headers."""
    headers = [(k, v) for k, v in scope["headers"] if k not in _DROPPED]
    if original.method == "POST":
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(original.body)).encode())]  # fmt: skip
    return {
        **scope,
        "method": original.method,
        "path": original.path,
        "raw_path": original.path.encode(),
        "query_string": original.query.encode(),
        "headers": headers,
        key: value,
    }


def replay(body: bytes, receive: Receive) -> Receive:
    """The original body once, then the continuation request's own messages (its
    disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _error(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status)
