"""The app factory: `build_app(settings, engine=None)`.

With no engine given, the lifespan opens one from settings and shuts it down in `finally`.
Tests pass one shared engine to many apps; the app then never shuts it down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core.auth import KeyStore
from .core.errors import install_error_handlers
from .core.gate import Gate
from .core.metrics import Metrics
from .core.ratelimit import RateLimiter
from .core.services import Services
from .core.tracing import Tracing
from .core.trail import Recorder, new_request_id
from .engine import Engine, open_engine
from .protocols import openai, openapi, probes, token_sse, websocket
from .settings import Settings

log = logging.getLogger(__name__)


class Edge:
    """Where each request arrives: stamp its arrival time (TTFT and e2e start here), give it
    a request id, sent back as `X-Request-Id` on every response (HTTP, WebSocket handshake
    and refused handshake), and open its trail (core/trail.py), which is closed here for a
    request that no stream ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        t0 = scope["sluice.t0"] = time.perf_counter()
        rid = new_request_id()
        trail = scope["app"].state.services.recorder.open(
            rid, t0, scope.get("path", ""), scope.get("method", "WS"), scope.get("headers")
        )
        scope["sluice.trail"] = trail
        header = (b"x-request-id", rid.encode())

        async def stamped(message: Message) -> None:
            t = message["type"]
            if t in ("http.response.start", "websocket.http.response.start"):
                trail.status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            elif t == "websocket.accept":
                trail.status = 101
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        failed = True
        try:
            await self.app(scope, receive, stamped)
            failed = False
        finally:
            trail.close(failed)


def build_services(settings: Settings, engine: Engine | None) -> Services:
    keys = KeyStore.from_file(settings.api_key_file) if settings.api_key_file else None
    tracing = None
    if settings.otlp_traces_endpoint:
        tracing = Tracing(settings.otlp_traces_endpoint, settings.trace_sample_ratio,
                          settings.model_label)  # fmt: skip
    return Services(
        settings=settings,
        metrics=Metrics(settings.model_label),
        gate=Gate(settings.max_concurrent_streams),
        limiter=RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm),
        keys=keys,
        recorder=Recorder(
            settings.model_label, settings.access_log, settings.access_log_format, tracing
        ),  # fmt: skip
        engine=engine,
    )


def build_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    svc = build_services(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if engine is not None:
                yield
                return
            async with serving_engine():
                yield
        finally:
            if svc.recorder.tracing is not None:
                svc.recorder.tracing.shutdown()  # exports the spans still batched

    @asynccontextmanager
    async def serving_engine() -> AsyncIterator[None]:
        try:
            async with open_engine(settings) as opened:
                svc.engine = opened
                log.info("engine ready: %s (%s)", settings.model_label, settings.engine)
                try:
                    yield
                finally:
                    svc.engine = None
                    svc.engine_error = "engine shut down"
        except BaseException as e:
            svc.engine_error = f"engine failed: {type(e).__name__}: {e}"
            raise

    app = FastAPI(title="Sluice streaming server", version="0.1.0", lifespan=lifespan)
    app.state.services = svc
    install_error_handlers(app, svc.metrics)
    for protocol in (probes, openai, token_sse, websocket):
        app.include_router(protocol.router)
    openapi.install(app)
    app.add_middleware(Edge)
    return app
