"""The relay's HTTP/1.1 to the pods: an httpx transport on an asyncio protocol and
httptools' parser (C), on keep-alive connections kept in a small idle pool per pod.

Why not httpx's own transport: a streamed answer is relayed chunk by chunk, and there each
chunk of the upstream's chunked body went through h11's pure-Python reader and httpcore's
and anyio's layers: measured with `python -m sluice_bench.router_hop` and py-spy, that was
most of the router's CPU per relayed token, more than the model server spent making the
token. Here a read from the socket is parsed in C, and what one read brought (several
chunks when the relay fell behind) comes out as one piece: one ASGI send instead of one per
upstream chunk, so a busy router writes less often, not later.

What it keeps of httpx's: the same request bytes (the httpx request's headers, which carry
Host and Content-Length, and its body), the connect timeout and read timeout of the
request's `timeout` extension, the `trace` extension's `http11.send_request_headers.started`
(sent once connected, before the request: the proxy's "forwarded"), and httpx's
exceptions: `ConnectError`/`ConnectTimeout` when it cannot connect, `RemoteProtocolError`
for an answer that breaks off or is no HTTP, `ReadTimeout`. Reading pauses while more than
`HIGH_WATER` bytes wait unread (the client reads slowly), as httpcore reads only when asked.
A 1xx interim answer is skipped; a HEAD answer ends after its headers. Other schemes than
plain http go to httpx's own transport.

Connections are reused: opening one per request cost the router a connect and the pod an
accept on every request's path (measured with `python -m sluice_bench.router_hop`). A
connection goes back to its (host, port)'s idle pool (at most `IDLE_MAX` each) only when
its answer ended cleanly: the whole message read (its length or its last chunk, never an
answer that ends at close), no `Connection: close` from either side, no error, no body left
unread. Closing an answer before its end (the client left: the proxy cancels the relay)
closes its connection at once, as before, so the model's server still aborts the
generation; an unfinished answer is never pooled. An idle connection is closed after
`IDLE_SECONDS`, below the model server's keep-alive (`--keep-alive-seconds`, 75 s by
default), so a pod that left the candidate set keeps none for long; one the pod closed
meanwhile (idle timeout, restart) is dropped when taken, and a request whose reused
connection closes before any byte of the answer came (the pod closed it as it was sent)
is sent once more on a new connection. That retry can only fail to connect after the
request counted as forwarded: it then fails as a request the server did not answer.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httptools
import httpx

HIGH_WATER = 256 * 1024
IDLE_SECONDS = 15.0  # an idle connection's life: below the model server's keep-alive
IDLE_MAX = 64  # idle connections kept per (host, port)
_NO_BODY = (204, 304)
# A write-through send of one piece of the body (`relay_body`).
Sink = Callable[[bytes], Awaitable[None]]


class _Answer(asyncio.Protocol):
    """One upstream connection: the answer's head, then its body as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, head_only: bool) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the connection is gone
        self.idle: asyncio.TimerHandle | None = None  # in the pool: when it is closed
        self.reset(head_only)

    def reset(self, head_only: bool) -> None:
        """Ready for the next answer on this connection (a new one, or one from the pool)."""
        self.head_only = head_only
        self.parser = httptools.HttpResponseParser(self)
        self.received = False  # any byte of this answer
        self.read_at = 0.0  # loop time of the last socket read that brought some
        self.wait_from = 0.0  # when a stall watch began (or reading resumed after a pause)
        self.keep_alive = False  # its end leaves the connection usable (on_message_complete)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.has_head = False  # the final (non-1xx) answer's head is complete
        self.complete = False  # its body too
        self.error: httpx.HTTPError | None = None
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None
        # Write-through (`relay_body`): the sink, a send of it that suspended (its coroutine
        # and what it waits for), and what a send raised.
        self.sink: Sink | None = None
        self.pending: tuple[Coroutine[Any, Any, None], Any] | None = None
        self.sink_error: BaseException | None = None

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.complete or self.error is not None:
            self.keep_alive = False  # bytes past the answer's end: never reused
            if self.idle is not None:
                self.close()
            return
        self.received = True
        self.read_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self.error = httpx.RemoteProtocolError(f"The model's server sent no HTTP: {e}")
        if self.sink is None:
            self._reading()
            self._wake()
            return
        self.flush()
        if (
            self.pending is not None
            or self.sink_error is not None
            or self.complete
            or self.error is not None
        ):
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.keep_alive = False
        if not self.complete and self.error is None:
            if self.has_head and self._ends_at_close():
                self.complete = True
            elif self.has_head:
                self.error = httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body"
                )
            else:
                self.error = httpx.RemoteProtocolError(
                    "Server disconnected without sending a response."
                )
        self._wake()

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: the connection is not reused
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            return  # an interim answer: its end (on_message_complete) resets
        self.has_head = True
        if self.head_only or self.status in _NO_BODY:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.headers, self.status = [], 0  # skip the 1xx; the final answer follows
            return
        self.complete = True
        self.keep_alive = not self.head_only and self.parser.should_keep_alive()

    # -- for the transport and the stream --
    def _ends_at_close(self) -> bool:
        """An answer with neither a length nor chunked framing ends with its connection."""
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (
                lower == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return False
        return True

    def _reading(self) -> None:
        """Pause reading from the upstream while its unread body is over `HIGH_WATER` or a
        write-through send waits for the client; resume once neither holds."""
        if self.transport is None:
            return
        stop = self.buffered > HIGH_WATER or self.pending is not None or self.sink_error is not None
        if stop and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        elif not stop and self.paused:
            self.paused = False
            self.transport.resume_reading()

    def flush(self) -> None:
        """Send what is buffered through the sink now, unless a send still waits. A send
        that suspends becomes `pending` (reading pauses) for `relay_body` to finish."""
        if self.sink is None or self.pending is not None or self.sink_error is not None:
            return
        if not self.body:
            return
        sent = self.sink(self._take())
        coro = sent if type(sent) is types.CoroutineType else _awaited(sent)
        try:
            waits = coro.send(None)
        except StopIteration:
            if self.paused:  # paused past HIGH_WATER before the sink was set
                self._reading()
            return
        except BaseException as e:  # noqa: BLE001 - raised again by relay_body
            self.sink_error = e
        else:
            self.pending = (coro, waits)
        self._reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something new arrives (data, the end, an error)."""
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        body = self.body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        return chunk

    def take(self) -> bytes:
        chunk = self._take()
        self._reading()
        return chunk

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        """The answer ended cleanly and left the connection open and empty (module doc)."""
        return (
            self.keep_alive
            and self.complete
            and self.error is None
            and not self.closed
            and not self.body
            and self.pending is None
            and self.sink is None
            and self.transport is not None
            and not self.transport.is_closing()
        )


async def _arrival(answer: _Answer, seconds: float | None) -> None:
    """`answer.wait()`, at most `seconds` (None: no limit; past it httpx's ReadTimeout)."""
    if seconds is None:
        await answer.wait()
        return
    try:
        async with asyncio.timeout(seconds):
            await answer.wait()
    except TimeoutError:
        raise httpx.ReadTimeout("No data from the model's server in time.") from None


class _Body(httpx.AsyncByteStream):
    def __init__(
        self, answer: _Answer, read_timeout: float | None, done: Callable[[_Answer], None]
    ) -> None:
        self.answer, self.read_timeout, self._done = answer, read_timeout, done
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        answer, read_timeout = self.answer, self.read_timeout
        while True:
            if answer.body:
                yield answer.take()
            elif answer.complete:
                return
            elif answer.error is not None:
                raise answer.error
            elif read_timeout is None:
                await answer.wait()
            else:
                await _arrival(answer, read_timeout)

    async def aclose(self) -> None:
        """Its connection back to the pool when the answer ended cleanly, else closed."""
        if not self.closed:
            self.closed = True
            self._done(self.answer)


class HopTransport(httpx.AsyncBaseTransport):
    """httpx's transport for plain-http requests, as the module docstring says."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS, idle_max: int = IDLE_MAX) -> None:
        self._other = httpx.AsyncHTTPTransport()
        self.idle_seconds, self.idle_max = idle_seconds, idle_max
        self._idle: dict[tuple[str, int], list[_Answer]] = {}
        self.opened = 0  # connections opened (reuse shows as fewer than requests)
        self.retried = 0  # requests sent again after a reused connection closed

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self._other.handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        read_timeout = timeouts.get("read")
        head_only = request.method == "HEAD"
        key = (url.host, url.port or 80)
        answer = self._take(key, head_only)
        reused = answer is not None
        if answer is None:
            answer = await self._open(key, head_only, timeouts.get("connect"))
        trace = request.extensions.get("trace")
        if trace is not None:
            try:
                await trace("http11.send_request_headers.started", {"request": request})
            except BaseException:
                answer.close()
                raise
        while True:
            try:
                await self._write(answer, request)
                while not answer.has_head:
                    if answer.error is not None:
                        raise answer.error
                    await _arrival(answer, read_timeout)
            except httpx.RemoteProtocolError:
                answer.close()
                # The pod closed a reused connection before answering: once more, anew.
                if not (reused and answer.closed and not answer.received):
                    raise
                if not isinstance(request.stream, httpx.ByteStream):
                    raise  # a body that cannot be sent twice
                self.retried += 1
                reused = False
                answer = await self._open(key, head_only, timeouts.get("connect"))
                continue
            except BaseException:
                answer.close()
                raise
            break
        return httpx.Response(
            answer.status,
            headers=answer.headers,
            stream=_Body(answer, read_timeout, lambda a: self._done(key, a)),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _open(
        self, key: tuple[str, int], head_only: bool, connect_timeout: float | None
    ) -> _Answer:
        loop = asyncio.get_running_loop()
        answer = _Answer(loop, head_only)
        try:
            async with asyncio.timeout(connect_timeout):
                await loop.create_connection(lambda: answer, *key)
        except TimeoutError:
            raise httpx.ConnectTimeout("Connecting to the model's server timed out.") from None
        except OSError as e:
            raise httpx.ConnectError(str(e)) from e
        self.opened += 1
        return answer

    def _take(self, key: tuple[str, int], head_only: bool) -> _Answer | None:
        """The most recently used idle connection to `key` still open, ready for an answer."""
        idle = self._idle.get(key)
        while idle:
            answer = idle.pop()
            if answer.idle is not None:
                answer.idle.cancel()
                answer.idle = None
            if answer.closed or answer.transport is None or answer.transport.is_closing():
                continue
            answer.reset(head_only)
            return answer
        return None

    def _done(self, key: tuple[str, int], answer: _Answer) -> None:
        """An answer closed: its connection to the pool if it ended cleanly, else closed."""
        idle = self._idle.setdefault(key, [])
        if not answer.reusable() or len(idle) >= self.idle_max:
            answer.close()
            return
        if answer.paused:
            answer.paused = False
            assert answer.transport is not None
            answer.transport.resume_reading()
        idle.append(answer)
        answer.idle = answer.loop.call_later(self.idle_seconds, self._expire, key, answer)

    def _expire(self, key: tuple[str, int], answer: _Answer) -> None:
        answer.idle = None
        idle = self._idle.get(key, [])
        if answer in idle:
            idle.remove(answer)
        if not idle:
            self._idle.pop(key, None)
        answer.close()

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    @staticmethod
    async def _write(answer: _Answer, request: httpx.Request) -> None:
        assert answer.transport is not None
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in request.headers.raw]
        head.append(b"\r\n")
        chunked = "content-length" not in request.headers and "transfer-encoding" in (
            request.headers
        )
        out = answer.transport
        out.write(b"".join(head))
        async for part in request.stream:  # type: ignore[union-attr]
            if chunked and part:
                out.write(b"%x\r\n%s\r\n" % (len(part), part))
            elif part:
                out.write(part)
        if chunked:
            out.write(b"0\r\n\r\n")

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for answer in idle:
                if answer.idle is not None:
                    answer.idle.cancel()
                answer.close()
        self._idle.clear()
        await self._other.aclose()


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable


async def _finish(coro: Coroutine[Any, Any, None], waits: Any) -> None:
    """Run a coroutine that `flush` started and that suspended on `waits` (what it yielded
    to the event loop: a future, or None for a bare yield) to its end; closed if cancelled."""
    try:
        while True:
            if waits is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((waits,))
            try:
                waits = coro.send(None)
            except StopIteration:
                return
    except BaseException:
        coro.close()
        raise


async def _news(answer: _Answer, stall: float) -> None:
    """`answer.wait()`, watching that the socket brings something at least every `stall`
    seconds (a written-through piece wakes no waiter); httpx's ReadTimeout when it brought
    nothing for that long."""
    loop = answer.loop
    while True:
        quiet = loop.time() - max(answer.read_at, answer.wait_from)
        if quiet >= stall:
            raise httpx.ReadTimeout(f"The model's server sent nothing for {stall:g} s.")
        try:
            async with asyncio.timeout(stall - quiet):
                await answer.wait()
            return
        except TimeoutError:
            continue


async def relay_body(
    response: httpx.Response,
    send_piece: Callable[[bytes], Awaitable[None]],
    stall: float | None = None,
) -> None:
    """Send the raw body of an answer `Relay.send` gave, piece by piece, through
    `send_piece` (a coroutine function; an ASGI send of the piece): written through from the
    upstream protocol (see the module docstring) when the answer came from this transport
    with no read timeout, else the pieces iterated. httpx's errors of a broken-off answer
    propagate, as from iterating it. `stall`: an answer whose socket brings nothing for that
    many seconds while the client keeps up is broken off (ReadTimeout)."""
    stream = response.stream
    if not isinstance(stream, _Body) or stream.read_timeout is not None:
        async for piece in pieces(response):
            await send_piece(piece)
        return
    answer = stream.answer
    answer.sink = send_piece
    answer.wait_from = answer.loop.time()
    try:
        while True:
            if answer.pending is not None:
                await _finish(*answer.pending)
                answer.pending = None
                answer.wait_from = answer.loop.time()  # reading paused meanwhile
                answer.flush()  # what arrived while it waited
                answer._reading()
            elif answer.sink_error is not None:
                raise answer.sink_error
            elif answer.body:
                answer.flush()
            elif answer.complete:
                return
            elif answer.error is not None:
                raise answer.error
            elif stall is None:
                await answer.wait()
            else:
                await _news(answer, stall)
    finally:
        answer.sink = None
        if answer.pending is not None:
            answer.pending[0].close()
            answer.pending = None


def pieces(response: httpx.Response) -> AsyncIterator[bytes]:
    """The raw body of an answer `Relay.send` gave, as the pieces the socket reads brought:
    this module's stream itself, without httpx's per-chunk layers (`Response.aiter_raw`'s
    chunker, byte count and error context) when the answer came from this transport."""
    stream = response.stream
    if isinstance(stream, _Body):
        return stream.__aiter__()
    return response.aiter_raw()


class Relay:
    """What the proxy forwards with: the request built by `hop_client`'s client (its default
    headers and timeouts), sent straight to its transport. No redirects, auth or cookie jar
    per request: the model's server answers the router's own request, and its Set-Cookie
    goes to the client, never into a jar shared by all clients."""

    def __init__(self, connect_timeout: float) -> None:
        self.transport = HopTransport()
        self.client = hop_client(connect_timeout, transport=self.transport)
        self.build_request = self.client.build_request

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The answer, its head read and its body not (`pieces`, `aread`, `aclose`)."""
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self.client.aclose()


def hop_client(connect_timeout: float, **options: Any) -> httpx.AsyncClient:
    """The client the relay forwards with: no proxy from the environment, no timeout but
    the connect timeout, and this module's transport."""
    return httpx.AsyncClient(
        trust_env=False,  # a Service address: never through an HTTP proxy
        timeout=httpx.Timeout(None, connect=connect_timeout),
        **{"transport": HopTransport(), **options},
    )
