"""The server keeps idle HTTP connections open for --keep-alive-seconds (default 75 s, longer
than ingress-nginx's 60 s upstream keep-alive, so the proxy never reuses a connection the
server is closing). Real uvicorn through `drain.uvicorn_config`, simulator engine, raw
socket: one request, an idle pause, a second request on the same connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import uvicorn
from sluice_server.app import build_app
from sluice_server.drain import uvicorn_config
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUEST = b"GET /health HTTP/1.1\r\nHost: sluice\r\n\r\n"


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def second_request_after_idle(keep_alive: float, idle: float) -> bytes:
    """Bytes the server returns for a second request sent after `idle` s of silence."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(model="sim", engine="simulator", host="127.0.0.1", port=port,
                        keep_alive_seconds=keep_alive, log_level="warning")  # fmt: skip
    engine = SimulatorEngine(model_name="sim")
    server = QuietServer(uvicorn_config(settings, build_app(settings, engine)))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(250):
            if server.started:
                break
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        first = await asyncio.wait_for(reader.read(4096), 5)
        assert first.startswith(b"HTTP/1.1 200"), first
        await asyncio.sleep(idle)
        try:
            writer.write(REQUEST)
            await writer.drain()
            second = await asyncio.wait_for(reader.read(4096), 5)
        except ConnectionError:
            second = b""
        writer.close()
        return second
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await engine.shutdown()


async def test_default_outlives_the_ingress_upstream_keep_alive():
    assert Settings(model="m").keep_alive_seconds > 60
    assert Settings(model="m", keep_alive_seconds=90).keep_alive_seconds == 90


async def test_connection_reused_after_an_idle_pause_shorter_than_keep_alive():
    second = await second_request_after_idle(keep_alive=3.0, idle=1.5)
    assert second.startswith(b"HTTP/1.1 200"), second


async def test_negative_control_server_closes_after_its_keep_alive():
    """uvicorn's own default would be 5 s: past the keep-alive the server has closed the
    connection, so the same second request gets nothing (what a proxy turns into a 502)."""
    second = await second_request_after_idle(keep_alive=0.5, idle=1.5)
    assert second == b"", second
