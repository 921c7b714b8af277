"""One WebSocket for a known model: accept it at once, keep it open while the model starts
(uvicorn's pings, every `--heartbeat-seconds`), then open the upstream WebSocket to the pod
(or Service) `Upstream.pick` names (placed by load: a connection's prompts come later, in its
frames) and relay frames both ways until either side closes. The
pod counts the connection in flight until it closes.

Frames the client sends while held (up to `--max-held-frames`) are kept and relayed first,
in order, once the upstream socket is open. Each generation among them hears what a
generation waiting in the server's admission queue hears, from the same keep-alive writer
(core/streaming/keepalive.py): `{"id", "type": "queued", "waited_ms"}` at once and every
`keepaliveSeconds`. Past `maxHeld`: the handshake is refused with
429 and `Retry-After`. Past the hold timeout: an error frame with code `model_starting`,
then close 1013 (try again later). An upstream handshake the model's server refuses (401,
403, 429, ...) becomes an error frame with its status, then close 1008; a client that
leaves while held is dropped, and one that leaves later closes the upstream socket at once
(the server's generations on it are aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin

from ..core.errors import error_body
from ..core.streaming.keepalive import KeepAlive
from ..protocols.websocket import error_frame, queued_frame
from ..transport import handshake
from .metrics import RouterMetrics
from .proxy import HOP_BY_HOP, MODEL_STARTING, Held, retry_after, starting_message
from .tenants import ROUTER_MARK, credential
from .upstream import Upstream

log = logging.getLogger(__name__)
TRY_AGAIN_LATER, POLICY_VIOLATION = 1013, 1008
_NOT_FORWARDED = HOP_BY_HOP | {"origin"}


async def refuse(
    ws: WebSocket, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Refuse the handshake with a real status and JSON body (an outcome: uvicorn's error
    record for it is filtered, transport/handshake.py)."""
    await ws.send_denial_response(JSONResponse(body, status, headers=headers))
    handshake.refused()


def _upstream_headers(scope: Scope) -> list[tuple[str, str]]:
    return [
        *(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if not k.startswith(b"sec-websocket-")
            and k.decode("latin-1") not in _NOT_FORWARDED
            and k != ROUTER_MARK[0]
        ),
        (ROUTER_MARK[0].decode(), ROUTER_MARK[1].decode()),  # the pod names the tenant
    ]


def _origin(scope: Scope) -> Origin | None:
    return next((Origin(v.decode("latin-1")) for k, v in scope["headers"] if k == b"origin"), None)


async def relay(
    scope: Scope,
    receive: Receive,
    send: Send,
    up: Upstream,
    metrics: RouterMetrics,
    max_frames: int,
    connect_timeout: float,
    max_size: int,
) -> None:
    ws = WebSocket(scope, receive, send)
    model = up.model
    if not up.hold():
        metrics.requests.labels(model.namespace, model.name, "rejected").inc()
        m = f"Model {model.key} has {model.max_held} requests waiting for a replica already."
        await refuse(
            ws, 429, error_body(429, m, code="too_many_held"), retry_after(model.keepalive)
        )
        return
    held = Held(up, metrics)
    upstream: ClientConnection | None = None
    try:
        await ws.accept()
        kept: list[Message] = []
        upstream = await _hold(
            ws,
            held,
            receive,
            kept,
            max_frames,
            connect_timeout,
            max_size,
            _upstream_headers(scope),
            _origin(scope),
        )
        if upstream is not None:
            await _relay(ws, receive, upstream, kept)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client went away while a frame was sent to it: dropped, as when it left
    finally:
        if not held.ended:
            held.end("disconnected")
        held.release()
        if upstream is not None:
            await upstream.close()


async def _hold(
    ws: WebSocket,
    held: Held,
    receive: Receive,
    kept: list[Message],
    max_frames: int,
    connect_timeout: float,
    max_size: int,
    headers: list[tuple[str, str]],
    origin: Origin | None,
) -> ClientConnection | None:
    """Wait for a replica, keeping the client's frames; the open upstream socket, or None
    when the hold ended (the client was told why, or left)."""
    up, model, scope = held.up, held.up.model, ws.scope
    loop = asyncio.get_running_loop()
    frame = asyncio.ensure_future(receive())
    ready = asyncio.ensure_future(up.wait_ready())
    due: asyncio.Future[None] = loop.create_future()
    waiting: list[Any] = []  # the ids of the generations the client asked for so far

    def beat() -> None:
        if not due.done():
            due.set_result(None)

    unbeat = KeepAlive.on(loop, model.keepalive).add(beat)
    try:
        while True:
            waits: tuple[asyncio.Future[Any], ...] = (ready, frame, due, *held.wakers())
            done, _ = await asyncio.wait(
                waits,
                timeout=max(held.deadline - time.monotonic(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if due in done:
                due = loop.create_future()
                for rid in waiting:
                    await ws.send_text(queued_frame(rid, held.waited))
                continue
            if frame in done:
                message = frame.result()
                if message["type"] == "websocket.disconnect":
                    held.end("disconnected")
                    return None
                kept.append(message)
                rid = _generation(message, waiting)
                if rid is not None:
                    await ws.send_text(queued_frame(rid, held.waited))
                if len(kept) > max_frames:
                    held.end("rejected")
                    await ws.send_text(
                        error_frame(
                            None,
                            429,
                            f"More than {max_frames} frames sent while the model starts.",
                            "too_many_frames",
                        )
                    )
                    await ws.close(TRY_AGAIN_LATER)
                    return None
                frame = asyncio.ensure_future(receive())
                continue
            if ready in done:
                target = held.pick(scope["path"].encode() + b"?" + scope.get("query_string", b""))
                if target is None:  # its last candidate left meanwhile
                    ready = asyncio.ensure_future(up.wait_ready())
                    continue
                url = target.url.replace("http://", "ws://", 1) + scope["path"]
                if scope.get("query_string"):
                    url += "?" + scope["query_string"].decode("latin-1")
                try:
                    upstream = await connect(
                        url,
                        additional_headers=headers,
                        origin=origin,
                        open_timeout=connect_timeout,
                        proxy=None,
                        max_size=max_size,
                        compression=None,
                    )
                except InvalidStatus as e:  # the server refused the handshake
                    held.end("forwarded")
                    status = e.response.status_code
                    await ws.send_text(error_frame(None, status, _refusal(e), f"http_{status}"))
                    await ws.close(POLICY_VIOLATION)
                    return None
                except (OSError, TimeoutError) as e:  # nobody there (any more): hold again
                    log.info(
                        "%s: WebSocket connect to %s failed (%s); holding again",
                        model.key,
                        target.pod or target.url,
                        type(e).__name__,
                    )
                    up.down(target)
                    held.release()
                    ready = asyncio.ensure_future(up.wait_ready())
                    continue
                held.end("forwarded")
                said = upstream.response.headers.raw_items() if upstream.response else ()
                answer = [(k.encode(), v.encode()) for k, v in said]
                up.tenants.learn(
                    credential(scope["headers"], scope.get("query_string", b"")), 101, answer
                )
                return upstream
            if time.monotonic() < held.deadline:
                continue  # the shutdown began: wait again, up to the new deadline
            held.end("timeout")
            await ws.send_text(error_frame(None, 503, starting_message(held), MODEL_STARTING))
            await ws.close(TRY_AGAIN_LATER)
            return None
    finally:
        unbeat()
        if frame.done() and not frame.cancelled() and frame.exception() is None:
            kept.append(frame.result())  # it arrived while the upstream socket opened
        frame.cancel()
        ready.cancel()


def _generation(message: Message, waiting: list[Any]) -> Any:
    """Note what a kept frame asks for: a new generation's id (returned) joins `waiting`, a
    stop takes its id out. Anything else is the server's to answer once relayed."""
    try:
        frame = json.loads(message.get("text") or "")
    except ValueError:
        return None
    if not isinstance(frame, dict) or not isinstance(frame.get("id"), (str, int)):
        return None
    rid, kind = frame["id"], frame.get("type", "generate")
    if kind == "stop" and rid in waiting:
        waiting.remove(rid)
    if kind != "generate" or rid in waiting:
        return None
    waiting.append(rid)
    return rid


def _refusal(e: InvalidStatus) -> str:
    body = e.response.body or b""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        return str(json.loads(body)["error"]["message"])
    return f"The model's server refused the WebSocket ({e.response.status_code})."


async def _relay(
    ws: WebSocket, receive: Receive, upstream: ClientConnection, kept: list[Message]
) -> None:
    async def to_upstream() -> None:
        for message in kept:
            if message["type"] == "websocket.disconnect":
                return
            await _send_up(upstream, message)
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            await _send_up(upstream, message)

    async def to_client() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in upstream:
                if isinstance(data, str):
                    await ws.send_text(data)
                else:
                    await ws.send_bytes(data)

    tasks = [asyncio.ensure_future(to_upstream()), asyncio.ensure_future(to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if tasks[1] in done and ws.client_state == WebSocketState.CONNECTED:
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await ws.close(code if code not in (1005, 1006) else 1011)


async def _send_up(upstream: ClientConnection, message: Message) -> None:
    text = message.get("text")
    if text is not None:
        await upstream.send(text)
    elif message.get("bytes") is not None:
        await upstream.send(message["bytes"])
