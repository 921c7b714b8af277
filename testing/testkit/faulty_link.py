"""A TCP link in front of one server that the test breaks as a pod's loss would.

`kill()`: every connection through the link is reset (RST, as the kernel answers for a
process killed by SIGKILL) and new ones are refused. `freeze()`: nothing more is forwarded
either way and nothing is answered, while every connection stays open (a SIGSTOPped process
or a partitioned node: the peer hears silence, not an error). Both are for good: a killed
or frozen link does not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class FaultyLink:
    def __init__(self, host: str, port: int, target_host: str, target_port: int) -> None:
        self.host, self.port = host, port
        self.target = (target_host, target_port)
        self.frozen = asyncio.Event()
        self.killed = False
        self.connections = 0  # accepted so far
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> FaultyLink:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.killed:
            _reset(writer)
            return
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self._writers += [writer, up_writer]
        try:
            await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer),
                return_exceptions=True,
            )  # fmt: skip
        except asyncio.CancelledError:
            return  # closed by the test (`aclose`)
        for w in (writer, up_writer):
            if not self.frozen.is_set():
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not self.frozen.is_set():
            data = await reader.read(65536)
            if not data or self.frozen.is_set():
                break
            writer.write(data)
            await writer.drain()
        if self.frozen.is_set():
            await asyncio.Event().wait()  # silence, with the connection open, for good
        with contextlib.suppress(OSError):
            writer.write_eof()

    def kill(self) -> None:
        """Reset every connection, refuse new ones."""
        self.killed = True
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            _reset(writer)

    def freeze(self) -> None:
        """Forward nothing more, answer nothing, keep the connections open."""
        self.frozen.set()

    async def aclose(self) -> None:
        self.kill()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
