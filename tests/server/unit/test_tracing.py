"""OpenTelemetry: a real OTLP/HTTP receiver (protobuf decoded with opentelemetry-proto)
gets one span per request, in the caller's trace (W3C `traceparent`), for token SSE, the
OpenAI route and the WebSocket, with the outcome of a finished, a disconnected and a
rejected request. Simulator engine, the server's own uvicorn configuration.
"""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import serve_simulator as serve
from app_helpers import ws_url
from sluice_server.engine.simulator import SimulatorEngine
from testkit.otlp import OtlpReceiver
from testkit.wait import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
EVENTS = ["admitted", "first_output", "first_byte", "end"]


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=5, itl_ms=2, ttft_per_stream_ms=0, jitter=0)
    yield engine
    await engine.shutdown()


@pytest.fixture
def rx():
    with OtlpReceiver() as receiver:
        yield receiver


def parent() -> tuple[str, str, dict]:
    trace, span = secrets.token_hex(16), secrets.token_hex(8)
    return trace, span, {"traceparent": f"00-{trace}-{span}-01"}


async def spans_of(rx: OtlpReceiver, trace: str, n: int = 1) -> list[dict]:
    def mine(spans):
        return [s for s in spans if s["trace_id"] == trace]

    spans = await asyncio.to_thread(rx.wait_for, lambda s: len(mine(s)) >= n)
    found = mine(spans)
    assert len(found) == n, (trace, spans)
    return found


def check(span: dict, span_parent: str, protocol: str, outcome: str) -> dict:
    a = span["attributes"]
    assert span["parent_span_id"] == span_parent
    assert (a["sluice.protocol"], a["sluice.outcome"], a["sluice.model"]) == (
        protocol,
        outcome,
        "sim",
    )
    assert span["resource"]["service.name"] == "sluice-server"
    times = [t for _, t in span["events"]]
    assert times == sorted(times) and span["start_ns"] <= times[0] and times[-1] <= span["end_ns"]
    return a


async def test_spans_join_the_callers_trace_with_the_outcome(sim, rx):
    async with serve(sim, otlp_traces_endpoint=rx.endpoint, max_concurrent_streams=1) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            # token SSE, finished
            trace, span, tp = parent()
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 5},
                                headers=tp) as r:  # fmt: skip
                rid = r.headers["x-request-id"]
                await r.aread()
            [s] = await spans_of(rx, trace)
            a = check(s, span, "sse", "finished")
            assert [e for e, _ in s["events"]] == EVENTS
            assert (a["sluice.completion_tokens"], a["sluice.finish_reason"]) == (5, "length")
            assert a["sluice.prompt_tokens"] >= 1 and a["sluice.request_id"] == rid
            assert a["http.response.status_code"] == 200 and s["name"] == "POST /v1/stream"

            # token SSE, disconnected after the first token
            trace, span, tp = parent()
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 500},
                                headers=tp) as r:  # fmt: skip
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break
            [s] = await spans_of(rx, trace)
            a = check(s, span, "sse", "disconnected")
            assert 1 <= a["sluice.completion_tokens"] < 500

            # OpenAI route, streamed, finished
            trace, span, tp = parent()
            body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": True}  # fmt: skip
            async with c.stream("POST", "/v1/chat/completions", json=body, headers=tp) as r:
                await r.aread()
            [s] = await spans_of(rx, trace)
            a = check(s, span, "openai", "finished")
            assert a["sluice.completion_tokens"] == 4
            assert [e for e, _ in s["events"]] == EVENTS

            # rejected: over capacity (429) while a stream holds the only slot
            trace, span, tp = parent()
            async with c.stream("POST", "/v1/stream", json={"prompt": "p", "max_tokens": 40}) as r:
                refused = await c.post("/v1/stream", json={"prompt": "p"}, headers=tp)
                assert refused.status_code == 429
                await r.aread()
            [s] = await spans_of(rx, trace)
            a = check(s, span, "sse", "rejected")
            assert a["http.response.status_code"] == 429 and s["status_code"] == 2  # ERROR
            assert [e for e, _ in s["events"]] == ["end"]

        # WebSocket: the handshake's traceparent is every generation's parent
        trace, span, tp = parent()
        async with websockets.connect(ws_url(url), additional_headers=tp) as ws:
            await ws.send(json.dumps({"id": "a", "prompt": "k", "params": {"max_tokens": 3}}))
            while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                pass
            await ws.send(json.dumps({"id": "b", "prompt": "k", "params": {"max_tokens": 500}}))
            await asyncio.wait_for(ws.recv(), 10)
        spans = await spans_of(rx, trace, 2)
        by_stream = {s["attributes"]["sluice.stream"]: s for s in spans}
        check(by_stream["a"], span, "websocket", "finished")
        check(by_stream["b"], span, "websocket", "disconnected")
        assert by_stream["a"]["attributes"]["sluice.completion_tokens"] == 3


async def test_sampling_ratio_and_no_traceparent(sim, rx):
    """Ratio 0: a request without `traceparent` is not traced, a sampled caller's is (the
    negative control that spans only come from the requests that asked for them)."""
    async with serve(sim, otlp_traces_endpoint=rx.endpoint, trace_sample_ratio=0.0) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/v1/stream", json={"prompt": "p", "max_tokens": 2})
            assert r.status_code == 200
            trace, span, tp = parent()
            r = await c.post("/v1/stream", json={"prompt": "p", "max_tokens": 2}, headers=tp)
            assert r.status_code == 200
            [s] = await spans_of(rx, trace)
            check(s, span, "sse", "finished")
            await asyncio.sleep(1.0)  # past the exporter's batch delay
    assert [s["trace_id"] for s in rx.snapshot()] == [trace]


async def test_tracing_off_by_default(sim, rx):
    async with serve(sim) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        _, _, tp = parent()
        assert (await c.post("/v1/stream", json={"prompt": "p", "max_tokens": 2},
                             headers=tp)).status_code == 200  # fmt: skip
        await asyncio.sleep(1.0)
    assert rx.requests == 0


async def test_a_queued_request_shows_its_wait_and_class(sim, rx):
    async with serve(sim, otlp_traces_endpoint=rx.endpoint, max_concurrent_streams=1,
                     queue_size=2, priority_classes=["interactive", "batch"]) as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            hold_trace, _, hold_tp = parent()
            body = {"prompt": "p", "max_tokens": 2000, "ignore_eos": True}  # 4 s
            async with c.stream("POST", "/v1/stream", json=body, headers=hold_tp) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()  # kept: a dropped line iterator closes the response
                async for line in lines:
                    if line.startswith("data:"):
                        break  # the one slot is taken
                trace, span, tp = parent()
                waiting = asyncio.create_task(c.post("/v1/stream", headers=tp,
                                                     json={"prompt": "q", "max_tokens": 2}))  # fmt: skip
                await eventually(lambda: _queued(c), what="queued")
            # The held stream's client left: its slot goes to the waiting request.
            assert (await waiting).status_code == 200
            [s] = await spans_of(rx, trace)
            a = check(s, span, "sse", "finished")
            assert [e for e, _ in s["events"]] == ["queued", *EVENTS]
            assert a["sluice.priority"] == "batch" and a["sluice.queue_wait_ms"] > 0
            [held_span] = await spans_of(rx, hold_trace)
            assert [e for e, _ in held_span["events"]] == EVENTS  # found a free slot
            assert held_span["attributes"]["sluice.queue_wait_ms"] == 0


async def _queued(c: httpx.AsyncClient) -> bool:
    text = (await c.get("/metrics")).text
    return 'sluice_queue_depth{model="sim",priority="batch"} 1.0' in text
