"""`/ws/stream`: several concurrent generations per socket, keyed by the client's `id`.

Client frames: `{"id", "prompt"|"messages", "params": {...}}` starts one;
`{"type": "stop", "id"}` stops one at once. Server frames: `{"id", "index", "token",
"finished": false}`, a final `{"id", "index", "token": "", "finished": true,
"finish_reason", "usage"}`, and `{"id", "type": "error", "error": {...}}`; with a queue, a
generation waiting for a stream slot gets `{"id", "type": "queued", "waited_ms"}` at once
and every heartbeat until its first token. A bad frame gets
an error frame and the socket stays usable. The handshake's credential is checked again for
every generation: once a reload removed the key, or the token expired, a new one gets a 401
error frame (generations already running go on, as an HTTP stream does). Pings are the
WebSocket protocol's own (uvicorn `ws_ping_interval` = --heartbeat-seconds).

Through the router (`X-Sluice-Router` at the handshake) each token frame and the final
frame start with `"_sluice":"<index>;<token ids>",` (docs/migration.md), a key the router
strips before the client sees the frame. A socket opened with the router's continuation key
(`X-Sluice-Continuation-Key`) may start a generation with `"continuation": {"token_ids",
"next_event"}`: the rest of a generation another replica started, its frames numbered on
from `next_event`. On a decode pod of a disaggregated model, such a socket may also start one
with `"kv_transfer_params": {...}`: what `POST /internal/prefill` (path `/v1/stream`, the
frame's prompt or messages, model and params as its body) returned (core/kvtransfer.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from json.encoder import encode_basestring_ascii as _json_str

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from ..core import kvtransfer
from ..core.auth.cachesalt import ROUTER_HEADER
from ..core.auth.identity import Principal
from ..core.auth.routerkey import KEY_HEADER, key_refusal
from ..core.errors import ApiError, error_body
from ..core.lifecycle import open_stream
from ..core.params import to_stream_request
from ..core.services import Services, api_key_of, services, trail_of
from ..core.streaming.continuation import Continuation, continued, not_continuable
from ..core.streaming.continuation import marked as is_marked
from ..core.streaming.events import Failed, Finished, Meter, Stopped, Tokens, Waiting, events
from ..core.streaming.stream import HANDED_OVER, Stream
from ..core.telemetry.accesslog import Trail
from ..transport.cors import websocket_origin_allowed
from ..transport.sendwatch import SendWatchdog
from .engine_api import received

router = APIRouter()
PROTOCOL = "websocket"
_dumps = json.dumps


@router.websocket("/ws/stream")
async def ws_stream(ws: WebSocket) -> None:
    svc = services(ws)
    try:
        svc.require_protocol(PROTOCOL, "/ws/stream")
        origin = ws.headers.get("origin")
        if not websocket_origin_allowed(svc.settings, origin, ws.headers.get("host")):
            raise svc.count(
                PROTOCOL,
                ApiError(
                    403,
                    f"Origin {origin} is not allowed (--cors-allowed-origins).",
                    reason="origin",
                    code="origin_not_allowed",
                ),
            )
        who = svc.authorize(ws, PROTOCOL, allow_query=True)
        given = ws.headers.get(KEY_HEADER.decode())
        continuing = given is not None
        if given is not None:
            refusal = key_refusal(svc.settings.continuation_key_file, given.encode())
            if refusal is not None:
                raise ApiError(*refusal)
        await svc.require_engine()
        if svc.gate.draining:
            raise svc.count(
                PROTOCOL,
                ApiError(
                    503, "Server is shutting down.", reason="draining", headers={"Retry-After": "1"}
                ),
            )
    except ApiError as e:
        await _deny(ws, e)
        return
    await ws.accept()
    conn = Connection(ws, svc, trail_of(ws), who, api_key_of(ws, allow_query=True))
    conn.marked = is_marked(
        continuing, ROUTER_HEADER in ws.headers, svc.settings.continuation_key_file
    )
    conn.continuing = continuing
    await conn.run()


async def _deny(ws: WebSocket, e: ApiError) -> None:
    """Refuse the handshake with a real HTTP status where the server supports it."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(e.body(), e.status, headers=e.headers))
    else:  # pragma: no cover - uvicorn supports the denial extension
        await ws.close(code=1008, reason=e.message[:120])


class Connection:
    """One socket: a reader loop plus one task per generation; `finally` cancels them all
    (each task's own cleanup then aborts its engine request). Each generation has its own
    trail (the handshake's request id, the client's `id` as `stream`)."""

    def __init__(
        self, ws: WebSocket, svc: Services, trail: Trail, who: Principal, credential: str | None
    ) -> None:
        self.ws, self.svc, self.trail, self.who = ws, svc, trail, who
        self.credential = credential
        self.tasks: dict[str | int, asyncio.Task] = {}  # by the frame's id (string or number)
        self.streams: dict[str | int, Stream] = {}
        self.lock = asyncio.Lock()
        # One watchdog per socket on its transport (transport/sendwatch.py): a reader that
        # accepts no bytes for the send timeout is cut off, which ends every generation on
        # the socket as `stalled`; not a timeout scope per frame.
        self.watchdog = SendWatchdog(svc.settings.send_timeout_seconds)
        # Frames skip the middlewares once accepted (the send app.py's Edge received): the
        # middlewares and Starlette's state checks in `WebSocket.send` only matter for the
        # handshake and the close.
        self.raw_send = ws.scope.get("sluice.send", ws.send)
        self.marked = False  # relayed by the router: frames carry their token ids
        self.continuing = False  # opened with the router's continuation key

    async def run(self) -> None:
        self.watchdog.start(self.ws.scope.get("sluice.transport"))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                t0 = time.perf_counter()
                text = message.get("text")
                if text is None:
                    await self.error(None, 400, "Frames must be JSON text.", "bad_frame")
                    continue
                await self.handle(text, t0)
        except WebSocketDisconnect:
            return
        finally:
            for task in self.tasks.values():
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.watchdog.stop()

    async def handle(self, text: str, t0: float) -> None:
        try:
            frame = json.loads(text)
        except ValueError as e:
            return await self.error(None, 400, f"Invalid JSON frame: {e}", "invalid_json")
        if not isinstance(frame, dict):
            return await self.error(None, 400, "A frame must be a JSON object.", "bad_frame")
        rid = frame.get("id")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
            return await self.error(
                None, 400, "Every frame needs an `id` (string or number).", "bad_frame"
            )
        kind = frame.get("type", "generate")
        if kind == "stop":
            return self.stop(rid)
        if kind != "generate":
            return await self.error(rid, 400, f"Unknown frame type `{kind}`.", "bad_frame")
        if rid in self.tasks:
            return await self.error(
                rid, 400, f"Request `{rid}` is already running.", "duplicate_id"
            )
        params = frame.get("params") or {}
        if not isinstance(params, dict):
            return await self.error(rid, 400, "`params` must be an object.", "bad_frame")
        body = {k: frame[k] for k in ("prompt", "messages", "model") if k in frame}
        body.update(params)
        cont = None
        if "continuation" in frame:
            problem = self.continuation(rid, frame["continuation"], body)
            if isinstance(problem, tuple):
                return await self.error(rid, *problem)
            cont = problem
        kv = None
        if kvtransfer.CLIENT_FIELD in frame:
            got = self.kv_params(frame[kvtransfer.CLIENT_FIELD])
            if isinstance(got, tuple):
                return await self.error(rid, *got)
            kv = got
        svc = self.svc
        trail = self.trail.child(str(rid), t0)
        try:
            self.who = svc.authenticate(PROTOCOL, self.credential)
            trail.kid, trail.tenant = self.who.id, self.who.tenant
            engine = await svc.require_engine()
            req = to_stream_request(
                body, f"ws-{uuid.uuid4().hex}", engine, lambda m: svc.route(trail, self.who, m)
            )
            # may wait: in the stream
            ticket = await svc.admit(PROTOCOL, self.who, trail, continuation=cont is not None)
        except ApiError as e:
            svc.refuse(trail, e)
            return await self.error(rid, e.status, e.message, e.code)
        req.trace_headers = trail.carrier
        req.priority = svc.engine_priority(self.who)
        req.cache_salt = svc.cache_salt(self.who, req.cache_salt)
        req.kv_transfer_params = kv
        n_prompt = len(req.prompt_token_ids or ())
        source = engine.generate(req)
        if kv is not None:
            source = received(source, svc)
        if cont is not None:
            req.resume_ids = cont.token_ids
            source = continued(source, cont, framed=False)
        stream, meter, cleanup = open_stream(
            svc, trail, self.who, source, t0, lambda: n_prompt, ticket=ticket,
            marked=self.marked, first_event=cont.next_event if cont is not None else 0,
            continued=cont is not None,
        )  # fmt: skip
        self.streams[rid] = stream
        task = asyncio.create_task(self.pump(rid, stream, meter, cleanup))
        self.tasks[rid] = task

    def kv_params(self, spec) -> dict | tuple[int, str, str]:
        """A generate frame's `kv_transfer_params` (a decode's), or (status, message, code)
        refusing them: only the router's socket brings them, only to a decode pod."""
        if not self.continuing:
            return 403, ("kv_transfer_params are accepted only from the Sluice router (a "
                         "socket opened with X-Sluice-Continuation-Key)."), "forbidden"  # fmt: skip
        if self.svc.settings.disaggregation_role != "decode":
            return 403, ("kv_transfer_params are accepted only by a decode pod "
                         "(--disaggregation-role decode)."), "forbidden"  # fmt: skip
        if spec is not None and not isinstance(spec, dict):
            return 400, "`kv_transfer_params` must be an object.", "invalid_kv_transfer"
        return spec or {}

    def continuation(self, rid, spec, body: dict) -> Continuation | tuple[int, str, str]:
        """A generate frame's `continuation`, or (status, message, code) refusing it."""
        if not self.continuing:
            return 403, ("Only the router continues a generation (a socket opened with "
                         "X-Sluice-Continuation-Key)."), "forbidden"  # fmt: skip
        ids = spec.get("token_ids") if isinstance(spec, dict) else None
        nxt = spec.get("next_event") if isinstance(spec, dict) else None
        if (
            not isinstance(ids, list)
            or not all(type(i) is int and 0 <= i < 2**31 for i in ids)
            or type(nxt) is not int
            or nxt < 0
        ):
            return 422, ("`continuation` must be {\"token_ids\": [non-negative integers], "
                         "\"next_event\": a non-negative integer}."), "invalid_continuation"  # fmt: skip
        problem = not_continuable("/v1/stream", body, len(ids))
        if problem is not None:
            return 422, problem[1], "not_continuable"
        return Continuation(ids, nxt, str(rid))

    def stop(self, rid) -> None:
        """Client stop: end generation now; the pump sends the final frame (finish_reason
        "abort")."""
        stream = self.streams.get(rid)
        if stream is not None:
            stream.stop()

    async def send(self, text: str) -> None:
        """One text frame. A socket the client closed (or the watchdog cut off) raises
        WebSocketDisconnect, as Starlette's `WebSocket.send` would."""
        async with self.lock:
            try:
                await self.watchdog.send(self.raw_send, {"type": "websocket.send", "text": text})
            except OSError:
                raise WebSocketDisconnect(code=1006) from None

    async def error(self, rid, status: int, message: str, code: str | None) -> None:
        await self.send(error_frame(rid, status, message, code))

    async def pump(self, rid, stream: Stream, meter: Meter, cleanup) -> None:
        head = '{"id":' + _dumps(rid) + ',"index":'
        seq = stream.first
        send = self.send
        marked = stream.marked
        try:
            async for ev in events(stream, meter):
                if type(ev) is Tokens:
                    token = _json_str(ev.text)  # = json.dumps(text), token_sse.py
                    if marked:
                        ids = ",".join(map(str, ev.ids or ()))
                        mark = f'{{"_sluice":"{seq};{ids}",'
                        await send(f'{mark}{head[1:]}{seq},"token":{token},"finished":false}}')
                    else:
                        await send(f'{head}{seq},"token":{token},"finished":false}}')
                    seq += 1
                elif type(ev) is Finished:
                    final = {
                        "id": rid,
                        "index": seq,
                        "token": "",
                        "finished": True,
                        "finish_reason": ev.reason,
                        "usage": ev.usage,
                    }
                    text = _dumps(final)
                    if marked:
                        text = f'{{"_sluice":"{seq};",{text[1:]}'
                    await self.send(text)
                elif type(ev) is Stopped:
                    final = {
                        "id": rid,
                        "index": seq,
                        "token": "",
                        "finished": True,
                        "finish_reason": "abort",
                        "usage": None,
                    }
                    await self.send(_dumps(final))
                elif type(ev) is Failed:
                    if marked and ev.code == HANDED_OVER:
                        # Handed to the router: the socket closes (1012, service restart)
                        # and the router continues its generations on another replica.
                        await self.ws.close(1012)
                        return
                    await self.error(rid, ev.status, ev.message, ev.code)
                elif type(ev) is Waiting:
                    await send(queued_frame(rid, ev.waited))
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away or was cut off: the cleanup aborts and records it
        finally:
            cleanup(self.watchdog.stalled)
            self.tasks.pop(rid, None)
            self.streams.pop(rid, None)


def error_frame(rid, status: int, message: str, code: str | None) -> str:
    """An error frame: `{"id", "type": "error", "error": {...}}` (id None: not one generation's)."""
    return _dumps({"id": rid, "type": "error", **error_body(status or 400, message, code=code)})


def queued_frame(rid, waited: float) -> str:
    """A generation that waits (for a stream slot, or for its model to start):
    `{"id", "type": "queued", "waited_ms"}`."""
    return f'{{"id":{_dumps(rid)},"type":"queued","waited_ms":{round(waited * 1000)}}}'
