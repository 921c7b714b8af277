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

A disaggregated model's socket is opened to a decode pod with the model's key, and each
generate frame's prompt is prefilled first (`Prefills`, prefill.py: `POST /internal/prefill`
as `/v1/stream`, the frame's prompt or messages, model and params as the body), then the
frame goes up with the parameters that returned (`"kv_transfer_params"`). Frames go up in
the order the client sent them; a generation's prefill runs while the client's next frames
are read. A prefill that fails, or a prefill pod's refusal, is that generation's error
frame; the client leaving cancels the prefills running. A client's own
`X-Sluice-KV-Transfer` and continuation key are dropped, as on HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin

from ..core.auth.routerkey import KEY_HEADER
from ..core.errors import error_body
from ..core.streaming.keepalive import KeepAlive
from ..protocols.websocket import error_frame, queued_frame
from ..transport import handshake
from .hop import Relay
from .metrics import RouterMetrics
from .migration import Generations, busy, key_for
from .models import Migration
from .prefill import NoPod, Prefill, PrefillFailed
from .proxy import (
    HOP_BY_HOP,
    MODEL_STARTING,
    PREFILL_FAILED,
    ROUTERS_OWN,
    Held,
    retry_after,
    starting_message,
    upstream_error,
)
from .tenants import ROUTER_MARK, credential
from .upstream import Target, Upstream

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
            and k not in ROUTERS_OWN
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
    continuation_key: Path | None = None,
    client: Relay | None = None,
) -> None:
    """`client`: what a disaggregated model's prefills are sent with."""
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
    headers, origin = _upstream_headers(scope), _origin(scope)
    prefills = None
    if up.prefill is not None and client is not None:
        prefills = Prefills(ws, Prefill(client, up.prefill, metrics, continuation_key))
        if continuation_key is not None:  # the decode pod takes the params on its socket
            with contextlib.suppress(OSError):  # unreadable: each prefill says so
                key = key_for(continuation_key, model.namespace, model.name)
                headers.append((KEY_HEADER.decode(), key.decode()))
    moving = None
    if continuation_key is not None and model.migration is not None and model.pods is not None:
        moving = Moving(held, metrics, headers, origin, connect_timeout, max_size,
                        continuation_key)  # fmt: skip
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
            headers,
            origin,
            pings(model.migration if moving is not None else None),
        )
        if upstream is not None:
            await _relay(ws, receive, upstream, kept, moving, prefills)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client went away while a frame was sent to it: dropped, as when it left
    finally:
        if prefills is not None:
            await prefills.aclose()
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
    ping: tuple[float, float],
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
                try:
                    upstream = await _connect(
                        target, scope, headers, origin, connect_timeout, max_size, ping
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


async def _connect(
    target: Target,
    scope: Scope,
    headers: list[tuple[str, str]],
    origin: Origin | None,
    connect_timeout: float,
    max_size: int,
    ping: tuple[float, float],
) -> ClientConnection:
    """The upstream WebSocket to `target` for the client's path and query."""
    url = target.url.replace("http://", "ws://", 1) + scope["path"]
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    return await connect(
        url,
        additional_headers=headers,
        origin=origin,
        open_timeout=connect_timeout,
        proxy=None,
        max_size=max_size,
        compression=None,
        ping_interval=ping[0],
        ping_timeout=ping[1],
    )


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
    ws: WebSocket,
    receive: Receive,
    upstream: ClientConnection,
    kept: list[Message],
    moving: Moving | None = None,
    prefills: Prefills | None = None,
) -> None:
    """Relay both ways until either side closes; with `moving` (a model whose streams are
    continued), an upstream that breaks with generations unfinished is replaced by another
    pod's socket that continues them; with `prefills` (a disaggregated model), client
    frames go up through it."""
    gens = moving.gens if moving is not None else None
    while True:
        client_left, upstream = await _pump(ws, receive, upstream, kept, gens, prefills)
        kept = []
        if client_left or moving is None or not moving.gens.open or not moving.gens.marking:
            break
        replaced = await moving.replace(ws, upstream)
        if replaced is None:
            break
        upstream = replaced
    if not client_left and ws.client_state == WebSocketState.CONNECTED:
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await ws.close(code if code not in (1005, 1006) else 1011)


async def _pump(
    ws: WebSocket,
    receive: Receive,
    upstream: ClientConnection,
    kept: list[Message],
    gens: Generations | None,
    prefills: Prefills | None = None,
) -> tuple[bool, ClientConnection]:
    """Frames both ways until one side closes: (whether it was the client, the upstream)."""

    async def up(message: Message) -> None:
        if prefills is None:
            await _send_up(upstream, message, gens)
        else:
            prefills.send(upstream, message, gens)

    async def to_upstream() -> None:
        for message in kept:
            if message["type"] == "websocket.disconnect":
                return
            await up(message)
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            await up(message)

    async def to_client() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in upstream:
                if isinstance(data, str):
                    await ws.send_text(data if gens is None else gens.received(data))
                else:
                    await ws.send_bytes(data)

    tasks = [asyncio.ensure_future(to_upstream()), asyncio.ensure_future(to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    client_left = tasks[0] in done and not tasks[0].cancelled() and tasks[0].exception() is None
    return client_left, upstream


class Moving:
    """A relayed socket whose generations are continued on another pod when its pod's
    socket breaks (the model's `migration`; docs/migration.md): the generations and what
    their client received (migration.Generations), the pods it broke on, its moves."""

    def __init__(
        self,
        held: Held,
        metrics: RouterMetrics,
        headers: list[tuple[str, str]],
        origin: Origin | None,
        connect_timeout: float,
        max_size: int,
        key_file: Path,
    ) -> None:
        model = held.up.model
        assert model.migration is not None
        self.held, self.metrics, self.headers, self.origin = held, metrics, headers, origin
        self.connect_timeout, self.max_size, self.key_file = connect_timeout, max_size, key_file
        self.migration = model.migration
        self.gens = Generations()
        self.moves = 0
        self.left: set[str] = set()
        labels = (model.namespace, model.name)
        self._labels = labels
        self._gap = metrics.migration_gap.labels(*labels)
        self.gens.on_seam = self._gap.observe

    async def replace(self, ws: WebSocket, broken: ClientConnection) -> ClientConnection | None:
        """Another pod's socket with every unfinished generation continued on it; None when
        there is none (each open generation was sent its error frame)."""
        held, up, model = self.held, self.held.up, self.held.up.model
        target = held.target
        if target is not None and target.pod is not None:
            self.left.add(target.pod)
            up.down(target)
        open_ = list(self.gens.open.values())
        seam = self.gens.last_at
        if self.moves >= self.migration.max_migrations:
            m = (
                "The model's server closed the socket mid-generation after it was moved "
                f"{self.moves} times (maxMigrations)."
            )
            await self._fail(ws, "exhausted", 502, m)
            return None
        self.moves += 1
        deadline = time.monotonic() + model.hold_timeout
        while time.monotonic() < deadline:
            target = held.pick(b"", None, None, self.left)
            if target is None:
                await up.pods_change(max(min(deadline - time.monotonic(), model.keepalive), 0.05))
                continue
            try:
                key = key_for(self.key_file, model.namespace, model.name).decode()
            except OSError as e:
                await self._fail(
                    ws, "refused", 503, f"The router cannot read its continuation key: {e}."
                )
                return None
            try:
                upstream = await _connect(
                    target, ws.scope, [*(h for h in self.headers if h[0] != KEY_HEADER.decode()), (KEY_HEADER.decode(), key)], self.origin,
                    self.connect_timeout, self.max_size, pings(self.migration),
                )  # fmt: skip
            except InvalidStatus as e:
                status = e.response.status_code
                if busy(status, e.response.headers) and target.pod is not None:
                    self.left.add(target.pod)
                    continue
                await self._fail(
                    ws, "refused", status, f"The stream could not be continued: {_refusal(e)}"
                )
                return None
            except (OSError, TimeoutError):
                if target.pod is not None:
                    self.left.add(target.pod)
                    up.down(target)
                continue
            for gen in open_:
                await upstream.send(gen.continuation())
            self.gens.seam = seam
            self._results("continued", len(open_))
            log.info("%s: %d WebSocket generations migrated to %s, move %d",
                     model.key, len(open_), target.pod, self.moves)  # fmt: skip
            return upstream
        m = (
            "The model's server closed the socket mid-generation and no other replica "
            f"took it within {model.hold_timeout:g} s."
        )
        await self._fail(ws, "unavailable", 503, m)
        return None

    def _results(self, result: str, n: int) -> None:
        self.metrics.migrations.labels(*self._labels, result).inc(n)

    async def _fail(self, ws: WebSocket, result: str, status: int, message: str) -> None:
        self._results(result, len(self.gens.open))
        log.info("%s: WebSocket generations not continued (%s): %s",
                 self.held.up.model.key, result, message)  # fmt: skip
        with contextlib.suppress(Exception):
            for rid in list(self.gens.open):
                await ws.send_text(error_frame(rid, status, message, "upstream_error"))
        self.gens.open.clear()
        return None


def pings(migration: Migration | None) -> tuple[float, float]:
    """The upstream socket's ping interval and timeout: a model whose streams move gives up
    a pod that answers no ping within about its `stallSeconds` (a silent pod), else
    websockets' defaults (20 s and 20 s)."""
    if migration is None:
        return 20.0, 20.0
    half = migration.stall_seconds / 2
    return half, half


async def _send_up(
    upstream: ClientConnection, message: Message, gens: Generations | None = None
) -> None:
    text = message.get("text")
    if text is not None:
        if gens is not None:
            gens.sent(text)
        await upstream.send(text)
    elif message.get("bytes") is not None:
        await upstream.send(message["bytes"])


class Prefills:
    """A disaggregated model's socket: each generate frame's prompt prefilled on a prefill
    pod (prefill.py) before the frame goes to the decode pod with the parameters. `send`
    never waits: each frame's step runs as a task that prefills (a generate frame), then
    waits for the frame before it to be sent, then sends, so frames keep their order while
    the client's next ones are read. A failed or refused prefill is its generation's error
    frame (the frame is not sent); `aclose` cancels the steps left (the client left: their
    prefill requests close at once)."""

    def __init__(self, ws: WebSocket, prefill: Prefill) -> None:
        self.ws, self.prefill = ws, prefill
        self.tail: asyncio.Task[None] | None = None  # the last frame's step
        self.steps: set[asyncio.Task[None]] = set()

    def send(self, upstream: ClientConnection, message: Message, gens: Generations | None) -> None:
        step = asyncio.ensure_future(self._step(upstream, message, gens, self.tail))
        self.tail = step
        self.steps.add(step)
        step.add_done_callback(self.steps.discard)

    async def _step(
        self,
        upstream: ClientConnection,
        message: Message,
        gens: Generations | None,
        before: asyncio.Task[None] | None,
    ) -> None:
        frame = _generate(message)
        outcome: dict[str, Any] | str | None = None
        if frame is not None:
            outcome = await self._prefill(frame)
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)  # the frames before first
        with contextlib.suppress(ConnectionClosed, WebSocketDisconnect, RuntimeError, OSError):
            if isinstance(outcome, str):  # its error frame
                await self.ws.send_text(outcome)
                return
            if outcome is not None and frame is not None:
                text = json.dumps({**frame, "kv_transfer_params": outcome})
                if gens is not None:
                    gens.sent(message["text"])  # as the client sent it: a move prefills anew
                await upstream.send(text)
                return
            await _send_up(upstream, message, gens)

    async def _prefill(self, frame: dict[str, Any]) -> dict[str, Any] | str | None:
        """The frame's parameters (None: the engine gave none), or its error frame."""
        rid, up = frame["id"], self.prefill.up
        body = {**(frame.get("params") or {})}
        body.update({k: frame[k] for k in ("prompt", "messages", "model") if k in frame})
        scope = self.ws.scope
        headers = [
            (k, v) for k, v in scope["headers"]
            if not k.startswith(b"sec-websocket-")
            and k.decode("latin-1") not in _NOT_FORWARDED and k not in ROUTERS_OWN
        ]  # fmt: skip
        tie = json.dumps(body, sort_keys=True).encode()
        try:
            for _ in range(2):  # no prefill pod now: once more after waiting for one
                try:
                    got = await self.prefill.run(
                        "POST", "/v1/stream", json.dumps(body).encode(), headers, tie, None
                    )
                    break
                except NoPod:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(up.wait_ready(), up.model.hold_timeout)
            else:
                m = f"No prefill pod of model {up.model.key} is ready."
                return error_frame(rid, 503, m, MODEL_STARTING)
        except PrefillFailed as e:
            return error_frame(rid, 502, str(e), PREFILL_FAILED)
        if isinstance(got, httpx.Response):  # the prefill pod refused it: the client's error
            raw = await got.aread()
            await got.aclose()
            message, code, status = upstream_error(got, raw)
            return error_frame(rid, status, message, code)
        return {} if got.params is None else got.params  # `{}`: a decode all the same

    async def aclose(self) -> None:
        for step in list(self.steps):
            step.cancel()
        await asyncio.gather(*self.steps, return_exceptions=True)


def _generate(message: Message) -> dict[str, Any] | None:
    """A generate frame that starts a generation (not a continuation), parsed; else None."""
    try:
        frame = json.loads(message.get("text") or "")
    except ValueError:
        return None
    if (
        not isinstance(frame, dict)
        or not isinstance(frame.get("id"), (str, int))
        or frame.get("type", "generate") != "generate"
        or "continuation" in frame
    ):
        return None
    return frame
