"""router/hop.py against a raw socket server that writes exactly the bytes each case needs:
the request as sent, chunks that arrived together relayed as one piece, each way an answer
can end (length, chunked, connection close, HEAD, 204, a 1xx before it) and each way it
can fail (refused, broken off midway, no HTTP); `relay_body`'s write-through: every piece
sent in order from the upstream protocol itself, a send that waits (a slow client) pausing
the upstream with little held, a cancel closing at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from sluice_server.router import hop
from sluice_server.router.hop import Relay, hop_client, relay_body

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def upstream(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server on 127.0.0.1 that records each request's head and answers with `answer`."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", heads


def writes(*parts: bytes, pause: float = 0.0) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)

    return answer


async def relay(url: str, method: str = "POST", **kw) -> tuple[httpx.Response, list[bytes]]:
    async with hop_client(5.0) as client:
        response = await client.send(client.build_request(method, url + "/v1/x?a=1", **kw),
                                     stream=True)  # fmt: skip
        try:
            return response, [chunk async for chunk in response.aiter_raw()]
        finally:
            await response.aclose()


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def test_request_bytes_and_a_chunked_answer_relayed_as_it_came():
    async with upstream(writes(CHUNKED, b"3\r\nabc\r\n", b"2\r\nde\r\n0\r\n\r\n", pause=0.05)) as (
        url,
        heads,
    ):
        traced: list[str] = []

        async def trace(event: str, info: dict) -> None:
            traced.append(event)

        r, chunks = await relay(url, content=b'{"x":1}', headers={"x-sluice-tenant-of": "1"},
                                extensions={"trace": trace})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert chunks == [b"abc", b"de"]  # apart in time: apart for the client
    assert traced == ["http11.send_request_headers.started"]
    head = heads[0].decode()
    assert head.startswith("POST /v1/x?a=1 HTTP/1.1\r\n")
    assert "content-length: 7\r\n" in head.lower() and "host: 127.0.0.1:" in head.lower()


async def test_chunks_that_arrived_together_are_one_piece():
    body = b"".join(b"1\r\n%s\r\n" % bytes([c]) for c in b"abcdef") + b"0\r\n\r\n"
    async with upstream(writes(CHUNKED + body)) as (url, _):
        _, chunks = await relay(url)
    assert b"".join(chunks) == b"abcdef" and len(chunks) < 6


@pytest.mark.parametrize(
    "answer, method, body",
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", "GET", b"hello"),
        (b"HTTP/1.1 200 OK\r\n\r\nuntil close", "GET", b"until close"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", "HEAD", b""),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", b""),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
         "POST", b"ok"),
    ],
)  # fmt: skip
async def test_each_way_an_answer_ends(answer, method, body):
    async with upstream(writes(answer)) as (url, _):
        r, chunks = await relay(url, method)
    assert b"".join(chunks) == body and r.status_code in (200, 201, 204)


async def test_broken_off_midway_is_a_protocol_error_after_what_came():
    seen: list[bytes] = []
    async with upstream(writes(CHUNKED, b"3\r\nabc\r\n", pause=0.05)) as (url, _):
        async with hop_client(5.0) as client:
            r = await client.send(client.build_request("GET", url), stream=True)
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in r.aiter_raw():
                    seen.append(chunk)
            await r.aclose()
    assert seen == [b"abc"]


@pytest.mark.parametrize("answer", [b"", b"not http at all\r\n\r\n"])
async def test_no_answer_or_no_http_is_a_protocol_error(answer):
    async with upstream(writes(answer)) as (url, _):
        with pytest.raises(httpx.RemoteProtocolError):
            await relay(url, "GET")


async def test_refused_is_a_connect_error():
    async with upstream(writes(b"")) as (url, _):
        pass  # closed: nothing listens there now
    with pytest.raises(httpx.ConnectError):
        await relay(url, "GET")


async def test_closing_the_answer_closes_the_connection_at_once():
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED + b"3\r\nabc\r\n")
        await writer.drain()
        await reader.read()  # returns at the client's close
        closed.set()

    async with upstream(answer) as (url, _):
        async with hop_client(5.0) as client:
            r = await client.send(client.build_request("GET", url), stream=True)
            async for _chunk in r.aiter_raw():
                break
            await r.aclose()
            await asyncio.wait_for(closed.wait(), 5)


async def _relayed(url: str, sink) -> None:
    relay = Relay(5.0)
    response = await relay.send(relay.build_request("GET", url))
    try:
        await relay_body(response, sink)
    finally:
        await response.aclose()
        await relay.aclose()


async def test_relay_body_writes_through_from_the_upstream_protocol():
    """Each piece is sent from the upstream protocol's callback (no task runs it), in
    order; negative control: iterating the pieces sends each from the relaying task."""
    parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a" * 10, b"b" * 20, b"c" * 30)]
    sent: list[tuple[bytes, bool]] = []

    async def sink(piece: bytes) -> None:
        sent.append((piece, asyncio.current_task() is not None))

    async with upstream(writes(CHUNKED, *parts, b"0\r\n\r\n", pause=0.05)) as (url, _):
        await _relayed(url, sink)
        assert b"".join(p for p, _ in sent) == b"a" * 10 + b"b" * 20 + b"c" * 30
        assert [in_task for _, in_task in sent] == [False] * len(sent)

        relay = Relay(5.0)
        response = await relay.send(relay.build_request("GET", url))
        in_tasks = [asyncio.current_task() is not None async for _ in hop.pieces(response)]
        await response.aclose()
        await relay.aclose()
    assert in_tasks and all(in_tasks)


@pytest.mark.parametrize("pausing", [True, False])
async def test_a_slow_client_pauses_the_upstream_and_holds_little(pausing, monkeypatch):
    """A send that waits (the client's socket is full) pauses reading from the upstream:
    what the upstream writes backs up on its side, the router holds at most a socket read,
    and the pieces still arrive whole and in order once the client reads again. Negative
    control: with the pausing taken out, the router holds what the upstream sent."""
    if not pausing:
        monkeypatch.setattr(hop._Answer, "_reading", lambda self: None)
    total = 32 * 2**20
    piece = b"x" * 65536
    frames = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (total // len(piece))
    upstream_buffer: list[asyncio.WriteTransport] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_buffer.append(writer.transport)
        writer.writelines([CHUNKED, *frames, b"0\r\n\r\n"])  # all at once, unpaced
        await writer.drain()

    release, first = asyncio.Event(), asyncio.Event()
    got: list[bytes] = []

    async def slow(chunk: bytes) -> None:
        got.append(chunk)
        first.set()
        if not release.is_set():
            await release.wait()  # a client whose socket is full

    async with upstream(answer) as (url, _):
        relay = Relay(5.0)
        response = await relay.send(relay.build_request("GET", url))
        stream = response.stream
        assert isinstance(stream, hop._Body)
        task = asyncio.ensure_future(relay_body(response, slow))
        await asyncio.wait_for(first.wait(), 10)
        answer_ = stream.answer

        def held() -> int:
            return answer_.buffered + sum(map(len, got))

        def backed_up() -> int:
            return upstream_buffer[0].get_write_buffer_size()

        last = -1
        for _ in range(50):  # until nothing moves: the upstream's buffer as it stays
            if backed_up() == last:
                break
            last = backed_up()
            await asyncio.sleep(0.2)
        assert answer_.pending is not None and answer_.paused == pausing
        held_then, backed_up_then = held(), backed_up()
        release.set()
        await asyncio.wait_for(task, 30)
        await response.aclose()
        await relay.aclose()
    if pausing:
        assert held_then <= 2**20  # a socket read or so, of the 32 MiB sent
        assert backed_up_then > 16 * 2**20  # the rest waits on the upstream's side
    else:
        assert held_then > 16 * 2**20 and backed_up_then < 16 * 2**20
    assert b"".join(got) == piece * (total // len(piece))


async def test_cancelled_while_a_send_waits_closes_the_upstream_at_once():
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED + b"3\r\nabc\r\n")
        await writer.drain()
        await reader.read()  # returns at the router's close
        closed.set()

    waiting = asyncio.Event()

    async def stuck(chunk: bytes) -> None:
        waiting.set()
        await asyncio.Event().wait()

    async with upstream(answer) as (url, _):
        relay = Relay(5.0)
        response = await relay.send(relay.build_request("GET", url))
        task = asyncio.ensure_future(relay_body(response, stuck))
        await asyncio.wait_for(waiting.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert response.stream.answer.pending is None  # its send was closed
        await response.aclose()
        await asyncio.wait_for(closed.wait(), 5)
        await relay.aclose()


async def test_a_body_buffered_past_the_high_water_mark_before_relaying_still_flows():
    """Reading paused (more than HIGH_WATER bytes came before `relay_body` began) resumes
    once the write-through sends them."""
    body = b"y" * (4 * hop.HIGH_WATER)
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    got: list[bytes] = []

    async def sink(piece: bytes) -> None:
        got.append(piece)

    async with upstream(writes(head + body)) as (url, _):
        relay = Relay(5.0)
        response = await relay.send(relay.build_request("GET", url))
        for _ in range(100):
            if response.stream.answer.paused:
                break
            await asyncio.sleep(0.02)
        assert response.stream.answer.paused
        await asyncio.wait_for(relay_body(response, sink), 10)
        await response.aclose()
        await relay.aclose()
    assert b"".join(got) == body


# -- keep-alive reuse --


@asynccontextmanager
async def keep_alive_upstream(
    answers: list[bytes],
) -> AsyncIterator[tuple[str, list[int], list[asyncio.Event]]]:
    """A server that answers requests on each connection in turn with `answers` (b"": close
    the connection without answering; after an answer without length or chunks, it closes;
    after the last, it waits for the client to close). Yields its URL, the
    number of requests each connection carried and an event set when each one closed."""
    per_conn: list[int] = []
    closed: list[asyncio.Event] = []
    queue = list(answers)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(per_conn)
        per_conn.append(0)
        closed.append(asyncio.Event())
        try:
            while queue:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                answer = queue.pop(0)
                if not answer:
                    return
                per_conn[n] += 1
                writer.write(answer)
                await writer.drain()
                if b"content-length" not in answer and b"chunked" not in answer:
                    return  # an answer that ends at close
            await reader.read()
        finally:
            writer.close()
            closed[n].set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", per_conn, closed


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def _send(relay: Relay, url: str) -> bytes:
    response = await relay.send(relay.build_request("GET", url))
    try:
        return b"".join([chunk async for chunk in hop.pieces(response)])
    finally:
        await response.aclose()


async def test_a_connection_whose_answer_ended_cleanly_is_reused():
    chunked_end = CHUNKED + b"2\r\nok\r\n0\r\n\r\n"
    async with keep_alive_upstream([OK, chunked_end, OK]) as (url, per_conn, _):
        relay = Relay(5.0)
        try:
            assert [await _send(relay, url) for _ in range(3)] == [b"ok"] * 3
            assert per_conn == [3] and relay.transport.opened == 1
        finally:
            await relay.aclose()


@pytest.mark.parametrize(
    "first",
    [
        b"HTTP/1.1 200 OK\r\n\r\nok",  # ends at close
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",  # no keep-alive in HTTP/1.0
    ],
)
async def test_an_answer_that_does_not_keep_the_connection_is_not_reused(first):
    async with keep_alive_upstream([first, OK]) as (url, per_conn, closed):
        relay = Relay(5.0)
        try:
            assert await _send(relay, url) == b"ok"
            await asyncio.wait_for(closed[0].wait(), 5)  # the router closed it
            assert await _send(relay, url) == b"ok"
            assert per_conn == [1, 1] and relay.transport.opened == 2
        finally:
            await relay.aclose()


async def test_an_unfinished_answer_closes_its_connection_and_a_pooled_one_would_not(
    monkeypatch,
):
    """A client that leaves mid-answer closes the upstream at once (the pod aborts). The
    negative control: were an unfinished answer pooled, the pod would never hear of it."""
    for pooled in (False, True):
        if pooled:
            monkeypatch.setattr(hop._Answer, "reusable", lambda self: True)
        async with keep_alive_upstream([CHUNKED + b"3\r\nabc\r\n"]) as (url, _, closed):
            relay = Relay(5.0)
            response = await relay.send(relay.build_request("GET", url))
            async for _chunk in hop.pieces(response):
                break
            await response.aclose()
            try:
                await asyncio.wait_for(closed[0].wait(), 0.5 if pooled else 5)
                heard = True
            except TimeoutError:
                heard = False
            assert heard is not pooled
            await relay.aclose()


async def test_a_reused_connection_closed_before_the_answer_is_retried_once_anew():
    # connection 1: one answer, then it closes on the next request (the pod's idle close
    # racing it); connection 2 answers.
    async with keep_alive_upstream([OK, b"", OK]) as (url, per_conn, _):
        relay = Relay(5.0)
        traced: list[str] = []

        async def trace(event: str, info: dict) -> None:
            traced.append(event)

        try:
            assert await _send(relay, url) == b"ok"
            request = relay.build_request("POST", url, content=b"{}", extensions={"trace": trace})
            response = await relay.send(request)
            assert await response.aread() == b"ok"
            assert per_conn == [1, 1] and relay.transport.retried == 1
            assert relay.transport.opened == 2 and traced == [traced[0]]  # forwarded once
        finally:
            await relay.aclose()


async def test_a_new_connection_closed_before_the_answer_is_not_retried():
    async with keep_alive_upstream([b"", OK]) as (url, per_conn, _):
        relay = Relay(5.0)
        try:
            with pytest.raises(httpx.RemoteProtocolError):
                await _send(relay, url)
            assert relay.transport.retried == 0 and relay.transport.opened == 1
        finally:
            await relay.aclose()


async def test_an_idle_connection_is_closed_after_its_idle_life_and_a_closed_one_skipped():
    async with keep_alive_upstream([OK, OK]) as (url, per_conn, closed):
        relay = Relay(5.0)
        relay.transport.idle_seconds = 0.05
        try:
            assert await _send(relay, url) == b"ok"
            assert relay.transport.idle_count() == 1
            await asyncio.wait_for(closed[0].wait(), 5)  # closed by the router, idle
            assert relay.transport.idle_count() == 0
            assert await _send(relay, url) == b"ok"
            assert per_conn == [1, 1] and relay.transport.retried == 0
        finally:
            await relay.aclose()
    # the pod closed an idle one (its keep-alive, a restart): skipped when taken, no retry
    async with upstream(writes(OK)) as (url, heads):  # one answer a connection, then close
        relay = Relay(5.0)
        try:
            assert await _send(relay, url) == b"ok"
            await asyncio.sleep(0.2)  # the server's close arrives while it is idle
            assert await _send(relay, url) == b"ok"
            assert len(heads) == 2 and relay.transport.opened == 2
            assert relay.transport.retried == 0
        finally:
            await relay.aclose()
