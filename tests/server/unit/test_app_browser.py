"""Browser-facing behaviour over the simulator engine (seconds): CORS preflights and
headers, the WebSocket Origin check, with the negative controls (CORS off, a foreign
origin)."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio
import websockets
from conftest import serve_simulator as serve
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

APP = "https://app.example.com"
OTHER = "https://evil.example.net"


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=1, ttft_per_stream_ms=0, jitter=0)
    yield engine
    await engine.shutdown()


def preflight(origin: str, headers: str = "content-type,authorization") -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": headers}  # fmt: skip


async def test_cors_off_by_default(sim):
    async with serve(sim) as url, httpx.AsyncClient(base_url=url) as c:
        r = await c.options("/v1/chat/completions", headers=preflight(APP))
        assert r.status_code == 405
        r = await c.post("/v1/stream", json={"prompt": "x", "max_tokens": 2},
                         headers={"Origin": APP})  # fmt: skip
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        # WebSocket: no allow-list, no Origin check (as before).
        ws = url.replace("http", "ws") + "/ws/stream"
        async with websockets.connect(ws, origin=OTHER, open_timeout=5):
            pass


async def test_cors_allows_listed_origin_on_every_route(sim):
    async with serve(sim, cors_allowed_origins=APP, cors_max_age_seconds=120) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/stream"):
            r = await c.options(
                path, headers=preflight(APP, "content-type,authorization,last-event-id")
            )
            assert r.status_code == 200, (path, r.text)
            assert r.headers["access-control-allow-origin"] == APP
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "last-event-id" in r.headers["access-control-allow-headers"].lower()
            assert r.headers["access-control-max-age"] == "120"
        r = await c.post(
            "/v1/stream", json={"prompt": "x", "max_tokens": 2}, headers={"Origin": APP}
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == APP
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "retry-after" in exposed
        # Errors carry CORS headers too, so the page can read them.
        r = await c.post(
            "/v1/stream", json={"prompt": "x", "max_tokens": 0}, headers={"Origin": APP}
        )
        assert r.status_code == 400 and r.headers["access-control-allow-origin"] == APP
        r = await c.get("/v1/models", headers={"Origin": APP})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP


async def test_cors_refuses_other_origins(sim):
    async with serve(sim, cors_allowed_origins=APP) as url, httpx.AsyncClient(base_url=url) as c:
        r = await c.options("/v1/chat/completions", headers=preflight(OTHER))
        assert r.status_code == 400
        assert "access-control-allow-origin" not in r.headers
        r = await c.post(
            "/v1/stream", json={"prompt": "x", "max_tokens": 2}, headers={"Origin": OTHER}
        )
        assert "access-control-allow-origin" not in r.headers  # the browser hides the answer


async def test_websocket_origin_check(sim):
    async with serve(sim, cors_allowed_origins=APP) as url:
        ws = url.replace("http", "ws") + "/ws/stream"
        async with websockets.connect(ws, origin=APP, open_timeout=5):
            pass
        async with websockets.connect(ws, open_timeout=5):  # no Origin: not a browser
            pass
        host = url.removeprefix("http://")
        async with websockets.connect(ws, origin=f"http://{host}", open_timeout=5):
            pass  # the server's own origin (its playground)
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(ws, origin=OTHER, open_timeout=5):
                pass
        assert e.value.response.status_code == 403
        assert b"origin_not_allowed" in e.value.response.body
        async with httpx.AsyncClient() as c:
            text = (await c.get(url + "/metrics")).text
        line = [ln for ln in text.splitlines() if 'reason="origin"' in ln and "websocket" in ln]
        assert line and line[0].endswith(" 1.0"), line
