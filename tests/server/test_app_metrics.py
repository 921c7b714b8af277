"""After a known set of requests the Prometheus counters and histogram counts match."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from app_helpers import sse_events, token_payloads, ws_url
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine]


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(m: dict, name: str, protocol: str, **labels) -> float:
    key = (name, tuple(sorted({"model": "tiny", "protocol": protocol, **labels}.items())))
    return m[key]


async def test_metrics_match_known_requests(make_server, engine):
    url = await make_server()
    itl_expected = {"sse": 0, "websocket": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for _ in range(3):
            events = await sse_events(
                c, "POST", "/v1/stream", json={"prompt": "m", "max_tokens": 5}
            )
            n_token_events = len(token_payloads(events)) - 1
            itl_expected["sse"] += n_token_events - 1
        r = await c.post("/v1/stream", json={"prompt": "m", "max_tokens": -1})
        assert r.status_code == 400
        # OpenAI: one streamed chat, one non-streamed
        async with c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "m"}], "max_tokens": 6, "stream": True,
        }) as r:  # fmt: skip
            body = (await r.aread()).decode()
        assert body.rstrip().endswith("data: [DONE]")
        r = await c.post("/v1/completions", json={"prompt": "m", "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3
        # a client that leaves mid-stream
        async with c.stream("POST", "/v1/stream", json={"prompt": "m", "max_tokens": 480}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        for _ in range(100):
            if engine.num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.05)
        # probes are not requests
        for path in ("/health", "/ready", "/metrics", "/health"):
            await c.get(path)

    async with websockets.connect(ws_url(url)) as ws:
        for rid in ("w1", "w2"):
            await ws.send(json.dumps({"id": rid, "prompt": "m", "params": {"max_tokens": 4}}))
            n = 0
            while not json.loads(await asyncio.wait_for(ws.recv(), 30))["finished"]:
                n += 1
            itl_expected["websocket"] += n - 1

    await asyncio.sleep(0.3)  # the disconnected stream's cleanup has run
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        m = samples((await c.get("/metrics")).text)

    assert get(m, "sluice_requests_total", "sse") == 4
    assert get(m, "sluice_requests_total", "openai") == 2
    assert get(m, "sluice_requests_total", "websocket") == 2
    # TTFT: every stream that wrote a token; not the non-streamed completion
    assert get(m, "sluice_ttft_seconds_count", "sse") == 4
    assert get(m, "sluice_ttft_seconds_count", "openai") == 1
    assert get(m, "sluice_ttft_seconds_count", "websocket") == 2
    assert get(m, "sluice_ttft_seconds_bucket", "sse", le="60.0") == 4
    assert get(m, "sluice_e2e_latency_seconds_count", "sse") == 4
    assert get(m, "sluice_e2e_latency_seconds_count", "openai") == 2
    assert get(m, "sluice_first_output_seconds_count", "websocket") == 2
    assert (
        get(m, "sluice_inter_token_latency_seconds_count", "websocket") == itl_expected["websocket"]
    )
    # the disconnected stream adds its own gaps; the three finished ones are exact
    assert get(m, "sluice_inter_token_latency_seconds_count", "sse") >= itl_expected["sse"]
    # output tokens: 3x5 finished + at least 1 before the disconnect
    assert 16 <= get(m, "sluice_output_tokens_total", "sse") <= 15 + 480
    assert get(m, "sluice_output_tokens_total", "openai") == 9
    assert get(m, "sluice_output_tokens_total", "websocket") == 8
    assert get(m, "sluice_client_disconnects_total", "sse") == 1
    assert get(m, "sluice_aborts_total", "sse") == 1
    assert get(m, "sluice_client_disconnects_total", "websocket") == 0
    assert get(m, "sluice_stream_errors_total", "sse") == 0
    assert get(m, "sluice_rejections_total", "sse", reason="bad_input") == 1
    assert get(m, "sluice_rejections_total", "sse", reason="capacity") == 0
    for p in ("sse", "openai", "websocket"):
        assert get(m, "sluice_active_streams", p) == 0
    # buckets resolve 5 ms to 60 s
    les = {dict(k[1])["le"] for k in m if k[0] == "sluice_ttft_seconds_bucket"}
    assert {"0.005", "60.0", "+Inf"} <= les


async def test_metrics_include_engine_and_process_metrics(server_url):
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as c:
        text = (await c.get("/metrics")).text
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert "sluice_ttft_seconds" in names and "process_resident_memory_bytes" in names
    assert any(n.startswith("vllm:") for n in names), sorted(names)[:50]
