"""The access log: one line per request when it ends, for every protocol and outcome, with
the request id the client saw in `X-Request-Id`; and no API key in any log line.

Simulator engine (no vLLM, seconds); the server's own uvicorn configuration. The last test
runs the real `sluice-server` process and reads everything it writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import serve_simulator as serve
from app_helpers import ws_url
from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port
from testkit.wait import eventually, eventually_async

asyncio_test = pytest.mark.asyncio(loop_scope="session")
KEY = "sk-secret-query-key-0123456789"
REPO = Path(__file__).resolve().parents[3]


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=2, ttft_per_stream_ms=0, jitter=0)
    yield engine
    await engine.shutdown()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    f = tmp_path / "keys"
    f.write_text(f"# keys\n{KEY}\n")
    return f


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def json(self) -> list[dict]:
        return [json.loads(r.getMessage()) for r in self.records if r.name == ACCESS_LOGGER]


@pytest.fixture
def access():
    """Every access-log record (the logger at INFO, as `serve` sets it)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def by_id(lines: list[dict], rid: str) -> dict:
    found = [x for x in lines if x["request_id"] == rid]
    assert len(found) == 1, (rid, lines)
    return found[0]


@asyncio_test
async def test_one_line_per_request_every_protocol_and_outcome(sim, key_file, access):
    auth = {"Authorization": f"Bearer {KEY}"}
    async with serve(sim, api_key_file=key_file, access_log_format="json",
                     max_concurrent_streams=2) as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=auth) as c:
            # token SSE, finished: the events' id carries the same request id
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 6}) as r:
                sse_rid = r.headers["x-request-id"]
                await r.aread()
            # token SSE over GET with the key in the query string
            get_rid = None
            async with c.stream("GET", "/v1/stream", headers={"Authorization": ""},
                                params={"prompt": "q", "max_tokens": "2", "api_key": KEY}) as r:  # fmt: skip
                get_rid = r.headers["x-request-id"]
                await r.aread()
            # OpenAI, streamed
            body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": True}  # fmt: skip
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                oai_rid = r.headers["x-request-id"]
                await r.aread()
            # OpenAI, not streamed
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            whole_rid = r.headers["x-request-id"]
            # disconnected: the client leaves after the first token event
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 500}) as r:
                gone_rid = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break
            # rejected: a wrong key (401) and bad input (400), with the header too
            r = await c.post(
                "/v1/stream", json={"prompt": "p"}, headers={"Authorization": "Bearer nope"}
            )
            assert r.status_code == 401
            denied_rid = r.headers["x-request-id"]
            r = await c.post("/v1/stream", json={"prompt": "p", "max_tokens": 0})
            assert r.status_code == 400
            bad_rid = r.headers["x-request-id"]
            # probes are not logged
            assert (await c.get("/health")).status_code == 200
            await c.get("/metrics")
        # WebSocket: key in the query string; one finished, one stopped, one refused frame
        async with websockets.connect(ws_url(url) + f"?api_key={KEY}") as ws:
            ws_rid = ws.response.headers["x-request-id"]
            await ws.send(json.dumps({"id": "a", "prompt": "k", "params": {"max_tokens": 3}}))
            while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                pass
            await ws.send(json.dumps({"id": "b", "prompt": "k", "params": {"max_tokens": 500}}))
            await asyncio.wait_for(ws.recv(), 10)
            await ws.send(json.dumps({"type": "stop", "id": "b"}))
            while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                pass
            await ws.send(json.dumps({"id": "c", "prompt": "k", "params": {"max_tokens": -1}}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "error"
        with pytest.raises(websockets.InvalidStatus) as denied:
            async with websockets.connect(ws_url(url)):
                pass
        ws_denied_rid = denied.value.response.headers["x-request-id"]
        await eventually_async(lambda: len(access.records) >= 11, timeout=4, interval=0.02,
                               message=lambda: f"11 access lines, not {len(access.records)}")  # fmt: skip
        lines = access.json()

    kid = lines[0]["key_id"]
    assert kid and kid not in KEY and kid != "anonymous"
    assert len(lines) == 11, lines
    assert len({x["request_id"] for x in lines if x["protocol"] != "websocket"}) == 7

    line = by_id(lines, sse_rid)
    assert line["protocol"] == "sse" and line["status"] == 200 and line["model"] == "sim"
    assert line["outcome"] == "finished" and line["finish_reason"] == "length"
    assert line["completion_tokens"] == 6 and line["prompt_tokens"] >= 1
    assert 0 < line["ttft_ms"] <= line["duration_ms"] and line["key_id"] == kid
    assert line["path"] == "/v1/stream" and line["method"] == "POST"
    line = by_id(lines, get_rid)
    assert line["outcome"] == "finished" and line["path"] == "/v1/stream" and line["key_id"] == kid
    line = by_id(lines, oai_rid)
    assert (line["protocol"], line["outcome"], line["status"]) == ("openai", "finished", 200)
    assert line["completion_tokens"] == 4 and line["ttft_ms"] > 0
    line = by_id(lines, whole_rid)
    assert (line["outcome"], line["completion_tokens"], line["ttft_ms"]) == ("finished", 3, None)
    line = by_id(lines, gone_rid)
    assert line["outcome"] == "disconnected" and 1 <= line["completion_tokens"] < 500
    line = by_id(lines, denied_rid)
    assert (line["outcome"], line["status"], line["key_id"]) == ("rejected", 401, None)
    assert (by_id(lines, bad_rid)["outcome"], by_id(lines, bad_rid)["status"]) == ("rejected", 400)
    ws_lines = {x["stream"]: x for x in lines if x["request_id"] == ws_rid}
    assert set(ws_lines) == {"a", "b", "c"}
    assert ws_lines["a"]["outcome"] == "finished" and ws_lines["a"]["completion_tokens"] == 3
    assert ws_lines["b"]["outcome"] == "stopped" and ws_lines["b"]["finish_reason"] == "abort"
    assert (ws_lines["c"]["outcome"], ws_lines["c"]["status"]) == ("rejected", 400)
    assert all(x["protocol"] == "websocket" and x["key_id"] == kid for x in ws_lines.values())
    line = by_id(lines, ws_denied_rid)
    assert (line["protocol"], line["outcome"], line["status"]) == ("websocket", "rejected", 401)
    assert not any(KEY in r.getMessage() or "api_key" in r.getMessage() for r in access.records)


@asyncio_test
async def test_text_format_and_capacity_refusal(sim, access):
    async with serve(sim, max_concurrent_streams=1) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 50}) as r:
                r2 = await c.post("/v1/stream", json={"prompt": "p"})
                assert r2.status_code == 429
                await r.aread()
        await eventually_async(lambda: len(access.records) >= 2, timeout=2, interval=0.02,
                               message=lambda: f"2 access lines, not {len(access.records)}")  # fmt: skip
    texts = [r.getMessage() for r in access.records]
    assert len(texts) == 2, texts
    refused = next(t for t in texts if r2.headers["x-request-id"] in t)
    assert (
        "status=429" in refused and "outcome=rejected" in refused and "key_id=anonymous" in refused
    )
    done = next(t for t in texts if r.headers["x-request-id"] in t)
    assert "outcome=finished" in done and "completion_tokens=50" in done and "ttft_ms=" in done


def test_the_server_process_never_logs_a_key(tmp_path, key_file):
    """The real process at --log-level debug with JSON access lines: every line it writes
    (uvicorn's own, ours, the access log) is read; the key sent as `?api_key=` appears in
    none, while the access line of that very request is there (so the check can fail)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'server'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    out = tmp_path / "server.log"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_server", "--model", "sim", "--engine", "simulator",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "debug",
             "--access-log-format", "json", "--api-key-file", str(key_file),
             "--sim-ttft-ms", "5", "--sim-itl-ms", "1"],
            stdout=sink, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert proc.poll() is None, out.read_text()  # not retried: fails at once
                try:
                    return httpx.get(base + "/ready", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            eventually(ready, timeout=60, interval=0.1, retry_on=(),
                       message=lambda: f"the server ready\n{out.read_text()}")  # fmt: skip
            r = httpx.get(
                base + "/v1/stream", params={"prompt": "x", "max_tokens": "3", "api_key": KEY}
            )
            assert r.status_code == 200 and "[DONE]" in r.text
            rid = r.headers["x-request-id"]
            bad = httpx.get(base + "/v1/stream", params={"prompt": "x", "api_key": KEY + "x"})
            assert bad.status_code == 401
        finally:
            proc.terminate()
            proc.wait(30)
    text = out.read_text()
    access = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    mine = [x for x in access if x["request_id"] == rid]
    assert len(mine) == 1 and mine[0]["outcome"] == "finished" and mine[0]["ts"], text
    assert any(
        x["request_id"] == bad.headers["x-request-id"] and x["status"] == 401 for x in access
    )
    assert "uvicorn" in text.lower() or "Application startup" in text  # DEBUG logs were on
    assert KEY not in text and "api_key" not in text, text
