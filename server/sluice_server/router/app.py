"""The router's ASGI app: find the model a request is for, then hold and forward it
(proxy.py, relay.py); its own `/health`, `/ready` and `/metrics` for requests that name no
model.

A request names its model by Host or `X-Sluice-Model` (models.py); one that names none in
the models file gets 404 `model_not_found` (a WebSocket: its handshake refused with 404),
except the router's own three routes. A request naming a model with a `split` (the owner
of versions) goes to the version its conversation is keyed to (split.py): the router reads
its body first (within `--max-body-bytes`) to find the session key, and from then on it is
that version's request (its hold, placement and migration); a `Last-Event-ID` resume goes
back to the version its `sluice-pin` cookie was signed for. The models file is watched the way the server
watches its key file (core/auth/reload.py): a changed file is loaded and swapped in, a bad
one is refused and the models loaded before stay; the pin key file likewise (pin.py
`rotate`: the key before stays honoured). Requests already held keep the entry
they were held under (a changed split moves only new requests: a stream keeps its version); each model's held count, readiness and in-flight requests per pod
live in one `Upstream`, which a changed entry replaces keeping the callers' tenants it
learned and its requests in flight per pod. The Pods of the models with `pods` are watched
from start-up (and from the reload that adds them) until no model names them (pods.py),
and each such model has one `PodView` (podview.py: its prefix index, KV-event feeds and
scraped loads) and one `ModelHasher` (hashers.py: its prompt hasher, fetched from its pods)
from then until its entry's `pods` changes or it leaves the file; a disaggregated model's
prefill pool has its own Pod watch, `PodView` and `ModelHasher`, and its decode pool (placed
by load) no hasher. Prompts are hashed on one
thread of the router's own (upstream.py); a router built with another `HashesFor` uses
that instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from ..core.auth.reload import Reloader, Source
from ..core.errors import error_body
from ..settings import RouterSettings
from ..transport.sendwatch import transport_of
from . import proxy, relay, split
from .hashers import ModelHasher
from .hashes import HashesFor, PromptHashes
from .hop import Relay, hop_client
from .metrics import RouterMetrics
from .models import MODEL_HEADER, Model, Models, load
from .pin import Pins, read_key
from .placement import Scoring
from .pods import ApiServer, PodWatches
from .podview import PodView
from .upstream import Closing, Upstream

log = logging.getLogger(__name__)
OWN_ROUTES = ("/health", "/ready", "/metrics")


def scoring(s: RouterSettings) -> Scoring:
    return Scoring(
        prefix_weight=s.prefix_weight,
        queue_weight=s.queue_weight,
        kv_weight=s.kv_use_weight,
        in_flight_weight=s.in_flight_weight,
        waiting_max=s.saturation_waiting,
        kv_use_max=s.saturation_kv_use,
        guard=s.saturation_guard,
        stale_after_s=s.load_stale_seconds,
    )


class Router:
    def __init__(self, settings: RouterSettings, hashes: HashesFor | None = None) -> None:
        self.settings = settings
        # Each model's prompt-hash provider (hashes.py); by default its pods' (hashers.py).
        self.hashes: HashesFor = self.hasher if hashes is None else hashes
        self.metrics = RouterMetrics()
        self.upstreams: dict[str, Upstream] = {}
        self.views: dict[str, PodView] = {}
        self.hashers: dict[str, ModelHasher] = {}
        self.hashing = ThreadPoolExecutor(1, thread_name_prefix="sluice-prompt-hashes")
        self.cache_dir: Path | None = settings.prefix_hasher_cache_dir
        self._own_cache_dir = False
        self.client: httpx.AsyncClient | None = None  # polls, descriptions
        self.scrapes: httpx.AsyncClient | None = None  # the pods' /metrics (hop.py's transport)
        self.relay: Relay | None = None  # forwarded requests (hop.py)
        self.closing = Closing()
        api = ApiServer.find(settings.kube_api_url, settings.service_account_dir)
        self.pods = PodWatches(api, settings.connect_timeout_seconds)
        self.pins = (
            None
            if settings.pin_key_file is None
            else Pins.load(settings.pin_key_file, settings.pin_seconds)
        )
        self.started = False
        try:
            models = load(settings.models_file)
        except (OSError, ValueError) as e:
            log.warning(
                "models: %s cannot be used (%s: %s); no models until it can",
                settings.models_file,
                type(e).__name__,
                e,
            )
            models = Models([])
        self.apply(models)
        path = settings.models_file
        sources: list[Source[Any]] = [
            Source("models", path, lambda: load(path), self.apply, _describe)
        ]
        key_file, pins = settings.pin_key_file, self.pins
        if key_file is not None and pins is not None:  # a rotated Secret: no restart needed
            sources.append(
                Source("pin_key", key_file, lambda: read_key(key_file), pins.rotate,
                       lambda key: "signing with the new key, honouring the one before")
            )  # fmt: skip
        self.reloader = Reloader(
            sources,
            self._reloaded,
            settings.models_reload_seconds,
        )

    def _reloaded(self, source: str, result: str) -> None:
        """`sluice_activator_models_reloads_total` counts the models file's reloads only (a
        pin key reload is logged)."""
        if source == "models":
            self.metrics.reloads.labels(result).inc()

    def apply(self, models: Models) -> None:
        self.models = models
        self.metrics.loaded(models)
        for owner in models.by_key.values():
            missing = [
                f"{v.key} ({v.weight}%)"
                for v in (owner.split.versions if owner.split is not None else ())
                if v.weight and v.key not in models.by_key
            ]
            if missing:
                log.warning(
                    "models: %s shares its traffic with %s, not in the models file: their "
                    "share goes to %s",
                    owner.key,
                    ", ".join(missing),
                    owner.key,
                )
        if self.started:
            self._watch()

    def _watch(self) -> None:
        """Watch the Pods the models name now, and only those: one `PodView` per pool (a
        model's `pods`, and a disaggregated model's prefill pool) and one `ModelHasher` per
        pool placed by prefix (all but a disaggregated model's decode pool)."""
        pools = _pools(self.models)
        selectors = {m.pods for m in pools.values() if m.pods is not None}
        self.pods.retain(selectors)
        for selector in selectors:
            self.pods.podset(selector)
        for key, view in list(self.views.items()):
            model = pools.get(key)
            if model is None or model.pods != view.model.pods:
                view.stop()
                del self.views[key]
            else:
                view.model = model  # the same pods: its index and feeds stay, `balance` follows
        for key, model in pools.items():
            if key not in self.views:
                self.views[key] = view = self._view(model)
                view.start()
        hashed = {key: m for key, m in pools.items() if m.prefill is None}
        for key, hasher in list(self.hashers.items()):
            model = hashed.get(key)
            if model is None or model.pods != hasher.model.pods:
                hasher.stop()
                del self.hashers[key]
        for key, model in hashed.items():
            if key not in self.hashers:
                assert self.client is not None and self.cache_dir is not None
                assert model.pods is not None
                self.hashers[key] = hasher = ModelHasher(
                    model,
                    self.pods.podset(model.pods),
                    self.client,
                    self.cache_dir,
                    self.settings.prefix_hasher_refresh_seconds,
                    timeout=self.settings.connect_timeout_seconds * 2,
                    metrics=self.metrics,
                )
                hasher.start()

    def hasher(self, model: Model) -> PromptHashes | None:
        """The default `HashesFor`: the model's `ModelHasher` (None before the router
        started, or while a reload that changed its `pods` has not reached it)."""
        hasher = self.hashers.get(model.pool_key)
        return hasher if hasher is not None and hasher.model.pods == model.pods else None

    def _view(self, model: Model) -> PodView:
        assert model.pods is not None and self.scrapes is not None
        s = self.settings
        return PodView(
            model,
            self.pods.podset(model.pods),
            self.metrics,
            scoring(s),
            client=self.scrapes,
            scrape_interval=s.load_scrape_seconds,
            scrape_timeout=min(s.load_scrape_seconds, s.connect_timeout_seconds),
        )

    def drain(self) -> None:
        """SIGTERM: held requests wait at most `--drain-timeout-seconds` more."""
        log.info("draining: %d requests held", sum(up.held for up in self.upstreams.values()))
        self.closing.begin(self.settings.drain_timeout_seconds)

    def upstream(self, model: Model) -> Upstream:
        up = self.upstreams.get(model.key)
        # A changed entry applies from the next request on once none is held under the old.
        # What the router learned under the old one stays: its callers' tenants, and its
        # streams in flight, which keep counting against their pods until they end.
        if up is None or (up.held == 0 and up.model != model):
            prefill = None
            if model.prefill is not None:
                before = up.prefill if up is not None else None
                prefill = self._upstream(model.prefill_pool(), before)
            up = self.upstreams[model.key] = self._upstream(model, up, prefill)
        return up

    def _upstream(
        self, model: Model, before: Upstream | None, prefill: Upstream | None = None
    ) -> Upstream:
        """One pool's Upstream: its pods, view and prompt hasher (none for a disaggregated
        model's decode pool, placed by load)."""
        assert self.client is not None  # made in the lifespan
        s = self.settings
        pods = None if model.pods is None else self.pods.podset(model.pods)
        view = self.views.get(model.pool_key)
        if view is not None and view.model.pods != model.pods:
            view = None  # the reload that changed it has not reached the view yet
        return Upstream(
            model,
            self.client,
            self.metrics,
            s.ready_poll_seconds,
            s.connect_timeout_seconds,
            self.closing,
            pods,
            view,
            None if pods is None or model.prefill is not None else self.hashes(model),
            self.hashing,
            before=before,
            prefill=prefill,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        headers = dict(scope["headers"])
        host, named = (
            headers.get(b"host", b"").decode("latin-1"),
            headers.get(MODEL_HEADER.encode()),
        )
        model = self.models.find(host, named.decode("latin-1") if named is not None else None)
        s = self.settings
        if model is None:
            if kind == "http" and named is None and scope["path"] in OWN_ROUTES:
                return await self._own(scope, send)
            return await self._unknown(scope, receive, send, host, named)
        if "/internal/" in scope["path"]:  # the pods' router-only endpoints: never relayed
            return await self._internal(scope, receive, send, model)
        body: bytes | None = None
        if model.split is not None:  # the owner of versions: the conversation's version
            chosen = await self._version(scope, receive, send, model)
            if chosen is None:
                return  # answered (413, 400) or gone
            model, body = chosen
        up = self.upstream(model)
        if kind == "websocket":
            return await relay.relay(
                scope,
                receive,
                send,
                up,
                self.metrics,
                s.max_held_frames,
                s.connect_timeout_seconds,
                s.max_body_bytes,
                s.continuation_key_file,
                self.relay,
            )
        assert self.relay is not None
        # What the send watchdog of a held stream watches (transport/sendwatch.py).
        scope["sluice.transport"] = transport_of(receive)
        await proxy.handle(
            scope,
            receive,
            send,
            up,
            self.metrics,
            self.relay,
            s.max_body_bytes,
            s.send_timeout_seconds,
            self.pins,
            s.continuation_key_file,
            body,
        )

    async def _version(
        self, scope: Scope, receive: Receive, send: Send, owner: Model
    ) -> tuple[Model, bytes | None] | None:
        """The version of `owner` this request's conversation goes to (split.py), and the
        body read to choose it (None for a WebSocket); None when the request was answered
        here (a body over `--max-body-bytes`, a bad `X-Sluice-Session`) or its client left."""
        assert owner.split is not None
        if not split.conversational(scope["path"], scope["type"] == "websocket"):
            return owner, None  # /v1/models and the like: the owner's, not a conversation's
        headers, query = scope["headers"], scope.get("query_string", b"")
        body = None
        if scope["type"] == "http":
            try:
                body = await proxy.read_body(receive, self.settings.max_body_bytes)
            except proxy.ClientLeft:
                self.metrics.requests.labels(owner.namespace, owner.name, "disconnected").inc()
                return None
            if body is None:
                self.metrics.requests.labels(owner.namespace, owner.name, "rejected").inc()
                await proxy.too_large(scope, self.settings.max_body_bytes)(send)
                return None
        versions = self.models.by_key
        if self.pins is not None and any(k == b"last-event-id" for k, _ in headers):
            for v in owner.split.versions:  # a resume: back to the version its pin names
                if v.key in versions and self.pins.pinned(headers, v.key) is not None:
                    return versions[v.key], body
        try:
            session = split.session(headers, query, scope["path"], body)
        except split.BadSession as e:
            self.metrics.requests.labels(owner.namespace, owner.name, "rejected").inc()
            await self._refuse(scope, receive, send, 400, str(e), "invalid_session")
            return None
        key = owner.key
        if session is not None:
            key = split.choose(owner.split, split.bucket(owner.key, session.key), versions)
        version = versions.get(key, owner)
        by = "fallback" if session is None else session.by
        self.metrics.split_picks.labels(owner.namespace, owner.name, version.name, by).inc()
        return version, body

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str
    ) -> None:
        """An error answer in the route's shape, or a WebSocket's handshake refused."""
        if scope["type"] == "websocket":
            await relay.refuse(
                WebSocket(scope, receive, send), status, error_body(status, message, code=code)
            )
            return
        kind = proxy.classify(scope["path"], b"")
        await proxy.json_response(status, kind.error_body(status, message, code))(send)

    async def _own(self, scope: Scope, send: Send) -> None:
        path = scope["path"]
        if path == "/metrics":
            body, ctype = self.metrics.scrape(), b"text/plain; version=0.0.4; charset=utf-8"
        else:
            body, ctype = (
                json.dumps({"status": "ok", "models": len(self.models)}).encode(),
                b"application/json",
            )
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}
        )
        await send({"type": "http.response.body", "body": body})

    async def _unknown(
        self, scope: Scope, receive: Receive, send: Send, host: str, named: bytes | None
    ) -> None:
        self.metrics.unknown.inc()
        said = (
            f"X-Sluice-Model `{named.decode('latin-1')}`" if named is not None else f"Host `{host}`"
        )
        message = (
            f"No model for {said}: the router forwards only to the models in its "
            "models file (a StreamingModel at autoscaling.minReplicas 0 or routed by it)."
        )
        body = error_body(404, message, code="model_not_found")
        if scope["type"] == "websocket":
            await relay.refuse(WebSocket(scope, receive, send), 404, body)
            return
        await proxy.json_response(404, body)(send)

    async def _internal(self, scope: Scope, receive: Receive, send: Send, model: Model) -> None:
        message = (
            f"{scope['path']} is not forwarded: a model pod's /internal/ endpoints are for "
            f"the router, which reads them from {model.key}'s pods itself."
        )
        body = error_body(404, message, code="not_forwarded")
        if scope["type"] == "websocket":
            await relay.refuse(WebSocket(scope, receive, send), 404, body)
            return
        await proxy.json_response(404, body)(send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        watcher: asyncio.Task[None] | None = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                s = self.settings
                self.client = httpx.AsyncClient(
                    trust_env=False,  # a Service address: never through an HTTP proxy
                    timeout=httpx.Timeout(None, connect=s.connect_timeout_seconds),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                )
                self.relay = Relay(s.connect_timeout_seconds)
                self.scrapes = hop_client(s.connect_timeout_seconds)
                if self.cache_dir is None:
                    self.cache_dir = Path(tempfile.mkdtemp(prefix="sluice-tokenizers-"))
                    self._own_cache_dir = True
                watcher = asyncio.create_task(self.reloader.run())
                self.started = True
                self._watch()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if watcher is not None:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                for view in self.views.values():
                    await view.aclose()
                for hasher in self.hashers.values():
                    await hasher.aclose()
                self.hashing.shutdown(wait=False, cancel_futures=True)
                if self._own_cache_dir and self.cache_dir is not None:
                    shutil.rmtree(self.cache_dir, ignore_errors=True)
                await self.pods.aclose()
                for client in (self.client, self.scrapes, self.relay):
                    if client is not None:
                        await client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _pools(models: Models) -> dict[str, Model]:
    """Every pool of pods the router places on, by its key (`Model.pool_key`): each model
    with `pods`, and a disaggregated model's prefill pool."""
    pools: dict[str, Model] = {}
    for model in models.by_key.values():
        if model.pods is not None:
            pools[model.pool_key] = model
            if model.prefill is not None:
                pool = model.prefill_pool()
                pools[pool.pool_key] = pool
    return pools


def _describe(models: Models) -> str:
    return f"{len(models)} models: {', '.join(sorted(models.by_key)) or 'none'}"


def build_router(settings: RouterSettings, hashes: HashesFor | None = None) -> Router:
    return Router(settings, hashes)
