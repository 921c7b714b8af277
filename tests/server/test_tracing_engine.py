"""Tracing on the real vLLM engine (tiny model): the caller's trace headers reach
`AsyncLLM.generate` (vLLM drops them with a warning when its own tracing is off, as for the
session's shared engine), the stream is unaffected, and the request's span reaches a real
OTLP/HTTP receiver in the caller's trace with the engine's token counts."""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest
import websockets
from app_helpers import ws_url
from testkit.otlp import OtlpReceiver
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


async def test_spans_of_real_engine_streams(make_server):
    with OtlpReceiver() as rx:
        url = await make_server(otlp_traces_endpoint=rx.endpoint)
        trace, parent = secrets.token_hex(16), secrets.token_hex(8)
        tp = {"traceparent": f"00-{trace}-{parent}-01"}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
            r = await c.post("/v1/stream", json=body, headers=tp)
            assert r.status_code == 200 and "[DONE]" in r.text
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 6, "stream": True}  # fmt: skip
            r = await c.post("/v1/chat/completions", json=chat, headers=tp)
            assert r.status_code == 200 and "[DONE]" in r.text
        async with websockets.connect(ws_url(url), additional_headers=tp) as ws:
            await ws.send(
                json.dumps(
                    {"id": 1, "prompt": "k", "params": {"max_tokens": 5, "ignore_eos": True}}
                )
            )
            while not json.loads(await asyncio.wait_for(ws.recv(), 60)).get("finished"):
                pass
        spans = await eventually_async(
            lambda: rx.trace(trace, at_least=3), timeout=15, message=f"3 spans of trace {trace}"
        )
    mine = {s["attributes"]["sluice.protocol"]: s for s in spans}
    assert set(mine) == {"sse", "openai", "websocket"}, spans
    for protocol, tokens in (("sse", 8), ("openai", 6), ("websocket", 5)):
        a = mine[protocol]["attributes"]
        assert mine[protocol]["parent_span_id"] == parent
        assert (a["sluice.outcome"], a["sluice.completion_tokens"]) == ("finished", tokens)
        assert a["sluice.model"] == "tiny" and a["sluice.prompt_tokens"] >= 1
        names = [e for e, _ in mine[protocol]["events"]]
        assert names == ["admitted", "first_output", "first_byte", "end"], names
