"""Serving under a path prefix (`--root-path /mistral`): the Ingress publishes the model at
`/mistral/...` without rewriting, and the server answers both `/mistral/v1/...` (through
the Ingress) and `/v1/...` (probes and in-cluster clients on the pod or Service).

A request under the prefix gets `root_path` set in its ASGI scope; Starlette's router then
matches the rest of the path, and what builds links from `root_path` (the OpenAPI page,
the playground) includes the prefix. Other requests pass unchanged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class PathPrefix:
    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app, self.prefix = app, prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prefix = self.prefix
        if scope["type"] in ("http", "websocket"):
            path = scope["path"]
            if path == prefix or path.startswith(prefix + "/"):
                scope = {**scope, "root_path": scope.get("root_path", "") + prefix}
        await self.app(scope, receive, send)
