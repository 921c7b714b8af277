"""The server keeps idle HTTP connections open for --keep-alive-seconds (default 75 s, longer
than ingress-nginx's 60 s upstream keep-alive, so the proxy never reuses a connection the
server is closing). Real uvicorn through `drain.uvicorn_config`, simulator engine, raw
socket: one request, an idle pause, a second request on the same connection."""

from __future__ import annotations

import asyncio

import pytest
from app_helpers import serve_simulator
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUEST = b"GET /health HTTP/1.1\r\nHost: sluice\r\n\r\n"


async def second_request_after_idle(keep_alive: float, idle: float) -> bytes:
    """Bytes the server returns for a second request sent after `idle` s of silence."""
    engine = SimulatorEngine(model_name="sim")
    try:
        async with serve_simulator(engine, keep_alive_seconds=keep_alive) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
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
