"""Browser-facing behaviour over the simulator engine (seconds): CORS preflights and
headers, the WebSocket Origin check, with the negative controls (CORS off, a foreign
origin)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import serve_simulator as serve
from sluice_server.engine.simulator import SimulatorEngine
from testkit.wait import eventually_async

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


# --- EventSource semantics and resumable token streams --------------------------------

LONG = {"prompt": "resume me", "max_tokens": 60, "ignore_eos": True, "seed": 7}


async def read_events(r: httpx.Response, n: int | None = None) -> list[dict]:
    """SSE events as dicts (id, data, event, retry) until `n` token events or the end."""
    out, cur, tokens = [], {}, 0
    async for line in r.aiter_lines():
        if line == "":
            if cur:
                out.append(cur)
                if cur.get("data", "").startswith('{"id"') and '"finished":false' in cur["data"]:
                    tokens += 1
                    if n is not None and tokens >= n:
                        return out
            cur = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            cur[field] = value.removeprefix(" ")
    return out


def text_of(events: list[dict]) -> str:
    import json

    return "".join(json.loads(e["data"])["token"] for e in events
                   if e.get("data", "").startswith("{") and "error" not in e)  # fmt: skip


async def counted(c: httpx.AsyncClient, name: str) -> None:
    """Once the server's counter `name` has moved (what the test waits for happened)."""

    async def moved() -> bool:
        return metric((await c.get("/metrics")).text, name) > 0

    await eventually_async(moved, timeout=5, message=f"{name} to count it")


def metric(text: str, name: str, protocol: str = "sse") -> float:
    for ln in text.splitlines():
        if ln.startswith(name + "{") and f'protocol="{protocol}"' in ln:
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not found")


@pytest_asyncio.fixture(loop_scope="session")
async def slow():
    """20 ms between tokens: a dropped client leaves most of the answer ungenerated."""
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=20, ttft_per_stream_ms=0,
                             jitter=0)  # fmt: skip
    yield engine
    await engine.shutdown()


async def whole_answer(url: str) -> tuple[str, list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c, \
            c.stream("POST", "/v1/stream", json=LONG) as r:  # fmt: skip
        events = await read_events(r)
    return text_of(events), events


async def test_event_ids_retry_and_204_after_the_end(sim):
    async with serve(sim) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        async with c.stream("GET", "/v1/stream", params={"prompt": "hi", "max_tokens": "5"}) as r:
            rid = r.headers["x-request-id"]
            events = await read_events(r)
        assert events[0]["retry"] == "1000"
        ids = [e["id"] for e in events]
        assert ids == [f"{rid}:{i}" for i in range(len(events))], ids
        assert events[-1]["data"] == "[DONE]"
        before = metric((await c.get("/metrics")).text, "sluice_requests_total")
        # EventSource reconnects after the end with the last id: 204 stops it, no generation.
        for last in (ids[-1], ids[-2], ids[0]):
            r = await c.get("/v1/stream", params={"prompt": "hi", "max_tokens": "5"},
                            headers={"Last-Event-ID": last})  # fmt: skip
            assert r.status_code == 204, (last, r.status_code, r.text)
        r = await c.post("/v1/stream", json={"prompt": "hi"}, headers={"Last-Event-ID": ids[-1]})
        assert r.status_code == 204
        # Unknown, malformed: a clear 4xx, never a generation.
        r = await c.get("/v1/stream", params={"prompt": "hi"},
                        headers={"Last-Event-ID": "stream-nope:3"})  # fmt: skip
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        r = await c.get("/v1/stream", params={"prompt": "hi"}, headers={"Last-Event-ID": "7"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
        after = metric((await c.get("/metrics")).text, "sluice_requests_total")
        assert after == before


async def _drop_after(url: str, n: int) -> tuple[str, list[dict]]:
    """Read `n` token events, then drop the TCP connection."""
    client = httpx.AsyncClient(base_url=url, timeout=30)
    async with client.stream("POST", "/v1/stream", json=LONG) as r:
        rid = r.headers["x-request-id"]
        events = await read_events(r, n)
        await client.aclose()
    return rid, events


async def test_grace_zero_aborts_and_reconnect_is_410(slow):
    async with serve(slow) as url, httpx.AsyncClient(base_url=url) as c:
        rid, events = await _drop_after(url, 5)
        await counted(c, "sluice_client_disconnects_total")  # the server saw it go
        r = await c.post("/v1/stream", json=LONG, headers={"Last-Event-ID": events[-1]["id"]})
        assert r.status_code == 410 and r.json()["error"]["code"] == "stream_aborted"
        m = (await c.get("/metrics")).text
        assert metric(m, "sluice_client_disconnects_total") == 1
        assert metric(m, "sluice_stream_resumes_total") == 0


async def test_resume_within_grace_gets_exactly_the_rest(slow):
    async with serve(slow, resume_grace_seconds=5) as url, httpx.AsyncClient(base_url=url) as c:
        whole, _ = await whole_answer(url)
        for cut in (1, 7, 30):
            rid, first = await _drop_after(url, cut)
            await asyncio.sleep(0.1)  # it keeps generating meanwhile
            last = first[-1]["id"]
            async with c.stream("POST", "/v1/stream", json=LONG,
                                headers={"Last-Event-ID": last}) as r:  # fmt: skip
                assert r.status_code == 200 and r.headers["x-request-id"] == rid
                rest = await read_events(r)
            ids = [int(e["id"].rsplit(":", 1)[1]) for e in first + rest]
            assert ids == list(range(len(ids))), ids  # no gap, no duplicate
            assert text_of(first) + text_of(rest) == whole
            assert rest[-1]["data"] == "[DONE]"
            # The stream is over now: its last id gets 204.
            r = await c.post("/v1/stream", json=LONG, headers={"Last-Event-ID": rest[-1]["id"]})
            assert r.status_code == 204
        # Within the window an ended stream still replays from an older id (its last
        # events may have been lost on the way), without generating anything.
        async with c.stream("POST", "/v1/stream", json=LONG,
                            headers={"Last-Event-ID": last}) as r:  # fmt: skip
            assert text_of(first) + text_of(await read_events(r)) == whole
        m = (await c.get("/metrics")).text
        assert metric(m, "sluice_stream_resumes_total") == 4
        assert metric(m, "sluice_client_disconnects_total") == 0
        assert metric(m, "sluice_requests_total") == 4


async def test_resume_window_expires_and_aborts(slow):
    async with serve(slow, resume_grace_seconds=0.3) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        rid, first = await _drop_after(url, 3)
        await counted(c, "sluice_stream_resumes_expired_total")  # the 0.3 s window closed
        r = await c.post("/v1/stream", json=LONG, headers={"Last-Event-ID": first[-1]["id"]})
        assert r.status_code == 410
        m = (await c.get("/metrics")).text
        assert metric(m, "sluice_stream_resumes_expired_total") == 1
        assert metric(m, "sluice_client_disconnects_total") == 1
        assert metric(m, "sluice_aborts_total") == 1
        assert metric(m, "sluice_active_streams") == 0


async def test_buffer_cap_holds_while_detached(sim):
    async with serve(sim, resume_grace_seconds=5, stream_buffer_tokens=5) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        rid, first = await _drop_after(url, 2)
        # > 5 undelivered outputs pile up while detached: the cap aborts the engine request
        await eventually_async(lambda: sim.num_unfinished_requests() == 0, timeout=5,
                               message="the detached stream's engine request to end")  # fmt: skip
        async with c.stream("POST", "/v1/stream", json=LONG,
                            headers={"Last-Event-ID": first[-1]["id"]}) as r:  # fmt: skip
            rest = await read_events(r)
        assert any(e.get("event") == "error" and "too slow" in e["data"] for e in rest), rest
        assert rest[-1]["data"] == "[DONE]"
        m = (await c.get("/metrics")).text
        assert metric(m, "sluice_stream_errors_total") == 1


async def test_recent_streams_are_bounded(monkeypatch):
    from sluice_server.core.streaming import reconnects

    now = [100.0]
    monkeypatch.setattr(reconnects.time, "monotonic", lambda: now[0])
    reg = reconnects.RecentStreams(keep_seconds=10, max_ended=3)
    for i in range(5):
        reg.add(f"s{i}", "k", None)
        reg.end(f"s{i}", reconnects.FINISHED)
    assert list(reg.ended) == ["s2", "s3", "s4"] and not reg.live
    assert reg.get("s0") is None and reg.get("s4").state == reconnects.FINISHED
    now[0] += 11
    assert reg.get("s4") is None and not reg.ended


async def test_root_path_serves_under_the_prefix_and_without(sim):
    async with serve(sim, root_path="/mistral/") as url, httpx.AsyncClient(base_url=url) as c:
        for base in ("/mistral", ""):
            r = await c.get(base + "/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "sim"
            r = await c.post(base + "/v1/stream", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and "[DONE]" in r.text
            ws = url.replace("http", "ws") + base + "/ws/stream"
            async with websockets.connect(ws, open_timeout=5) as sock:
                await sock.send('{"id": "a", "prompt": "x", "params": {"max_tokens": 1}}')
                assert '"finished"' in await sock.recv()
        assert (await c.get("/mistralx/v1/models")).status_code == 404
        assert (await c.get("/health")).status_code == 200  # probes on the pod, no prefix
        spec = (await c.get("/mistral/openapi.json")).json()
        assert spec["servers"] == [{"url": "/mistral"}]


async def test_playground_served_and_switchable(sim):
    async with serve(sim, root_path="/m") as url, httpx.AsyncClient(base_url=url) as c:
        for path in ("/playground", "/m/playground"):
            r = await c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "connect-src 'self'" in r.headers["content-security-policy"]
        html = r.text
        assert "EventSource" in html and "WebSocket" in html and "getReader" in html
        # Self-contained: no absolute URL to fetch anything from, paths relative to the page.
        assert "http://" not in html and "https://" not in html and 'src="' not in html
        assert 'api("v1/stream")' in html and 'api("/v1' not in html
    async with serve(sim, playground=False) as url, httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/playground")).status_code == 404
