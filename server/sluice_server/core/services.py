"""What the routes share, on `app.state.services`, behind one typed accessor."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from starlette.requests import HTTPConnection, Request

from ..engine.base import Engine
from ..settings import Settings
from .auth import KeyStore, authenticate, bearer
from .errors import ApiError
from .gate import Gate
from .metrics import Metrics
from .ratelimit import RateLimiter
from .recent import RecentStreams


@dataclass
class Services:
    settings: Settings
    metrics: Metrics
    gate: Gate
    limiter: RateLimiter
    keys: KeyStore | None
    engine: Engine | None = None
    engine_error: str | None = None
    recent: RecentStreams = field(default_factory=RecentStreams)

    async def require_engine(self) -> Engine:
        """The engine, or 503 when it is not loaded or has failed (then /ready is 503 too,
        and Kubernetes takes the pod out of rotation and restarts it via /health)."""
        engine = self.engine
        if engine is None:
            raise ApiError(503, self.engine_error or "Engine is not ready.",
                           code="engine_unavailable", headers={"Retry-After": "5"})  # fmt: skip
        try:
            await engine.check_health()
        except Exception as e:
            raise ApiError(503, f"Engine failed: {type(e).__name__}: {e}",
                           code="engine_unavailable", headers={"Retry-After": "5"}) from None  # fmt: skip
        return engine

    def require_protocol(self, protocol: str, path: str) -> None:
        if protocol not in self.settings.protocols:
            enabled = ",".join(self.settings.protocols) or "none"
            raise ApiError(
                404,
                f"{path} is not served here: protocol '{protocol}' is disabled "
                f"(--protocols={enabled}).",
                code="protocol_disabled",
            )

    def authorize(self, protocol: str, api_key: str | None) -> str:
        """The caller's key id, or 401 (counted)."""
        try:
            return authenticate(self.keys, api_key)
        except ApiError as e:
            raise self._counted(protocol, e) from None

    def admit(self, protocol: str, kid: str) -> None:
        """Rate limit, then a stream slot (429/503 with Retry-After, counted)."""
        try:
            if self.limiter.enabled:
                self.limiter.admit(kid)
            self.gate.admit()
        except ApiError as e:
            raise self._counted(protocol, e) from None

    def _counted(self, protocol: str, e: ApiError) -> ApiError:
        if e.reason:
            self.metrics.reject(protocol, e.reason)
            e.reason = None  # counted here; the exception handler must not count again
        return e

    def bad_input(self, protocol: str, message: str, param: str | None = None,
                  status: int = 400, code: str | None = None) -> ApiError:  # fmt: skip
        return self._counted(protocol, ApiError(status, message, reason="bad_input",
                                                param=param, code=code))  # fmt: skip

    def count(self, protocol: str, e: ApiError) -> ApiError:
        return self._counted(protocol, e)


def services(conn: HTTPConnection) -> Services:
    return conn.app.state.services


def received_at(conn: HTTPConnection) -> float:
    """When the request arrived (set by the timing middleware; now if absent)."""
    return conn.scope.get("sluice.t0") or time.perf_counter()


async def read_json(request: Request, svc: Services, protocol: str) -> dict:
    """Body within the size limit, parsed as a JSON object; OpenAI-style errors otherwise."""
    limit = svc.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise svc.bad_input(protocol, f"Request body too large (limit {limit} bytes).",
                            status=413, code="body_too_large")  # fmt: skip
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise svc.bad_input(protocol, f"Request body too large (limit {limit} bytes).",
                                status=413, code="body_too_large")  # fmt: skip
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise svc.bad_input(protocol, f"Invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise svc.bad_input(protocol, "Request body must be a JSON object.", code="invalid_json")
    return body


def api_key_of(conn: HTTPConnection, allow_query: bool = False) -> str | None:
    key = bearer(conn.headers.get("authorization"))
    if key is None and allow_query:
        key = conn.headers.get("x-api-key") or conn.query_params.get("api_key")
    return key
