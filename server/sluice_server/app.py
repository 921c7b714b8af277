"""The app factory: `build_app(settings, engine=None, pod=None)`.

With no engine given, the lifespan opens one from settings and shuts it down in `finally`.
Tests pass one shared engine to many apps; the app then never shuts it down. A worker of
a pod with several (`--api-workers`) passes its seat (`core/limits/shared_memory.py`): admission and rate
limits then count for the whole pod, and the worker's readiness flag follows its engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core.adapters import Adapters
from .core.auth.apikeys import KeyStore
from .core.auth.cachesalt import CACHE_TENANT_HEADER, ROUTER_HEADER
from .core.auth.credentials import Credentials
from .core.auth.identity import CallerRules, Plan, Priorities
from .core.auth.jwks import JwtVerifier
from .core.auth.reload import Reloader, Source
from .core.errors import install_error_handlers
from .core.limits.queue import Admission
from .core.limits.ratelimit import Limiter, MemoryLimiter, RedisLimiter
from .core.limits.shared_memory import PodSeat, QueueShape
from .core.limits.slots import Gate
from .core.services import Services
from .core.telemetry.accesslog import Recorder, new_request_id
from .core.telemetry.metrics import Metrics
from .core.telemetry.tracing import Tracing
from .engine import Engine, open_engine
from .protocols import (
    anthropic,
    continue_entry,
    openai,
    openapi,
    playground,
    prefill_entry,
    prefix_cache,
    probes,
    responses,
    token_sse,
    utility,
    websocket,
)
from .settings import Settings
from .transport import handshake
from .transport.cors import install_cors
from .transport.prefix import PathPrefix
from .transport.sendwatch import transport_of

log = logging.getLogger(__name__)
_ROUTER_HEADER = ROUTER_HEADER.encode()
_TENANT_HEADER = CACHE_TENANT_HEADER.encode()


class Edge:
    """Where each request arrives: stamp its arrival time (TTFT and e2e start here), give it
    a request id, sent back as `X-Request-Id` on every response (HTTP, WebSocket handshake
    and refused handshake), and open its trail (core/telemetry/accesslog.py), which is closed here for a
    request that no stream ended."""

    def __init__(self, app: ASGIApp, worker: int | None = None) -> None:
        self.app = app
        # With several workers, `X-Sluice-Worker: <index>` says which one answered.
        self.extra = [(b"x-sluice-worker", str(worker).encode())] if worker is not None else []

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
        # The send as it reaches Edge (only Starlette's ServerErrorMiddleware is outside),
        # for a stream's body messages (SSE events, WebSocket frames) after its response
        # started: every middleware between here and the route only looks at the start
        # (status, headers), so each event skips their pass-through frames
        # (transport/sse.py, protocols/websocket.py).
        scope["sluice.send"] = send
        # The connection's transport: what the send watchdog watches (transport/sendwatch.py).
        scope["sluice.transport"] = transport_of(receive)

        extra = self.extra
        via_router = any(k == _ROUTER_HEADER for k, _ in scope["headers"])

        def stamps() -> list[tuple[bytes, bytes]]:
            if via_router:  # the tenant the caller's prompts are salted with, for placement
                tenant = scope["app"].state.services.salting_tenant(trail.tenant)
                if tenant is not None:
                    return [_request_id(trail), *extra, (_TENANT_HEADER, quote(tenant).encode())]
            return [_request_id(trail), *extra]

        async def stamped(message: Message) -> None:
            t = message["type"]
            if t in ("http.response.start", "websocket.http.response.start"):
                trail.status = message["status"]
                message["headers"] = [*message.get("headers", ()), *stamps()]
            elif t == "websocket.accept":
                trail.status = 101
                message["headers"] = [*message.get("headers", ()), *stamps()]
            elif t == "websocket.http.response.body" and not message.get("more_body"):
                handshake.refused()  # a refusal is an outcome (transport/handshake.py)
            await send(message)

        failed = True
        try:
            await self.app(scope, receive, stamped)
            failed = False
        finally:
            trail.close(failed)


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (vLLM, torch, transformers: over 600,000
    objects) out of the garbage collector's reach, as vLLM's own server does
    (`vllm.utils.gc_utils.freeze_gc_heap`). Otherwise, every so often while serving, a
    full collection walks all of them: measured 0.9 s on one core of our machines, a stall
    of every stream on the loop (the TTFT p99 tail at concurrency 64, docs/benchmarks.md).
    The router freezes its own (about 90,000 objects): unfrozen, a full collection while it
    relayed took 110-160 ms, frozen 14 ms (`python -m sluice_bench.router_hop`). Objects
    created later are collected as usual."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "start-up heap frozen: %d objects, collected in %.0f ms",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )


def _request_id(trail) -> tuple[bytes, bytes]:
    """Read when the response starts: a resumed token stream answers as the stream it
    continues (token_sse sets `trail.rid` to it)."""
    return (b"x-request-id", trail.rid.encode())


def build_limiter(settings: Settings, metrics: Metrics, pod: PodSeat | None = None) -> Limiter:
    if settings.rate_limit_backend == "redis":
        assert settings.redis_url is not None  # Settings refuses redis without a URL
        return RedisLimiter(
            settings.redis_url.get_secret_value(),
            settings.model_label,
            metrics,
            settings.rate_limit_failure_mode,
            settings.redis_timeout_seconds,
        )
    return MemoryLimiter(pod=pod.state if pod is not None and pod.limits else None)


def caller_rules(settings: Settings) -> CallerRules:
    """What key lines and JWTs are read against: the flags' plan, the priority classes
    (ValueError for a default that is no class) and --tenant-weights."""
    s = settings
    return CallerRules(
        Plan(s.rate_limit_rpm, s.rate_limit_tpm),
        Priorities(tuple(s.priority_classes), s.default_priority),
        dict(s.tenant_weights),
    )


def load_credentials(settings: Settings) -> Credentials:
    """The key file and the JWKS file as they are now (ValueError/OSError when unusable)."""
    s = settings
    rules = caller_rules(s)
    keys = KeyStore.from_file(s.api_key_file, rules) if s.api_key_file else None
    verifier = None
    if s.jwt_jwks_file is not None:
        assert s.jwt_issuer and s.jwt_audience  # Settings refuses a JWKS without them
        verifier = JwtVerifier.from_file(
            s.jwt_jwks_file,
            s.jwt_issuer,
            s.jwt_audience,
            s.jwt_tenant_claim,
            rules,
            s.jwt_priority_claim,
        )
    return Credentials(keys, verifier, rules)


def build_reloader(settings: Settings, svc: Services) -> Reloader | None:
    """Reload what `load_credentials` read when its file changes (mounted Secrets rotate)."""
    s, creds = settings, svc.credentials
    if not s.credentials_reload_seconds or not creds.enabled:
        return None
    sources: list[Source[Any]] = []
    if s.api_key_file is not None:
        path = s.api_key_file
        sources.append(
            Source(
                "api_keys",
                path,
                lambda: KeyStore.from_file(path, creds.rules),
                lambda keys: setattr(creds, "keys", keys),
                lambda keys: f"{len(keys)} keys, tenants {', '.join(sorted(keys.tenants))}",
            )
        )
    if s.jwt_jwks_file is not None:
        jwks = s.jwt_jwks_file
        sources.append(
            Source(
                "jwks",
                jwks,
                lambda: JwtVerifier.from_file(
                    jwks,
                    s.jwt_issuer or "",
                    s.jwt_audience or "",
                    s.jwt_tenant_claim,
                    creds.rules,
                    s.jwt_priority_claim,
                ),
                lambda verifier: setattr(creds, "jwt", verifier),
                lambda verifier: f"{len(verifier.keys)} signing keys",
            )
        )
    reloads, model = svc.metrics.credential_reloads, svc.metrics.model
    return Reloader(
        sources,
        lambda name, result: reloads.labels(model, name, result).inc(),
        s.credentials_reload_seconds,
    )


def build_queue(settings: Settings, metrics: Metrics, pod: PodSeat | None) -> Admission | None:
    """The admission queue (`--queue-size`): the pod's, in its shared memory, when the
    worker has a seat; else this process's own."""
    shape = QueueShape.of(settings)
    if shape is None:
        return None
    priorities = caller_rules(settings).priorities
    metrics.queue_classes(priorities.names)
    kw: dict[str, Any] = dict(
        timeout=settings.queue_timeout,
        priorities=priorities,
        metrics=metrics,
        sharing=settings.queue_slot_sharing,
        window=settings.fair_share_window_seconds,
    )
    queue = pod.state.queue if pod is not None else None
    if pod is not None and queue is not None:
        return Admission(queue, pod.state.lock, pod.index, wake=pod.state.wake, **kw)
    return Admission.local(shape, **kw)


def build_services(
    settings: Settings, engine: Engine | None, pod: PodSeat | None = None
) -> Services:
    metrics = Metrics(settings.model_label)
    metrics.engine_group(settings.nnodes, settings.node_rank)
    tracing = None
    if settings.otlp_traces_endpoint:
        tracing = Tracing(
            settings.otlp_traces_endpoint, settings.trace_sample_ratio, settings.model_label
        )
    return Services(
        settings=settings,
        metrics=metrics,
        gate=Gate(settings.max_concurrent_streams, pod, build_queue(settings, metrics, pod)),
        limiter=build_limiter(settings, metrics, pod),
        credentials=load_credentials(settings),
        recorder=Recorder(
            settings.model_label,
            settings.access_log,
            settings.access_log_format,
            tracing,
            priorities=bool(settings.priority_classes),
        ),
        adapters=Adapters(
            settings.model_label, metrics, settings.adapters_file, settings.adapters_reload_seconds
        ),
        engine=engine,
        pod=pod,
    )


def build_app(
    settings: Settings,
    engine: Engine | None = None,
    pod: PodSeat | None = None,
    engine_options: dict | None = None,
) -> FastAPI:
    """`engine_options` go to `open_engine` (a vLLM worker's connection to the pod's
    shared engine core)."""
    svc = build_services(settings, engine, pod)
    reloader = build_reloader(settings, svc)

    @asynccontextmanager
    async def serving_engine() -> AsyncIterator[None]:
        if engine is not None:
            await svc.adapters.start(engine)
            yield
            return
        try:
            async with open_engine(settings, **(engine_options or {})) as opened:
                svc.engine = opened
                log.info("engine ready: %s (%s)", settings.model_label, settings.engine)
                # The current adapter list before ready: a restarted pod serves it at once.
                await svc.adapters.start(opened)
                freeze_startup_heap()
                if pod is not None:
                    pod.set_ready(True)
                try:
                    yield
                finally:
                    if pod is not None:
                        pod.set_ready(False)
                    svc.engine = None
                    svc.engine_error = "engine shut down"
        except BaseException as e:
            svc.engine_error = f"engine failed: {type(e).__name__}: {e}"
            raise

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(reloader.run()) if reloader else None
        adapters = None
        try:
            async with serving_engine():
                if settings.adapters_file is not None:
                    adapters = asyncio.create_task(svc.adapters.run())
                yield
        finally:
            for task in (watcher, adapters):
                if task is not None:
                    task.cancel()
            await svc.limiter.close()
            if svc.recorder.tracing is not None:
                svc.recorder.tracing.shutdown()  # exports the spans still batched

    app = FastAPI(title="Sluice streaming server", version="0.1.0", lifespan=lifespan)
    app.state.services = svc
    install_error_handlers(app, svc.metrics)
    for protocol in (
        probes,
        prefix_cache,
        openai,
        responses,
        anthropic,
        utility,
        token_sse,
        websocket,
        playground,
    ):
        app.include_router(protocol.router)
    openapi.install(app, settings.model_label)
    install_cors(app, settings)
    if settings.root_path:
        app.add_middleware(PathPrefix, prefix=settings.root_path)
    app.add_middleware(
        prefill_entry.PrefillEntry,
        key_file=settings.continuation_key_file,
        role=settings.disaggregation_role,
        max_body_bytes=settings.max_body_bytes,
        root_path=settings.root_path,
    )
    app.add_middleware(
        continue_entry.ContinueEntry,
        key_file=settings.continuation_key_file,
        max_body_bytes=settings.max_body_bytes,
        root_path=settings.root_path,
    )
    app.add_middleware(Edge, worker=pod.index if pod is not None else None)
    return app
