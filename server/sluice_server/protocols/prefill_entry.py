"""`POST /internal/prefill`: run a request's prompt on this prefill pod for a decode pod
(disaggregated serving: docs/disaggregation.md; the mechanism in core/kvtransfer.py).

Only the Sluice router calls it, with the model's key in `X-Sluice-Continuation-Key`, as
for `/internal/continue` (no `--continuation-key-file`: 404; no key: 401; another key:
403), and only a prefill pod serves it (`--disaggregation-role prefill`; else 404). The
body names the original request, `{"method": "POST", "path": "/v1/chat/completions",
"body": {...}}`; it carries the client's own credential in the forwarded headers, which
the original route authenticates as it would the request itself.

The entry re-enters the original route with the request marked as a prefill: the route
validates it as sent (a refusal in that protocol's own error shape, which the router
relays to the client as is), runs its prompt for one output token with the connector's
`do_remote_decode` params, and answers `{"kv_transfer_params": ..., "prompt_tokens": N}`.
One path for every protocol, as continuations have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.auth.routerkey import KEY_HEADER, key_refusal
from ..core.kvtransfer import PREFILL_KEY, PREFILLABLE, Role
from ..core.params import describe_validation_error
from .reentry import Original, error, read_body, reentered, replay, route_of

PATH = "/internal/prefill"


class PrefillBody(BaseModel):
    """A remote prefill as the router sends it."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["POST"] = "POST"
    path: str = Field(description="The original path: a generating route.")
    body: dict[str, Any] = Field(description="The original JSON body.")


class PrefillEntry:
    """ASGI middleware in front of the routes: answers `POST /internal/prefill` itself
    when it is refused, else re-enters the app with the original request."""

    def __init__(
        self,
        app: ASGIApp,
        key_file: Path | None,
        role: Role | None,
        max_body_bytes: int,
        root_path: str = "",
    ) -> None:
        self.app, self.key_file, self.role, self.root_path = app, key_file, role, root_path
        self.limit = max_body_bytes + 4096  # the original body in its envelope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        answer = self._refused(scope)
        if answer is None:
            raw, answer = await read_body(receive, self.limit)
            if answer is None:
                checked = _checked(raw, self.root_path)
                if isinstance(checked, Original):
                    reentry = reentered(scope, PREFILL_KEY, True, checked)
                    await self.app(reentry, replay(checked.body, receive), send)
                    return
                answer = checked
        await answer(scope, receive, send)

    def _refused(self, scope: Scope) -> JSONResponse | None:
        if self.key_file is None or self.role != "prefill":
            why = (
                f"{PATH} is served by prefill pods only (--disaggregation-role prefill with "
                "--continuation-key-file; the operator sets both on a disaggregated model's "
                "prefill pool)."
            )
            return error(404, why, None, "not_found")
        if scope["method"] != "POST":
            return error(405, f"{PATH} takes POST.", None, "method_not_allowed")
        given = next((v for k, v in scope["headers"] if k == KEY_HEADER), None)
        refusal = key_refusal(self.key_file, given)
        return None if refusal is None else error(*refusal, None, None)


def _checked(raw: Any, root_path: str) -> Original | JSONResponse:
    try:
        p = PrefillBody.model_validate(raw)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        return error(422, message, param, "invalid_prefill")
    path = route_of(p.path, root_path)
    if path not in PREFILLABLE:
        return error(
            422, f"path: {p.path!r} cannot be prefilled; the generating routes "
            f"{', '.join(PREFILLABLE)} can.", "path", "not_prefillable",
        )  # fmt: skip
    return Original("POST", path, "", json.dumps(p.body).encode())
