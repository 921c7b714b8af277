"""The app factory: `build_app(settings, engine=None)`.

With no engine given, the lifespan opens one from settings and shuts it down in `finally`.
Tests pass one shared engine to many apps; the app then never shuts it down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from .core.auth import KeyStore
from .core.credentials import Credentials
from .core.errors import install_error_handlers
from .core.gate import Gate
from .core.identity import Plan
from .core.jwks import JwtVerifier
from .core.metrics import Metrics
from .core.ratelimit import Limiter, MemoryLimiter, RedisLimiter
from .core.reload import Reloader, Source
from .core.services import Services
from .engine import Engine, open_engine
from .protocols import openai, openapi, probes, token_sse, websocket
from .settings import Settings

log = logging.getLogger(__name__)


class StampArrival:
    """Stamp each request with its arrival time: TTFT and e2e start here, at the edge."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            scope["sluice.t0"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_limiter(settings: Settings, metrics: Metrics) -> Limiter:
    if settings.rate_limit_backend == "redis":
        assert settings.redis_url is not None  # Settings refuses redis without a URL
        return RedisLimiter(
            settings.redis_url.get_secret_value(), settings.model_label, metrics,
            settings.rate_limit_failure_mode, settings.redis_timeout_seconds,
        )  # fmt: skip
    return MemoryLimiter()


def load_credentials(settings: Settings) -> Credentials:
    """The key file and the JWKS file as they are now (ValueError/OSError when unusable)."""
    s = settings
    plan = Plan(s.rate_limit_rpm, s.rate_limit_tpm)
    keys = KeyStore.from_file(s.api_key_file, plan) if s.api_key_file else None
    verifier = None
    if s.jwt_jwks_file is not None:
        assert s.jwt_issuer and s.jwt_audience  # Settings refuses a JWKS without them
        verifier = JwtVerifier.from_file(s.jwt_jwks_file, s.jwt_issuer, s.jwt_audience,
                                         s.jwt_tenant_claim, plan)  # fmt: skip
    return Credentials(keys, verifier, plan)


def build_reloader(settings: Settings, svc: Services) -> Reloader | None:
    """Reload what `load_credentials` read when its file changes (mounted Secrets rotate)."""
    s, creds = settings, svc.credentials
    if not s.credentials_reload_seconds or not creds.enabled:
        return None
    sources = []
    if s.api_key_file is not None:
        path = s.api_key_file
        sources.append(Source(
            "api_keys", path, lambda: KeyStore.from_file(path, creds.plan),
            lambda keys: setattr(creds, "keys", keys),
            lambda keys: f"{len(keys)} keys, tenants {', '.join(sorted(keys.tenants))}",
        ))  # fmt: skip
    if s.jwt_jwks_file is not None:
        jwks = s.jwt_jwks_file
        sources.append(Source(
            "jwks", jwks,
            lambda: JwtVerifier.from_file(jwks, s.jwt_issuer or "", s.jwt_audience or "",
                                          s.jwt_tenant_claim, creds.plan),
            lambda verifier: setattr(creds, "jwt", verifier),
            lambda verifier: f"{len(verifier.keys)} signing keys",
        ))  # fmt: skip
    return Reloader(sources, svc.metrics, s.credentials_reload_seconds)


def build_services(settings: Settings, engine: Engine | None) -> Services:
    metrics = Metrics(settings.model_label)
    return Services(
        settings=settings,
        metrics=metrics,
        gate=Gate(settings.max_concurrent_streams),
        limiter=build_limiter(settings, metrics),
        credentials=load_credentials(settings),
        engine=engine,
    )


def build_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    svc = build_services(settings, engine)
    reloader = build_reloader(settings, svc)

    @asynccontextmanager
    async def serving_engine() -> AsyncIterator[None]:
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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(reloader.run()) if reloader else None
        try:
            async with serving_engine():
                yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await svc.limiter.close()

    app = FastAPI(title="Sluice streaming server", version="0.1.0", lifespan=lifespan)
    app.state.services = svc
    install_error_handlers(app, svc.metrics)
    for protocol in (probes, openai, token_sse, websocket):
        app.include_router(protocol.router)
    openapi.install(app, settings.model_label)
    app.add_middleware(StampArrival)
    return app
