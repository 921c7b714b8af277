"""Re-entering a route with an internal request's original request (the router's
`/internal/continue` and `/internal/prefill`): the entry reads its JSON envelope, then
hands the app the original method, path, headers and body, with a mark in the ASGI scope
that tells the route what the request is (a continuation, a prefill)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope

from ..core.auth.routerkey import KEY_HEADER
from ..core.errors import error_body

# Headers of the internal request that do not go to the original route.
_DROPPED = frozenset({b"content-length", b"content-type", KEY_HEADER, b"last-event-id"})


async def read_body(receive: Receive, limit: int) -> tuple[Any, JSONResponse | None]:
    """An internal entry's JSON body, or the refusal to answer with."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, error(400, "The router left before the body arrived.", None, None)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None, error(413, f"Body over {limit} bytes.", None, "body_too_large")
        more = message.get("more_body", False)
    try:
        return json.loads(b"".join(chunks)), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, error(400, f"Invalid JSON body: {e}", None, "invalid_json")


def route_of(path: str, root_path: str) -> str:
    """The route an original path names, without the server's `--root-path`: the router
    sends the client's path as it came through an Ingress that publishes the model under
    that prefix (the server answers both, transport/prefix.py)."""
    prefix = root_path.rstrip("/")
    if prefix and (path == prefix or path.startswith(prefix + "/")):
        return path[len(prefix) :] or "/"
    return path


class Original:
    __slots__ = ("method", "path", "query", "body")

    def __init__(self, method: str, path: str, query: str, body: bytes) -> None:
        self.method, self.path, self.query, self.body = method, path, query, body


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
    """The original body once, then the internal request's own messages (its
    disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def error(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status)
