"""What the server relies on in uvicorn beyond ASGI, checked against the installed uvicorn
(pinned to a tested range in server/pyproject.toml: when one of these fails after an
upgrade, the pin or the code must change):

- `transport_of(receive)` finds the connection's transport (transport/sendwatch.py);
- a send waits while the transport is paused (uvicorn's flow control), so with the
  watchdog's `high=0` a send waits until what was sent before it has left the process;
- after `transport.abort()` the connection is lost: a pending HTTP send returns and
  `receive()` says `http.disconnect`; a WebSocket send raises an OSError and `receive()`
  says `websocket.disconnect`; the app then returning is logged as nothing;
- a refused WebSocket handshake is logged as exactly `handshake.UNCOMPLETED` at ERROR
  (what transport/handshake.py filters), and not at all through the filter.

Real uvicorn on loopback, for the HTTP implementations it may pick (`auto`: httptools
where installed; h11 otherwise) and its default WebSocket one. The client never reads, and
its receive buffer is small (per socket), so the kernel fills at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import pytest
import uvicorn
from app_helpers import serving
from sluice_server.transport import handshake
from sluice_server.transport.sendwatch import transport_of
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
CHUNK = b"x" * 65536


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]


@contextlib.asynccontextmanager
async def serve(app, **config):
    port = free_port()
    cfg = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="info",
                         **config)  # fmt: skip
    handshake.install()
    records = Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    try:
        async with serving(cfg) as server:
            yield port, records, server
    finally:
        logger.removeHandler(records)


async def returned(server) -> None:
    """Until every connection's ASGI task has returned (and uvicorn logged its verdict)."""
    await eventually_async(lambda: not server.server_state.tasks, timeout=10, interval=0.01,
                           message="every ASGI task to return")  # fmt: skip


async def client(port: int, request: bytes) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(s, request)
    return s


async def pending_send(transport, send, message) -> asyncio.Task:
    """Send `message` until a send stays pending: the transport holds bytes (high=0) and
    the kernel takes no more (its send buffer made small first, for this socket)."""
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport.set_write_buffer_limits(high=0)
    for _ in range(100):
        task = asyncio.ensure_future(send(message))
        for _ in range(20):  # a few loop turns: any room in the kernel is used by then
            await asyncio.sleep(0.01)
        if not task.done():
            assert transport.get_write_buffer_size() > 0
            return task
        task.result()
    raise AssertionError("no send waited for a paused transport: uvicorn's flow control changed")


HTTP_START = {"type": "http.response.start", "status": 200, "headers": []}
HTTP_CHUNK = {"type": "http.response.body", "body": CHUNK, "more_body": True}


@pytest.mark.parametrize("http", ["auto", "h11"])
async def test_http_transport_flow_control_and_a_lost_connection(http):
    seen: dict = {}
    done = asyncio.Event()

    async def app(scope, receive, send):
        transport = seen["transport"] = transport_of(receive)
        seen["peer"] = transport.get_extra_info("peername")
        await send(HTTP_START)
        seen["pending"] = await pending_send(transport, send, HTTP_CHUNK)
        seen["ready"].set()
        await seen["abort"].wait()
        transport.abort()
        await asyncio.wait_for(seen["pending"], 5)  # returns, nothing raised
        seen["after"] = await asyncio.wait_for(receive(), 5)
        await send(HTTP_CHUNK)  # a send on a lost connection returns too
        done.set()

    seen["ready"], seen["abort"] = asyncio.Event(), asyncio.Event()
    async with serve(app, http=http) as (port, records, server):
        s = await client(port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(seen["ready"].wait(), 30)
        assert seen["peer"] == s.getsockname()
        assert not seen["pending"].done()  # waits while the transport holds bytes
        seen["abort"].set()
        await asyncio.wait_for(done.wait(), 10)
        await returned(server)
        s.close()
    assert seen["after"] == {"type": "http.disconnect"}
    assert records.errors() == []


@pytest.mark.parametrize("http", ["auto", "h11"])
async def test_http_send_waits_until_the_reader_took_what_waited(http):
    seen: dict = {"ready": asyncio.Event()}

    async def app(scope, receive, send):
        transport = transport_of(receive)
        await send(HTTP_START)
        seen["pending"] = await pending_send(transport, send, HTTP_CHUNK)
        seen["ready"].set()
        await asyncio.wait_for(seen["pending"], 30)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with serve(app, http=http) as (port, records, server):
        s = await client(port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(seen["ready"].wait(), 30)
        loop = asyncio.get_running_loop()
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the reader takes everything
            data += await asyncio.wait_for(loop.sock_recv(s, 1 << 20), 30)
        await returned(server)
        s.close()
    assert seen["pending"].done() and seen["pending"].exception() is None
    assert records.errors() == []


def ws_request(port: int) -> bytes:
    return (f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode()  # fmt: skip


async def test_websocket_transport_flow_control_and_a_lost_connection():
    seen: dict = {"ready": asyncio.Event(), "abort": asyncio.Event()}
    done = asyncio.Event()

    async def app(scope, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        transport = transport_of(receive)
        seen["peer"] = transport.get_extra_info("peername")
        frame = {"type": "websocket.send", "text": "x" * 65536}
        seen["pending"] = await pending_send(transport, send, frame)
        seen["ready"].set()
        await seen["abort"].wait()
        transport.abort()
        with pytest.raises(OSError):
            await asyncio.wait_for(seen["pending"], 5)
        seen["after"] = (await asyncio.wait_for(receive(), 5))["type"]
        done.set()

    async with serve(app) as (port, records, server):
        s = await client(port, ws_request(port))
        await asyncio.wait_for(seen["ready"].wait(), 30)
        assert seen["peer"] == s.getsockname()
        assert not seen["pending"].done()
        seen["abort"].set()
        await asyncio.wait_for(done.wait(), 10)
        await returned(server)
        s.close()
    assert seen["after"] == "websocket.disconnect"
    assert records.errors() == []


@pytest.mark.parametrize("marked", [False, True], ids=["uvicorn-alone", "refusal-marked"])
async def test_a_refused_handshake_is_logged_as_the_filtered_error_only(marked):
    async def app(scope, receive, send):
        await send({"type": "websocket.http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        if marked:
            handshake.refused()  # what the edge middleware does as the refusal goes out
        await send({"type": "websocket.http.response.body", "body": b"{}", "more_body": False})

    async with serve(app) as (port, records, server):
        s = await client(port, ws_request(port))
        loop = asyncio.get_running_loop()
        answer = await asyncio.wait_for(loop.sock_recv(s, 4096), 10)
        await returned(server)
        s.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert records.errors() == ([] if marked else [handshake.UNCOMPLETED])
