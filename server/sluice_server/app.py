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
from starlette.types import ASGIApp, Receive, Scope, Send

from .core.auth import KeyStore
from .core.errors import install_error_handlers
from .core.gate import Gate
from .core.metrics import Metrics
from .core.ratelimit import RateLimiter
from .core.services import Services
from .engine import Engine, open_engine
from .protocols import openai, openapi, playground, probes, token_sse, websocket
from .settings import Settings
from .transport.cors import install_cors
from .transport.prefix import PathPrefix

log = logging.getLogger(__name__)


class StampArrival:
    """Stamp each request with its arrival time: TTFT and e2e start here, at the edge."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            scope["sluice.t0"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_services(settings: Settings, engine: Engine | None) -> Services:
    keys = KeyStore.from_file(settings.api_key_file) if settings.api_key_file else None
    return Services(
        settings=settings,
        metrics=Metrics(settings.model_label),
        gate=Gate(settings.max_concurrent_streams),
        limiter=RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm),
        keys=keys,
        engine=engine,
    )


def build_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    svc = build_services(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            yield
            return
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
    for protocol in (probes, openai, token_sse, websocket, playground):
        app.include_router(protocol.router)
    openapi.install(app)
    install_cors(app, settings)
    if settings.root_path:
        app.add_middleware(PathPrefix, prefix=settings.root_path)
    app.add_middleware(StampArrival)
    return app
