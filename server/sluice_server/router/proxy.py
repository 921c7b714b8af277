"""One HTTP request for a known model: wait for a ready replica (at once when its model has
one), keep a streaming client alive meanwhile, then forward the request to the pod (or
Service) `Upstream.pick` names and stream the answer through unchanged.

- Before anything is sent, the client only waits: a non-streamed request until a replica
  is ready or the hold timeout; a streamed one (token SSE, and OpenAI, Responses and
  Anthropic bodies with `"stream": true`) for at most one keep-alive interval
  (`keepaliveSeconds`), the admission queue's rule (a queued stream commits to 200 after one
  `--heartbeat-seconds`). Forwarded in that time, the upstream status and headers pass
  through as they are (401 and 429 from the model's server too).
- Past that a stream commits: 200 `text/event-stream`, a keep-alive at once and one every
  interval from the server core's one keep-alive writer (core/streaming/keepalive.py), in the
  protocol's own form (an SSE comment, which the SDKs ignore; with `X-Sluice-Status: 1` on
  token SSE also `event: status`). Forwarded then, an upstream 200's body follows the
  keep-alives; any other upstream answer becomes the protocol's error event with the
  upstream's status, message and code.
- Past `holdTimeoutSeconds`: 503 `model_starting` with `Retry-After` when nothing was sent,
  else the protocol's error event with that code.
- An upstream event stream that breaks off midway (the replica died) is continued on
  another pod when its model has `migration` (`Splice`, docs/migration.md), else it ends
  with the protocol's error event, code `upstream_error`; any other answer cut off midway is cut
  for the client too (the connection is dropped).
- The client leaving while held drops it from the held count (no upstream request is
  made); leaving after forwarding closes the upstream connection at once, so the model
  server's abort on disconnect stops its engine. A forwarded request that cannot even
  connect (the replica went away again) is held again: it never reached the server.

The request goes to `http://<podIP>:<port>` (a model with `pods`: the pod placed by its
prompt's block hashes, which the model's provider computes from the body once, and the
pods' loads) or `http://<host>:<port>` with its method, path, query, body and headers
(hop-by-hop ones and Host removed); the bytes of the answer are relayed as they come,
never parsed, except the marks of a stream its model lets the router continue elsewhere
(`Splice`, migration.py). Upstream connections are kept alive and reused only after an answer that
ended cleanly (hop.py): a request whose client leaves closes its own connection, so the
server hears it at once; a reused connection the pod closed before answering is retried
once on a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from ..core.auth.routerkey import KEY_HEADER
from ..core.errors import error_body as openai_error_body
from ..core.streaming.continuation import MARKED_HEADER
from ..core.streaming.keepalive import KeepAlive
from ..protocols import anthropic, responses, token_sse
from ..protocols.engine_api import openai_error_event
from ..transport.sse import QUEUED, SSEResponse
from .hop import Relay, relay_body
from .metrics import Outcome, RouterMetrics
from .migration import Marks, busy, continuation_body, key_for
from .pin import Pins
from .prefixindex import BlockHash
from .tenants import ROUTER_MARK, TENANT_HEADER, credential
from .upstream import Target, Upstream

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# Not relayed to the client: hop-by-hop (the raw body's length stands) and the pod's answer
# to the router about the caller's tenant (tenants.py).
_NOT_RELAYED = (HOP_BY_HOP - {"content-length"}) | {TENANT_HEADER.decode(), MARKED_HEADER}
STATUS_HEADER = "x-sluice-status"  # token SSE: also `event: status` while held
MODEL_STARTING = "model_starting"
ROUTES = (
    ("/v1/chat/completions", "openai"), ("/v1/completions", "openai"),
    ("/v1/responses", "responses"), ("/v1/messages", "anthropic"), ("/v1/stream", "sse"),
)  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """What a request is, as far as holding it goes: its protocol (for the shape of its
    errors) and whether it streams."""

    protocol: str  # openai, responses, anthropic, sse, or other
    streaming: bool

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        if self.protocol == "anthropic":
            return anthropic.error_body(status, message)
        return openai_error_body(status, message, code=code)

    def error_event(self, rid: str, message: str, code: str, status: int) -> bytes:
        if self.protocol == "anthropic":
            text = anthropic.error_event(message, code, 0, status)
        elif self.protocol == "responses":
            text = responses.error_event(message, code, 0, status)
        elif self.protocol == "sse":
            text = token_sse.error_event(rid, message, code)
        else:
            text = openai_error_event(message, code, 0, status)
        return text.encode()


def classify(path: str, body: bytes) -> Kind:
    protocol = next((p for suffix, p in ROUTES if path.endswith(suffix)), "other")
    if protocol == "sse":
        return Kind(protocol, True)
    streaming = False
    if protocol != "other" and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the server answers it (400); forwarded as a plain request
        streaming = isinstance(parsed, dict) and parsed.get("stream") is True
    return Kind(protocol, streaming)


class Held:
    """One request from its arrival to forwarded or given up; the outcome counted once."""

    def __init__(self, up: Upstream, metrics: RouterMetrics) -> None:
        self.up, self.metrics = up, metrics
        self.t0 = time.monotonic()
        self.ended = False
        self.target: Target | None = None  # where it goes (counted there until released)

    def pick(
        self,
        key: bytes,
        pin: str | None = None,
        hashes: Sequence[BlockHash] | None = None,
        exclude: Collection[str] = (),
        follow: bytes | None = None,
    ) -> Target | None:
        """Choose where it goes now (releasing an earlier choice); None: nowhere yet."""
        self.release()
        self.target = self.up.pick(key, pin, hashes, exclude, follow)
        return self.target

    def release(self) -> None:
        """It no longer runs where it went (its answer ended, or it could not connect)."""
        if self.target is not None:
            self.target.release()

    @property
    def waited(self) -> float:
        return time.monotonic() - self.t0

    @property
    def deadline(self) -> float:
        """When it gives up: its hold timeout, or sooner when the router shuts down."""
        return min(self.t0 + self.up.model.hold_timeout, self.up.closing.at)

    def wakers(self) -> tuple[asyncio.Future[None], ...]:
        """What must wake a wait besides its own events: the shutdown beginning."""
        changed = self.up.closing.changed
        return () if changed.done() else (changed,)

    def end(self, outcome: Outcome) -> None:
        if self.ended:
            return
        self.ended = True
        self.up.release()
        m, model = self.metrics, self.up.model
        m.requests.labels(model.namespace, model.name, outcome).inc()
        m.hold.labels(model.namespace, model.name).observe(self.waited)
        log.info("%s %s after %.3f s held", model.key, outcome, self.waited)


def json_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Callable[[Send], Awaitable[None]]:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def respond(send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    return respond


def too_large(scope: Scope, max_body: int) -> Callable[[Send], Awaitable[None]]:
    """413 for a body over `--max-body-bytes`, in the route's error shape."""
    m = f"Request body over {max_body} bytes."
    return json_response(413, classify(scope["path"], b"").error_body(413, m, "body_too_large"))


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def starting_message(held: Held) -> str:
    model = held.up.model
    if held.up.closing.at < held.t0 + model.hold_timeout:
        return (
            f"Model {model.key} is starting and this router is shutting down "
            f"({MODEL_STARTING}). Retry."
        )
    return (
        f"Model {model.key} is starting: no replica was ready within "
        f"{model.hold_timeout:g} s ({MODEL_STARTING}). Retry later."
    )


def forward_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers less the hop-by-hop ones (also those its Connection names)."""
    named = {
        t.strip().lower()
        for k, v in scope["headers"]
        if k == b"connection"
        for t in v.decode("latin-1").split(",")
    }
    return [
        *(
            (k, v)
            for k, v in scope["headers"]
            if (name := k.decode("latin-1")) not in HOP_BY_HOP
            and name not in named
            and k != ROUTER_MARK[0]
        ),
        ROUTER_MARK,  # the pod names the caller's tenant in its answer (tenants.py)
    ]


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body; None past `limit` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


class ClientLeft(Exception):
    pass


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Request:
    """A held request's forwarding: its upstream request, and the moment it went out."""

    def __init__(
        self,
        client: Relay,
        held: Held,
        scope: Scope,
        body: bytes,
        pins: Pins | None = None,
        continuation_key: Path | None = None,
    ) -> None:
        self.client, self.held, self.scope, self.body, self.pins = client, held, scope, body, pins
        # Where the master key is, for a request whose stream may be continued elsewhere
        # (its model has `migration` and `pods`; migration.py): it keeps its body.
        model = held.up.model
        self.continuation_key = (
            continuation_key if model.migration is not None and model.pods is not None else None
        )
        # A resume (`Last-Event-ID`) with a valid `sluice-pin` goes back to its pod (pin.py).
        resume = any(k == b"last-event-id" for k, _ in scope["headers"])
        self.pin = pins.pinned(scope["headers"], held.up.model.key) if pins and resume else None
        # A resume whose pin names a pod no longer there follows its stream: the pod its
        # continuation went to (migration.py, `Upstream.pick`).
        self.follow = _stream_of(scope["headers"]) if self.pin is not None else None
        # What the pod tie-break hashes: equal requests go to the same pod.
        self.key = body or (scope["path"].encode() + b"?" + scope.get("query_string", b""))
        self.cred = credential(scope["headers"], scope.get("query_string", b""))
        # Its prompt's block hashes (`prepare`: the model's provider reads the body).
        self.hashes: Sequence[BlockHash] | None = None

    async def prepare(self) -> None:
        """Its prompt's block hashes, once, before it waits (None: unknown)."""
        self.hashes = await self.held.up.prompt_hashes(self.scope["path"], self.body, self.cred)

    def build(self, target: Target) -> httpx.Request:
        scope, held = self.scope, self.held

        async def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                held.end("forwarded")  # connected: from here on the server has it

        url = target.url + scope["path"]
        query = scope.get("query_string", b"")
        return self.client.build_request(
            scope["method"],
            httpx.URL(url, query=query),
            headers=forward_headers(scope),
            content=self.body,
            extensions={"trace": trace},
        )

    def migrates(self, response: httpx.Response) -> bool:
        """Its stream is continued on another pod if it breaks: its model migrates streams,
        the router has the master key, and the pod marks this stream."""
        return (
            self.continuation_key is not None
            and response.status_code == 200
            and response.headers.get(MARKED_HEADER) == "1"
        )

    async def send(self) -> httpx.Response | None:
        """The upstream response (headers read, body not); None when no pod is a candidate
        any more or it could not connect (the replica went away: marked down, the request is
        held again)."""
        target = self.held.pick(self.key, self.pin, self.hashes, follow=self.follow)
        if target is None:
            return None
        try:
            response = await self.client.send(self.build(target))
            self.held.up.tenants.learn(self.cred, response.status_code, response.headers.raw)
            if self.continuation_key is None:
                # Forwarded: the body and its hashes are not needed again (a stream can last
                # hours; a 1,500-token chat's body is some 8 KB).
                self.body = self.key = b""
                self.hashes = None
            return response
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            if self.held.ended:
                raise
            log.info(
                "%s: connect to %s failed (%s); holding again",
                self.held.up.model.key,
                target.pod or target.url,
                type(e).__name__,
            )
            self.held.up.down(target)
            self.held.release()
            return None


async def handle(
    scope: Scope,
    receive: Receive,
    send: Send,
    up: Upstream,
    metrics: RouterMetrics,
    client: Relay,
    max_body: int,
    send_timeout: float,
    pins: Pins | None = None,
    continuation_key: Path | None = None,
    body: bytes | None = None,
) -> None:
    """One HTTP request for a known model (see the module docstring); `continuation_key`:
    the router's master key file (its streams may be continued on another pod); `body`: the
    request's body when the router read it already (to choose a version, split.py)."""
    model = up.model
    if not up.hold():
        kind = classify(scope["path"], b"")
        m = f"Model {model.key} has {model.max_held} requests waiting for a replica already."
        metrics.requests.labels(model.namespace, model.name, "rejected").inc()
        await json_response(
            429, kind.error_body(429, m, "too_many_held"), retry_after(model.keepalive)
        )(send)
        return
    held = Held(up, metrics)
    try:
        await _held(
            held, scope, receive, send, client, max_body, send_timeout, pins, continuation_key, body
        )
    finally:
        held.release()  # its pod's in-flight count: the answer ended, or never began


async def _held(
    held: Held,
    scope: Scope,
    receive: Receive,
    send: Send,
    client: Relay,
    max_body: int,
    send_timeout: float,
    pins: Pins | None,
    continuation_key: Path | None,
    body: bytes | None,
) -> None:
    up, model = held.up, held.up.model
    if body is None:
        try:
            body = await read_body(receive, max_body)
        except ClientLeft:
            held.end("disconnected")
            return
        if body is None:
            held.end("rejected")
            await too_large(scope, max_body)(send)
            return
    kind = classify(scope["path"], body)
    request = Request(client, held, scope, body, pins, continuation_key if kind.streaming else None)
    del body  # the request keeps it until forwarded
    await request.prepare()
    gone = asyncio.ensure_future(_disconnected(receive))
    forwarded: asyncio.Future[bool] | None = None
    try:
        commit_at = held.t0 + model.keepalive if kind.streaming else math.inf
        while True:
            ready = asyncio.ensure_future(up.wait_ready())
            left = min(held.deadline, commit_at) - time.monotonic()
            done, _ = await asyncio.wait(
                (ready, gone, *held.wakers()),
                timeout=max(left, 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if gone in done:
                ready.cancel()
                held.end("disconnected")
                return
            if ready in done:
                forwarded = asyncio.ensure_future(_pass_through(request, kind, send))
                await asyncio.wait((forwarded, gone), return_when=asyncio.FIRST_COMPLETED)
                if not forwarded.done():  # the client left: close the upstream at once
                    forwarded.cancel()
                    await asyncio.gather(forwarded, return_exceptions=True)
                    held.end("disconnected")
                    return
                if forwarded.result():
                    return
                continue  # could not connect: held again
            ready.cancel()
            if time.monotonic() >= held.deadline:
                held.end("timeout")
                m = starting_message(held)
                await json_response(
                    503, kind.error_body(503, m, MODEL_STARTING), retry_after(model.keepalive)
                )(send)
                return
            if time.monotonic() >= commit_at:
                break  # a stream that waited one keep-alive interval: commit to 200
            # the shutdown began: wait again, up to the new deadline
    except BaseException:
        if not held.ended:  # cancelled (server shutdown) while held
            held.end("disconnected")
        raise
    finally:
        gone.cancel()
        if forwarded is not None and not forwarded.done():  # cancelled while forwarding
            forwarded.cancel()
    status_events = kind.protocol == "sse" and _asked_status(scope)
    stream = HeldStream(request, kind, status_events)
    await SSEResponse(stream.frames(), stream.cleanup, ping=0, send_timeout=send_timeout)(
        scope, receive, send
    )


def _asked_status(scope: Scope) -> bool:
    return any(
        k == STATUS_HEADER.encode() and v.strip() in (b"1", b"true") for k, v in scope["headers"]
    )


async def _pass_through(request: Request, kind: Kind, send: Send) -> bool:
    """Forward, then stream the upstream answer to a client that got nothing yet; False
    when it could not connect."""
    try:
        response = await request.send()
    except httpx.HTTPError as e:  # connected, then no answer
        m = f"The model's server gave no answer ({type(e).__name__})."
        await json_response(502, openai_error_body(502, m, code="upstream_error"))(send)
        return True
    if response is None:
        return False
    try:
        dropped = _NOT_RELAYED  # raw bytes: their length stands
        headers = [
            (k, v) for k, v in response.headers.raw if k.decode("latin-1").lower() not in dropped
        ]
        target, pins = request.held.target, request.pins
        if (
            pins
            and target
            and target.pod
            and kind.protocol == "sse"
            and response.status_code == 200
        ):
            headers.append(pins.set_cookie(request.held.up.model.key, target.pod))
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        if request.migrates(response):
            await Splice(request, kind, response).relay(lambda chunk: send(_more(chunk)))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        try:
            await relay_body(response, lambda chunk: send(_more(chunk)))
        except httpx.HTTPError as e:  # the upstream broke off mid-answer
            log.info(
                "%s: upstream answer broke off (%s)", request.held.up.model.key, type(e).__name__
            )
            if not _is_event_stream(response):
                raise  # cut the client's answer too: uvicorn drops the connection
            await send(
                {"type": "http.response.body", "body": broke_off(kind, e), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()
    return True


def _stream_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The stream id of a token stream's `Last-Event-ID` (`<id>:<n>` or the router's form
    `<id>:<n>;<token ids>`)."""
    for k, v in headers:
        if k == b"last-event-id":
            rid = v.split(b";", 1)[0].rpartition(b":")[0]
            return rid or None
    return None


def _more(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


def _is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def broke_off(kind: Kind, e: Exception) -> bytes:
    """The protocol's error event for an upstream stream cut off midway; the blank line
    first ends an event the cut left open."""
    message = f"The model's server broke off the stream ({type(e).__name__})."
    return b"\n\n" + kind.error_event(f"router-{uuid.uuid4().hex}", message, "upstream_error", 502)


class HeldStream:
    """A stream committed to 200 while its model starts: keep-alives from the one
    keep-alive writer until a replica is ready, then the upstream stream's events."""

    def __init__(self, request: Request, kind: Kind, status_events: bool) -> None:
        self.request, self.kind, self.status_events = request, kind, status_events
        self.held = request.held
        self.rid = f"router-{uuid.uuid4().hex}"
        self._due: asyncio.Future[None] | None = None

    def cleanup(self, stalled: bool) -> None:
        self.held.end("disconnected")  # no-op once forwarded or timed out

    def _beat(self) -> None:
        if self._due is not None and not self._due.done():
            self._due.set_result(None)

    def _keepalive(self) -> bytes:
        """The protocol's keep-alive while waiting: the admission queue's SSE comment, and
        on token SSE, when asked, the progress event."""
        if self.status_events:
            return QUEUED + token_sse.status_event("starting", self.held.waited).encode()
        return QUEUED

    async def frames(self) -> AsyncIterator[bytes]:
        held, model = self.held, self.held.up.model
        loop = asyncio.get_running_loop()
        unbeat: Callable[[], None] = KeepAlive.on(loop, model.keepalive).add(self._beat)
        try:
            yield self._keepalive()  # the first at once: the client learns why it waits
            while True:
                ready = asyncio.ensure_future(held.up.wait_ready())
                self._due = loop.create_future()
                done, _ = await asyncio.wait(
                    (ready, self._due, *held.wakers()),
                    timeout=max(held.deadline - time.monotonic(), 0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if ready in done:
                    try:
                        response = await self.request.send()
                    except httpx.HTTPError as e:  # connected, then no answer
                        m = f"The model's server gave no answer ({type(e).__name__})."
                        yield self.kind.error_event(self.rid, m, "upstream_error", 502)
                        return
                    if response is not None:
                        break
                    continue  # could not connect: held again
                ready.cancel()
                if self._due in done:
                    yield self._keepalive()
                    continue
                if time.monotonic() < held.deadline:
                    continue  # the shutdown began: wait again, up to the new deadline
                held.end("timeout")
                yield self.kind.error_event(self.rid, starting_message(held), MODEL_STARTING, 503)
                return
        finally:
            unbeat()
        try:
            if response.status_code != 200:
                raw = await response.aread()
                yield self.kind.error_event(self.rid, *_upstream_error(response, raw))
                return
            if self.request.migrates(response):
                async for piece in Splice(self.request, self.kind, response).pieces():
                    yield piece
                return
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            except httpx.HTTPError as e:  # the upstream broke off mid-stream
                log.info("%s: upstream stream broke off (%s)", held.up.model.key, type(e).__name__)
                yield broke_off(self.kind, e)
        finally:
            await response.aclose()


def _upstream_error(response: httpx.Response, raw: bytes) -> tuple[str, str, int]:
    """Message, code and status of an upstream refusal (OpenAI's or Anthropic's shape)."""
    status = response.status_code
    message, code = f"The model's server answered {status}.", str(status)
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        message = str(err.get("message") or message)
        code = str(err.get("code") or err.get("type") or code)
    return message, code, status


class Splice:
    """A marked stream relayed to its client, continued on another pod each time its
    upstream breaks (docs/migration.md): the pod's connection ends before the stream did,
    or it sends nothing for the model's `stallSeconds`. At most `maxMigrations` moves;
    then, or when no pod continues it, the protocol's error event ends it. The client's
    leaving cancels the relay (the proxy's disconnect watch): its upstream connection
    closes at once and nothing is continued."""

    def __init__(self, request: Request, kind: Kind, response: httpx.Response) -> None:
        self.request, self.kind, self.response = request, kind, response
        self.held = request.held
        model = self.held.up.model
        assert model.migration is not None and request.continuation_key is not None
        self.migration, self.key_file = model.migration, request.continuation_key
        self.marks = Marks(kind.protocol == "sse")
        self.moves = 0
        self.left: set[str] = set()  # pods this stream broke on: never asked again
        labels = (model.namespace, model.name)
        m = self.held.metrics
        self._results = m.migrations
        self._labels = labels
        self._gap = m.migration_gap.labels(*labels)
        self._last = time.monotonic()  # when the upstream last brought bytes
        self._seam: float | None = None  # a seam's start, until the continuation's bytes

    async def relay(self, send_piece: Callable[[bytes], Awaitable[None]]) -> None:
        marks, model = self.marks, self.held.up.model

        async def take(chunk: bytes) -> None:
            now = time.monotonic()
            if self._seam is not None:  # the continuation's first bytes: the seam's gap
                self._gap.observe(now - self._seam)
                log.info("%s: the seam's gap was %.3f s", model.key, now - self._seam)
                self._seam = None
            self._last = now
            out = marks.take(chunk)
            if out:
                await send_piece(out)

        while True:
            response = self.response
            try:
                await relay_body(response, take, stall=self.migration.stall_seconds)
                rest = marks.rest()
                if rest:
                    await send_piece(rest)
                return
            except httpx.HTTPError as e:
                broken: httpx.HTTPError = e
            finally:
                await response.aclose()
            if marks.finished:
                return  # it broke after its final event: the client has it all
            target = self.held.target
            if target is not None and target.pod is not None:
                self.left.add(target.pod)
                self.held.up.down(target)
            why = type(broken).__name__
            if marks.index is None:
                await self._end(send_piece, "unmarked", broken_message(why))
                return
            if self.moves >= self.migration.max_migrations:
                m = (
                    f"The model's server broke off the stream ({why}) after it was moved "
                    f"{self.moves} times (maxMigrations)."
                )
                await self._end(send_piece, "exhausted", m)
                return
            self.moves += 1
            outcome = await self._continuation(send_piece)
            if isinstance(outcome, tuple):
                result, message, status = outcome
                await self._end(send_piece, result, message, status)
                return
            self.response = outcome
            self._seam = self._last
            self._results.labels(*self._labels, "continued").inc()
            new = self.held.target.pod if self.held.target is not None else None
            log.info(
                "%s: stream migrated (%s) to %s after event %d, move %d",
                model.key, why, new, marks.index, self.moves,
            )  # fmt: skip

    async def pieces(self) -> AsyncIterator[bytes]:
        """`relay` as an iterator of pieces (a stream the proxy committed to while held)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(1)

        async def put(piece: bytes) -> None:
            await queue.put(piece)

        async def run() -> None:
            try:
                await self.relay(put)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (piece := await queue.get()) is not None:
                yield piece
            await task  # its errors, if any
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _end(
        self,
        send_piece: Callable[[bytes], Awaitable[None]],
        result: str,
        message: str,
        status: int = 502,
    ) -> None:
        self._results.labels(*self._labels, result).inc()
        log.info("%s: stream not continued (%s): %s", self.held.up.model.key, result, message)
        rid = f"router-{uuid.uuid4().hex}"
        await send_piece(b"\n\n" + self.kind.error_event(rid, message, "upstream_error", status))

    async def _continuation(
        self, send_piece: Callable[[bytes], Awaitable[None]]
    ) -> httpx.Response | tuple[str, str, int]:
        """The rest of the stream from another pod (its answer's head read), or (result,
        message, status) when none gives it: a refusal, or no pod within the hold timeout.
        Waiting for a pod, the client gets the protocol's keep-alive."""
        request, held, up = self.request, self.held, self.held.up
        model = up.model
        deadline = time.monotonic() + model.hold_timeout
        scope = request.scope
        path = scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        body = continuation_body(
            scope["method"], path, request.body, self.marks, self.kind.protocol == "sse"
        )
        later: dict[str, float] = {}  # pods that answered 429/503: when to ask again
        while True:
            now = time.monotonic()
            if now >= deadline:
                m = (
                    f"The model's server broke off the stream and no other replica took it "
                    f"within {model.hold_timeout:g} s."
                )
                return "unavailable", m, 503
            left = self.left | {p for p, t in later.items() if t > now}
            follow = self.marks.stream if self.kind.protocol == "sse" else None
            target = held.pick(request.key, None, request.hashes, left, follow)
            if target is None:
                await self._wait_for_pod(
                    send_piece, min(deadline, min(later.values(), default=deadline))
                )
                continue
            try:
                key = key_for(self.key_file, model.namespace, model.name)
            except OSError as e:
                return "refused", f"The router cannot read its continuation key: {e}.", 503
            headers = [(k, v) for k, v in forward_headers(scope) if k != b"content-type"]
            headers += [(b"content-type", b"application/json"), (KEY_HEADER, key)]
            upstream = request.client.build_request(
                "POST", target.url + "/internal/continue", headers=headers, content=body
            )
            try:
                response = await request.client.send(upstream)
            except httpx.HTTPError as e:  # it went away too (or never answered)
                log.info(
                    "%s: continuation on %s failed (%s)", model.key, target.pod, type(e).__name__
                )
                if target.pod is not None:
                    self.left.add(target.pod)
                    up.down(target)
                continue
            if response.status_code == 200:
                return response
            raw = await response.aread()
            await response.aclose()
            message, code, status = _upstream_error(response, raw)
            if busy(response.status_code, response.headers) and target.pod is not None:
                later[target.pod] = time.monotonic() + 1.0
                continue
            m = f"The stream could not be continued: {message}"
            return "refused", m, status

    async def _wait_for_pod(
        self, send_piece: Callable[[bytes], Awaitable[None]], until: float
    ) -> None:
        """Until a pod may take it (or `until`), keep-alives to the client meanwhile."""
        up = self.held.up
        await up.pods_change(max(min(until - time.monotonic(), up.model.keepalive), 0.05))
        await send_piece(QUEUED)


def broken_message(why: str) -> str:
    return f"The model's server broke off the stream ({why})."
