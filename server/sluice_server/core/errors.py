"""OpenAI-shaped errors, registered in one place.

Before the 200 every failure is `{"error": {"message", "type", "param", "code"}}` with the
right status, or the route's own API shape when it sets `request.state.error_body` (the
Anthropic routes); after the 200 it becomes an error event (core/streaming/events.py, in each
protocol's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .telemetry.metrics import Metrics

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """Raised anywhere before the response starts; becomes an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # rejection metric reason (auth, rate_limit, ...)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_")),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence per problem, e.g. `max_tokens: Input should be >= 1`."""
    parts, param = [], None
    for e in exc.errors():
        if isinstance(e, str):
            parts.append(e)
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        if e.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
        else:
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "Invalid request", param


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error before the 200 becomes the error object above; a refusal not counted
    yet is counted under the protocol the route set on `request.state.protocol`."""

    def shaped(
        request: Request,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> dict[str, Any]:
        """The route's API error shape (`request.state.error_body`), OpenAI's by default."""
        shape: Callable[..., dict[str, Any]] = (
            getattr(request.state, "error_body", None) or error_body
        )
        return shape(status, message, param, code)

    def count(request: Request, reason: str | None) -> None:
        protocol = getattr(request.state, "protocol", None)
        if reason is not None and protocol is not None:
            metrics.reject(protocol, reason)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count(request, exc.reason)
        return JSONResponse(
            shaped(request, exc.status, exc.message, exc.param, exc.code),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, "bad_input")
        message, param = describe_validation(exc)
        return JSONResponse(shaped(request, 400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette names only the first route of the path
            headers["Allow"] = ", ".join(allowed_methods(request))
        return JSONResponse(
            shaped(request, exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=headers,
        )


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path."""
    methods: set[str] = set()
    for route in request.app.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)
