"""What the routes share, on `app.state.services`, behind one typed accessor."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection, Request

from ..engine.base import Adapter, Engine
from ..settings import Settings
from .adapters import Adapters
from .auth.apikeys import bearer
from .auth.cachesalt import cache_salt_for
from .auth.credentials import Credentials
from .auth.identity import Principal
from .errors import ApiError
from .limits.queue import Ticket
from .limits.ratelimit import Limiter
from .limits.shared_memory import PodSeat
from .limits.slots import Gate
from .streaming.reconnects import RecentStreams
from .telemetry.accesslog import REJECTED, Recorder, Trail, new_request_id
from .telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client went away while its request waited in the queue (it left the queue)."""


@dataclass
class Services:
    settings: Settings
    metrics: Metrics
    gate: Gate
    limiter: Limiter
    credentials: Credentials
    recorder: Recorder
    adapters: Adapters
    engine: Engine | None = None
    engine_error: str | None = None
    pod: PodSeat | None = None  # this worker's seat when the pod runs several (--api-workers)
    _bills: set[asyncio.Task[None]] = field(default_factory=set)
    recent: RecentStreams = field(default_factory=RecentStreams)

    async def require_engine(self) -> Engine:
        """The engine, or 503 when it is not loaded or has failed (then /ready is 503 too,
        and Kubernetes takes the pod out of rotation and restarts it via /health)."""
        engine = self.engine
        if engine is None:
            raise ApiError(
                503,
                self.engine_error or "Engine is not ready.",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            )
        try:
            await engine.check_health()
        except Exception as e:
            raise ApiError(
                503,
                f"Engine failed: {type(e).__name__}: {e}",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        return engine

    def engine_priority(self, who: Principal) -> int:
        """The caller's class as the engine's priority (0: highest), with priority classes;
        0 without (the engine runs first come, first served)."""
        priorities = self.credentials.rules.priorities
        return priorities.rank(who.priority) if priorities.configured else 0

    def cache_salt(self, who: Principal, client_salt: str | None) -> str | None:
        """The `cache_salt` the engine hashes the caller's prompt with (auth/cachesalt.py):
        its tenant's, combined with the client's own (`client_salt`, already checked);
        with auth off there is one tenant and no salt of ours. Every generating route sets
        it on the request it hands the engine, as it does the priority."""
        return cache_salt_for(self.salting_tenant(who.tenant), client_salt, shared=False)

    def salting_tenant(self, tenant: str | None) -> str | None:
        """The tenant whose salt a caller's prompts get: None with auth off (one anonymous
        tenant) or with sharing across tenants on."""
        if not self.credentials.enabled or self.settings.share_prefix_cache_across_tenants:
            return None
        return tenant

    def require_protocol(self, protocol: str, path: str) -> None:
        if protocol not in self.settings.protocols:
            enabled = ",".join(self.settings.protocols) or "none"
            raise ApiError(
                404,
                f"{path} is not served here: protocol '{protocol}' is disabled "
                f"(--protocols={enabled}; on Kubernetes: the StreamingModel's "
                f"spec.streaming.protocols).",
                code="protocol_disabled",
            )

    def authorize(
        self, conn: HTTPConnection, protocol: str, allow_query: bool = False
    ) -> Principal:
        """The caller, or 401 (counted). Names the request's protocol (for the error
        handler's count and the access log) and its caller's id and tenant (never the key)."""
        conn.state.protocol = protocol
        trail = trail_of(conn)
        trail.protocol = protocol
        who = self.authenticate(protocol, api_key_of(conn, allow_query))
        trail.kid, trail.tenant = who.id, who.tenant
        return who

    def authenticate(self, protocol: str, presented: str | None) -> Principal:
        """The caller of a credential as the server knows it now, or 401 (counted). A
        WebSocket asks again for every generation it starts: a key a reload removed, or a
        token past its expiry, starts nothing more on a socket opened with it."""
        try:
            return self.credentials.authenticate(presented)
        except ApiError as e:
            raise self._counted(protocol, e) from None

    def route(self, trail: Trail, who: Principal, model: str | None) -> Adapter | None:
        """The LoRA adapter a request names in `model` (None: the base), or 404/403/503
        (counted). The request's metrics and access-log line carry the name from here on."""
        try:
            adapter = self.adapters.resolve(model, who)
        except ApiError as e:
            raise self._counted(trail.protocol or "", e) from None
        trail.model = adapter.name if adapter is not None else None
        return adapter

    async def admit(
        self,
        protocol: str,
        who: Principal,
        trail: Trail | None = None,
        continuation: bool = False,
    ) -> Ticket:
        """Drain and capacity first (no limiter call for a request refused anyway), then the
        rate limit; 429/503 with Retry-After, counted. The ticket holds a stream slot, or,
        with a queue, a place in it (`wait_admitted`); its release gives either back. A
        `continuation` (a stream another replica admitted) skips the rate limit: its tokens
        are charged when it ends, it is never refused for them."""
        try:
            ticket = self.gate.admit(who)
        except ApiError as e:
            raise self._counted(protocol, e) from None
        if trail is not None:
            trail.ticket = ticket
        if continuation:
            self.metrics.count_tenant_request(who.tenant, "continued")
            return ticket
        try:
            await self.admit_request(protocol, who)
        except BaseException:
            ticket.release()
            raise
        return ticket

    async def wait_admitted(
        self, request: Request, protocol: str, ticket: Ticket, commit_after: float | None
    ) -> bool:
        """Wait for a queued request's slot before its response starts: True once admitted;
        False when it still waits after `commit_after` seconds (a stream then commits to
        200 and waits in the stream core, with keep-alives). Refused: ApiError 429/503
        with Retry-After (counted). The client leaving: ClientGone, out of the queue; also
        when a slot reached it as it left (its connection already closed), so that slot
        goes to the next request waiting instead of to a stream nobody reads."""
        if not ticket.waiting or ticket.future is None:
            await self._refused_if(protocol, ticket)
            return True
        admitted = asyncio.shield(ticket.future)  # resolved when admitted or refused
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            done, _ = await asyncio.wait(
                (admitted, gone), timeout=commit_after, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            ticket.release()
            raise
        finally:
            gone.cancel()
            if not admitted.done():
                admitted.cancel()
        if gone in done or _closed(request):
            ticket.release()
            raise ClientGone
        if admitted in done:
            await self._refused_if(protocol, ticket)
            return True
        return False

    async def _refused_if(self, protocol: str, ticket: Ticket) -> None:
        try:
            await ticket.wait()
        except ApiError as e:
            raise self._counted(protocol, e) from None

    async def admit_request(self, protocol: str, who: Principal) -> None:
        """The caller's rate limit alone (also for routes that take no stream slot)."""
        if who.plan.enabled:
            try:
                await self.limiter.admit(who.id, who.plan)
            except ApiError as e:
                self.metrics.count_tenant_request(who.tenant, e.reason or "refused")
                log.info(
                    "refused: tenant=%s protocol=%s reason=%s retry_after=%s",
                    who.tenant,
                    protocol,
                    e.reason,
                    e.headers.get("Retry-After"),
                )
                raise self._counted(protocol, e) from None
        self.metrics.count_tenant_request(who.tenant, "admitted")

    def kv_transferred(self, direction: str, tokens: int | None) -> None:
        """Count prompt tokens handed to a decode pod (`out`) or received from a prefill
        (`in`): `sluice_kv_transfer_tokens_total` (core/kvtransfer.py)."""
        if tokens:
            role = self.settings.disaggregation_role or "none"
            self.metrics.kv_transfer.labels(self.metrics.model, role, direction).inc(tokens)

    def bill(self, who: Principal, tokens: int) -> None:
        """Charge tokens used when a stream ends (from its synchronous cleanup): the charge
        runs as its own task, held here until done."""
        if tokens <= 0:
            return
        self.metrics.count_tenant_tokens(who.tenant, tokens)
        if not who.plan.tpm:
            return
        task = asyncio.get_running_loop().create_task(self.limiter.charge(who.id, who.plan, tokens))
        self._bills.add(task)
        task.add_done_callback(self._bills.discard)

    def _counted(self, protocol: str, e: ApiError) -> ApiError:
        if e.reason:
            self.metrics.reject(protocol, e.reason)
            e.reason = None  # counted here; the exception handler must not count again
        return e

    def bad_input(
        self,
        protocol: str,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
    ) -> ApiError:
        return self._counted(
            protocol, ApiError(status, message, reason="bad_input", param=param, code=code)
        )

    def count(self, protocol: str, e: ApiError) -> ApiError:
        return self._counted(protocol, e)

    def refuse(self, trail: Trail, e: ApiError) -> ApiError:
        """A refusal that is no HTTP response (a WebSocket frame): counted, and the
        generation's trail ends as rejected with the status its error frame carries."""
        self._counted(trail.protocol or "", e)
        trail.end(REJECTED, e.status)
        return e


def _closed(conn: HTTPConnection) -> bool:
    """The connection is closed: its client left (the ASGI server may not have said so to
    the app yet). False where the server shows no transport (transport/sendwatch.py)."""
    transport = conn.scope.get("sluice.transport")
    return transport is not None and bool(transport.is_closing())


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def services(conn: HTTPConnection) -> Services:
    svc: Services = conn.app.state.services
    return svc


def trail_of(conn: HTTPConnection) -> Trail:
    """The request's trail (opened by the edge middleware; a fresh one if absent)."""
    trail = conn.scope.get("sluice.trail")
    if trail is None:
        trail = conn.scope["sluice.trail"] = services(conn).recorder.open(
            new_request_id(), received_at(conn), conn.url.path
        )
    return trail


def received_at(conn: HTTPConnection) -> float:
    """When the request arrived (set by the timing middleware; now if absent)."""
    return conn.scope.get("sluice.t0") or time.perf_counter()


async def read_json(request: Request, svc: Services, protocol: str) -> dict[str, Any]:
    """Body within the size limit, parsed as a JSON object; OpenAI-style errors otherwise."""
    limit = svc.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise svc.bad_input(
            protocol,
            f"Request body too large (limit {limit} bytes).",
            status=413,
            code="body_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise svc.bad_input(
                protocol,
                f"Request body too large (limit {limit} bytes).",
                status=413,
                code="body_too_large",
            )
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise svc.bad_input(protocol, f"Invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise svc.bad_input(protocol, "Request body must be a JSON object.", code="invalid_json")
    return body


def api_key_of(conn: HTTPConnection, allow_query: bool = False) -> str | None:
    """`Authorization: Bearer`, else `X-API-Key` (Anthropic's SDK sends that), else, where
    allowed, `?api_key=` (EventSource and browsers' WebSocket cannot set headers)."""
    key = bearer(conn.headers.get("authorization")) or conn.headers.get("x-api-key")
    if key is None and allow_query:
        key = conn.query_params.get("api_key")
    return key
