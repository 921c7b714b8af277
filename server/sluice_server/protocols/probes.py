"""Liveness, readiness and metrics: no auth, not counted in request metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..core.services import services
from ..core.telemetry.metrics import exposition
from ..engine.base import Engine
from .openapi import METRICS

router = APIRouter(tags=["probes"])


async def _engine_ok(request: Request) -> tuple[bool, str]:
    """The engine's verdict, also kept in `sluice_engine_group_up`: on several nodes vLLM
    opens the engine only once every node's workers joined it."""
    svc = services(request)
    ok, why = await _engine_check(svc.engine, svc.engine_error)
    svc.metrics.engine_up(ok)
    return ok, why


async def _engine_check(engine: Engine | None, error: str | None) -> tuple[bool, str]:
    if engine is None:
        return False, error or "engine not loaded"
    try:
        await engine.check_health()
    except Exception as e:
        return False, f"engine unhealthy: {type(e).__name__}: {e}"
    return True, "ok"


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness: the process answers and the engine (once loaded) is alive."""
    svc = services(request)
    ok, why = await _engine_ok(request)
    if not ok and svc.engine is None and svc.engine_error is None:
        ok = True  # still loading: alive, just not ready
    return JSONResponse({"status": "ok" if ok else why}, status_code=200 if ok else 503)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: engine loaded and healthy, and not draining; with several workers, every
    worker of the pod too (a pod with a worker still starting, draining or dead is not ready,
    whichever worker answers)."""
    svc = services(request)
    ok, why = await _engine_ok(request)
    if ok and svc.gate.draining:
        ok, why = False, "draining"
    if ok and svc.pod is not None and (waiting := svc.pod.waiting_for()):
        ok, why = False, f"workers not ready: {', '.join(map(str, waiting))}"
    return JSONResponse({"status": "ready" if ok else why}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses=METRICS)
async def metrics(request: Request) -> Response:
    """Our `sluice_*` metrics, then the process-wide default registry: process/GC metrics
    and, on vLLM, the engine's own `vllm:*` metrics (KV cache use, running/waiting); with
    several workers, the pod's sums over all of them (`core/telemetry/metrics.py`); the engine's
    health is checked first, for `sluice_engine_group_up`."""
    await _engine_ok(request)
    return Response(exposition(services(request).metrics), media_type=CONTENT_TYPE_LATEST)
