"""The one handler under every route whose wire format the engine renders (`Engine.api`:
vLLM's own serving layer, or the simulator's built-in one): OpenAI chat and completions,
OpenAI Responses, Anthropic Messages and the utility routes.

An API module describes its API once (`Api`: flag, metric label, error shapes) and calls
`generate` (may stream) or `answer` (a JSON reply at once). This module adds Sluice's
behaviour the same way for all of them: protocol switch, auth, rate limits, capacity,
abort on disconnect before the first byte, and a streamed answer through the stream core
(bounded buffer, timeout, drain, heartbeats, send timeout, edge metrics) with the API's own
error event after the 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..core.auth.cachesalt import ROUTER_HEADER, check_client_salt
from ..core.auth.identity import Principal
from ..core.errors import ApiError, error_body
from ..core.kvtransfer import (
    CLIENT_FIELD,
    PREFILL_KEY,
    cached_in_usage,
    prefill_body,
    refuse_client_field,
    transfer_in,
)
from ..core.lifecycle import open_stream
from ..core.params import describe_validation_error
from ..core.services import ClientGone, Services, read_json, received_at, services, trail_of
from ..core.streaming.continuation import (
    MARKED_HEADER,
    SCOPE_KEY,
    Continuation,
    continued,
    event_id,
    frame_identity,
    stream_name,
    with_mark,
)
from ..core.streaming.continuation import (
    marked as is_marked,
)
from ..core.streaming.events import DISCONNECTED, FINISHED, Failed, Meter, Tokens, Waiting, events
from ..core.streaming.stream import HANDED_OVER, Stream
from ..core.telemetry.metrics import bind
from ..engine.base import GENERATING, ApiKind, ApiRequestError, ApiStream, Delta
from ..transport.sse import QUEUED, HandedOver, SSEResponse


def openai_error_event(
    message: str, code: str = "stream_error", sent: int = 0, status: int = 500
) -> str:
    """OpenAI's error after the 200: the same object as before it, as `event: error`, then
    `data: [DONE]` (the official SDK raises `APIError` on it)."""
    payload = json.dumps(error_body(status, message, code=code))
    return f"event: error\ndata: {payload}\n\ndata: [DONE]\n\n"


@dataclass(frozen=True)
class Api:
    """One client API as the routes see it."""

    flag: str  # its value in --protocols (spec.streaming.protocols)
    label: str  # its `protocol` metric label
    # The error event after the 200: (message, code, events already sent, status) -> SSE.
    error_event: Callable[[str, str, int, int], str] = openai_error_event
    # The error body before the 200 (status, message, param, code) -> JSON; OpenAI's by default.
    error_body: Callable[..., dict] = error_body


def gate(request: Request, api: Api, path: str) -> tuple[Services, Principal]:
    """Protocol switch (404 naming the flag), then auth; the caller."""
    request.state.protocol = api.label
    request.state.error_body = api.error_body
    svc = services(request)
    svc.require_protocol(api.flag, path)
    return svc, svc.authorize(request, api.label)


def _precheck(request: Request, svc: Services, api: Api, body: dict, who: Principal) -> None:
    """What vLLM would reject less clearly (or not at all), with the API's error shape. The
    model is routed here (unknown: 404 naming what is served; a key limited to other names:
    403); the engine's serving layer then generates with the adapter it names."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise svc.bad_input(api.label, "model: must be a string.", "model")
    svc.route(trail_of(request), who, model)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(name)
        integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if v is not None and (not integral or isinstance(v, bool) or v < 1):
            raise svc.bad_input(api.label, f"{name}: must be a positive integer, got {v!r}.", name)
    refused = refuse_client_field(body)
    if refused is not None:
        raise svc.bad_input(api.label, refused[1], refused[0])


async def _parsed(
    request: Request,
    svc: Services,
    api: Api,
    kind: ApiKind,
    who: Principal,
    kv: dict | None = None,
    prefill: str | None = None,
):
    """The engine and the engine's request object. `kv`: a decode's params from the
    router; `prefill`: the original path of a remote prefill, which is validated as sent,
    then run as `prefill_body` makes it (core/kvtransfer.py)."""
    body = await read_json(request, svc, api.label)
    engine = await svc.require_engine()
    _precheck(request, svc, api, body, who)
    if kind in GENERATING:
        _salt(svc, api, body, who)
    try:
        if prefill is not None:
            engine.api.parse(body, kind)
            body = prefill_body(prefill, body)
        elif kv is not None:
            body[CLIENT_FIELD] = kv
        return engine, engine.api.parse(body, kind)
    except ValidationError as e:
        raise svc.bad_input(api.label, *describe_validation_error(e)) from None


def _transfer(request: Request, svc: Services, api: Api) -> dict | None:
    """The decode params the router sent (X-Sluice-KV-Transfer), or None."""
    s = svc.settings
    try:
        return transfer_in(request.headers, s.continuation_key_file, s.disaggregation_role)
    except ApiError as e:
        raise svc.count(api.label, e) from None


def _salt(svc: Services, api: Api, body: dict, who: Principal) -> None:
    """The body's `cache_salt` becomes the one the engine hashes the prompt with: the
    caller's tenant's combined with the client's own (every API's request model carries
    the field, vLLM's and the simulator's alike)."""
    try:
        client = check_client_salt(body.get("cache_salt"))
    except ValueError as e:
        raise svc.bad_input(api.label, f"cache_salt: {e}.", "cache_salt") from None
    salt = svc.cache_salt(who, client)
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt


def _refused(svc: Services, api: Api, e: ApiRequestError) -> ApiError:
    if 400 <= e.status < 500:
        return svc.bad_input(api.label, e.message, e.param, status=e.status)
    return ApiError(e.status, e.message, param=e.param)


async def answer(request: Request, api: Api, path: str, kind: ApiKind) -> Response:
    """A utility kind (tokenize, detokenize, count_tokens): auth and the request rate
    limit, no stream slot, no generation."""
    svc, who = gate(request, api, path)
    engine, parsed = await _parsed(request, svc, api, kind, who)
    await svc.admit_request(api.label, who)
    try:
        reply = await engine.api.respond(parsed, kind, request)
    except ApiRequestError as e:
        raise _refused(svc, api, e) from None
    return JSONResponse(reply.body, reply.status)


async def generate(request: Request, api: Api, path: str, kind: ApiKind) -> Response:
    """A generating kind, streamed (SSE) when the body asks for it. With a queue, a request
    that waits for a slot waits here up to a heartbeat (a refusal is then a real 429/503);
    a stream still waiting then commits to 200 and waits in the stream core."""
    assert kind in GENERATING
    svc, who = gate(request, api, path)
    prefill = path if request.scope.get(PREFILL_KEY) else None
    kv = None if prefill is not None else _transfer(request, svc, api)
    engine, parsed = await _parsed(request, svc, api, kind, who, kv, prefill)
    trail = trail_of(request)
    cont: Continuation | None = request.scope.get(SCOPE_KEY)
    resume = cont.token_ids if cont is not None else None
    marked = is_marked(
        cont is not None, ROUTER_HEADER in request.headers, svc.settings.continuation_key_file
    )
    ticket = await svc.admit(api.label, who, trail, continuation=cont is not None)
    t0 = received_at(request)
    priority = svc.engine_priority(who)
    held = True  # the ticket is released here unless a stream took it over
    try:
        streaming = bool(getattr(parsed, "stream", False))
        commit = svc.settings.heartbeat_seconds if streaming else None
        try:
            admitted = await svc.wait_admitted(request, api.label, ticket, commit)
        except ClientGone:
            trail.end(DISCONNECTED, 499)
            return Response(status_code=499)
        if not admitted:  # committed: the engine request starts once a slot is free
            later = _Later(engine, parsed, kind, request, priority, resume)
            handle = open_stream(
                svc, trail, who, _source(later.chunks(), cont, svc, kv), t0, later.prompt_tokens,
                ticket=ticket, marked=marked, continued=cont is not None,
            )  # fmt: skip
            held = False
            return _sse(svc, api, *handle, cont)
        try:
            result = await unless_disconnected(
                request, engine.api.respond(parsed, kind, request, priority, resume)
            )
        except ApiRequestError as e:
            raise _refused(svc, api, e) from None
        if result is None:  # client left while the engine rendered or generated (non-stream)
            Meter(bind(svc.metrics, api.label, trail.model), t0, trail).finish(DISCONNECTED)
            return Response(status_code=499)
        if not isinstance(result, ApiStream):  # a whole answer
            trail.prompt_tokens = lambda: result.prompt_tokens
            meter = Meter(bind(svc.metrics, api.label, trail.model), t0, trail)
            meter.tokens = result.completion_tokens
            meter.finish(FINISHED)
            ticket.charge(result.completion_tokens)
            if prefill is not None:  # the decode request bills the whole request
                return _prefilled(svc, result.body, result.prompt_tokens)
            svc.bill(who, result.prompt_tokens + result.completion_tokens)
            if kv is not None:
                svc.kv_transferred("in", cached_in_usage(result.body))
            return JSONResponse(result.body, result.status)
        handle = open_stream(
            svc, trail, who, _source(result.chunks, cont, svc, kv), t0, result.prompt_tokens,
            ticket=ticket, marked=marked, continued=cont is not None,
        )  # fmt: skip
        held = False  # the stream owns the slot now
        return _sse(svc, api, *handle, cont)
    finally:
        if held:
            ticket.release()


def _source(
    chunks: AsyncIterator, cont: Continuation | None, svc: Services, kv: dict | None
) -> AsyncIterator:
    if kv is not None:
        chunks = received(chunks, svc)
    return chunks if cont is None else continued(chunks, cont, framed=True)


async def received(chunks: AsyncIterator[Delta], svc: Services) -> AsyncGenerator[Delta, None]:
    """A decode stream's Deltas; its finished one's cached tokens are the prompt tokens
    the prefill's KV cache spared (`sluice_kv_transfer_tokens_total{direction="in"}`)."""
    try:
        async for d in chunks:
            if d.finished and d.finish_reason != "abort":
                svc.kv_transferred("in", d.cached_tokens)
            yield d
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # aborts an unfinished engine request at once


def _prefilled(svc: Services, body: dict, prompt_tokens: int) -> JSONResponse:
    """A remote prefill's answer (core/kvtransfer.py): the params the engine returned for
    the decode pod (None when its connector returns none) and the prompt's size."""
    params = body.get(CLIENT_FIELD) if isinstance(body, dict) else None
    svc.kv_transferred("out", prompt_tokens)
    return JSONResponse({"kv_transfer_params": params, "prompt_tokens": prompt_tokens})


def _sse(
    svc: Services, api: Api, stream: Stream, meter: Meter, cleanup, cont: Continuation | None
) -> SSEResponse:
    events = frames(stream, meter, api.error_event)
    if stream.marked:
        events = marked_frames(stream, meter, api.error_event, cont)
    return SSEResponse(
        events,
        cleanup,
        ping=svc.settings.heartbeat_seconds,
        send_timeout=svc.settings.send_timeout_seconds,
        headers={MARKED_HEADER: "1"} if stream.marked else None,
    )


class _Later:
    """A streamed answer whose engine request starts only when its queued stream is
    admitted (the stream core iterates `chunks()` then)."""

    def __init__(
        self, engine, parsed, kind: ApiKind, request: Request, priority: int, resume
    ) -> None:
        self.engine, self.parsed, self.kind = engine, parsed, kind
        self.request, self.priority, self.resume = request, priority, resume
        self.result: ApiStream | None = None

    def prompt_tokens(self) -> int:
        return self.result.prompt_tokens() if self.result is not None else 0

    async def chunks(self) -> AsyncIterator:
        result = await self.engine.api.respond(
            self.parsed, self.kind, self.request, self.priority, self.resume
        )
        if not isinstance(result, ApiStream):  # pragma: no cover - stream was asked for
            raise RuntimeError("the engine answered a streamed request as a whole")
        self.result = result
        try:
            async for delta in result.chunks:
                yield delta
        finally:
            aclose = getattr(result.chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # aborts an unfinished engine request at once


async def unless_disconnected(request: Request, work):
    """Run `work`; if the client goes first, cancel it (aborting any engine request) and
    return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


async def frames(stream: Stream, meter: Meter, error_event) -> AsyncIterator[bytes]:
    """The engine's framed events pass through unchanged (whatever piled up as one block);
    a failure after the 200 becomes the API's error event. The loop runs to its end after
    `Finished` (the engine's chunks already hold the final events), so the stream is
    recorded as finished, not as a client that left."""
    sent = 0  # events so far (frames end with a blank line; JSON strings escape newlines)
    async for ev in events(stream, meter):
        if type(ev) is Tokens:
            sent += ev.text.count("\n\n")
            yield ev.text.encode()
        elif type(ev) is Failed:
            yield error_event(ev.message, ev.code, sent, ev.status).encode()
        elif type(ev) is Waiting:
            yield QUEUED


async def marked_frames(
    stream: Stream, meter: Meter, error_event, cont: Continuation | None
) -> AsyncIterator[bytes]:
    """`frames` for a stream the router relays: each write's last frame carries the event
    id in a `: sluice-id` comment (core/streaming/continuation.py): the stream's name (its response id and creation
    time, read from its first frame, or a continuation's), the index of that frame among
    the stream's events and the token ids the write carried."""
    sent = cont.next_event if cont is not None else 0
    name = stream_name(cont.response_id, cont.created) if cont is not None else None
    async for ev in events(stream, meter):
        if type(ev) is Tokens:
            text = ev.text
            if name is None:
                rid, created = frame_identity(text)
                name = stream_name(rid or "-", created)
            sent += text.count("\n\n")
            yield with_mark(text, event_id(name, sent - 1, ev.ids)).encode()
        elif type(ev) is Failed:
            if ev.code == HANDED_OVER:
                raise HandedOver
            yield error_event(ev.message, ev.code, sent, ev.status).encode()
        elif type(ev) is Waiting:
            yield QUEUED
