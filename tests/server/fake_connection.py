"""A connection as uvicorn and the kernel show it to the app, on the loop's clock, for unit
tests of the send watchdog (server/sluice_server/transport/sendwatch.py) on virtual time.

- `transport`: the asyncio calls the watchdog makes: a write buffer that fills as the app
  sends and empties as the reader takes bytes, its limits (pausing above `high`, resuming at
  `low`, as asyncio does), `abort()`, and `get_extra_info("socket")`: a socket whose
  TCP_INFO counts the bytes the reader took (`tcp=True`), or none;
- uvicorn's flow control: a send waits while the transport is paused; after `abort()` the
  connection is lost: HTTP sends return and `receive` says `http.disconnect`, WebSocket
  sends raise (uvicorn's `ClientDisconnected` is an OSError) and `receive` says
  `websocket.disconnect`;
- a closed transport as uvloop's: its socket stand-in has no file descriptor any more
  (`getsockopt` raises ValueError "negative file descriptor") and it refuses new write
  limits (RuntimeError); `lose(told=False)` closes it before the server told the app
  (`receive` keeps waiting), the moment a slot can reach a client that just left;
- the reader: `read(n)` takes bytes; `reader(rate)` takes them at a steady pace; with
  `fast=True` it takes every byte as it is sent (nothing ever waits).
`send` and `receive` are bound methods of the connection, which keeps `.transport`, as
uvicorn's are (`transport_of`).
"""

from __future__ import annotations

import asyncio
import socket
import struct


class FakeSocket:
    def __init__(self, conn: FakeConnection) -> None:
        self.conn = conn
        self.options: dict[tuple[int, int], object] = {}

    def fileno(self) -> int:
        return -1 if self.conn.lost else 3

    def getsockopt(self, level: int, option: int, buflen: int = 0):
        if self.conn.lost:
            raise ValueError("negative file descriptor")  # uvloop's PseudoSocket, closed
        if (level, option) == (socket.IPPROTO_TCP, socket.TCP_INFO):
            info = bytearray(max(buflen, 128))
            struct.pack_into("=Q", info, 120, self.conn.taken)  # tcpi_bytes_acked
            return bytes(info[:buflen])
        return self.options.get((level, option), 0)

    def setsockopt(self, level: int, option: int, value) -> None:
        if self.conn.lost:
            raise ValueError("negative file descriptor")
        self.options[(level, option)] = value


class FakeTransport:
    def __init__(self, conn: FakeConnection, tcp: bool) -> None:
        self.conn = conn
        self.low, self.high = 16384, 65536  # asyncio's defaults
        self.socket = FakeSocket(conn) if tcp else None

    def get_write_buffer_size(self) -> int:
        return self.conn.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.low, self.high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self.conn.lost:
            raise RuntimeError("unable to perform operation on a closed transport")
        if high is None:
            high = 65536 if low is None else 4 * low
        if low is None:
            low = high // 4
        self.low, self.high = low, high
        self.conn.flow()

    def get_extra_info(self, name: str, default=None):
        return self.socket if name == "socket" and self.socket is not None else default

    def is_closing(self) -> bool:
        return self.conn.lost

    def abort(self) -> None:
        self.conn.lose()


class FakeConnection:
    def __init__(self, kind: str = "http", tcp: bool = True, inbox: list | None = None,
                 fast: bool = False) -> None:  # fmt: skip
        self.kind, self.fast = kind, fast
        self.buffered = 0  # bytes in the transport's buffer
        self.taken = 0  # bytes the reader took
        self.lost = False
        self.sent: list[dict] = []  # every message the app sent
        self.transport = FakeTransport(self, tcp)
        self._writable = asyncio.Event()
        self._writable.set()
        self._gone = asyncio.Event()
        self.inbox = list(inbox or [])

    def flow(self) -> None:
        if self.buffered > self.transport.high:
            self._writable.clear()
        elif self.buffered <= self.transport.low:
            self._writable.set()

    def lose(self, told: bool = True) -> None:
        """The connection is lost; `told`: the server says so to the app (`receive`)."""
        self.lost = True
        self._writable.set()
        if told:
            self._gone.set()

    async def send(self, message: dict) -> None:
        if not self._writable.is_set() and not self.lost:
            await self._writable.wait()
        if self.lost:
            if self.kind == "websocket":
                raise ConnectionResetError("connection lost")  # uvicorn: ClientDisconnected
            return
        self.sent.append(message)
        body = message.get("body") or message.get("text") or b""
        self.buffered += len(body)
        if self.fast:
            self.read(len(body))
        self.flow()

    async def receive(self) -> dict:
        if self.inbox:
            return self.inbox.pop(0)
        await self._gone.wait()
        return {"type": "http.disconnect" if self.kind == "http" else "websocket.disconnect",
                "code": 1006}  # fmt: skip

    def read(self, n: int) -> int:
        n = min(n, self.buffered)
        self.buffered -= n
        self.taken += n
        self.flow()
        return n

    def reader(self, rate: float, every: float = 0.05) -> asyncio.Task:
        """Take `rate` bytes/s (in steps every `every` s) until the connection is lost."""

        async def run() -> None:
            while not self.lost:
                await asyncio.sleep(every)
                self.read(int(rate * every))

        return asyncio.create_task(run())
