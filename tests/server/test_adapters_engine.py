"""LoRA adapters on the real vLLM engine (CPU build, tiny model), started with LoRA on.

Last in the server suite (its name): its second engine takes over vLLM's metrics in the
process-wide Prometheus registry, so the session engine's counters read by later tests
would stop moving.

Adapters are made at test time (PEFT's file layout, random weights: testkit/lora.py). At
temperature 0 an adapter's answer differs from the base's and the base's answer does not
change; every protocol routes by `model`; streams on the base and two adapters run at once
without mixing; an adapter stream is aborted when its client goes (engine tokens after the
drop <= 2, from the engine core's own step timestamps, as test_stream_abort.py measures);
a stalled reader of an adapter stream is cut off at the buffer cap as on the base;
unknown names are 404; an adapter the engine refuses (rank over --max-lora-rank) is Failed
with the engine's reason while the others serve; /metrics keeps vLLM's own
`vllm:lora_requests_info`, read without error by an endpoint picker's rules (epp_rules.py).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import (
    PROBE,
    engine_flushed,
    engine_settings,
    serving,
    sse_events,
    token_payloads,
    ws_url,
)
from epp_rules import extract
from lora_helpers import make_adapter, write_adapters
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "user", "content": "hello there"}]
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": make_adapter(root / "alpha", tiny_model_path, rank=8, scale=0.5, seed=1),
        "beta": make_adapter(root / "beta", tiny_model_path, rank=8, scale=0.5, seed=2),
        # Rank 16 over the engine's --max-lora-rank 8: the engine core refuses it.
        "too-big": make_adapter(root / "too-big", tiny_model_path, rank=16, seed=3),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_server(lora_engine, tiny_model_path, adapter_dirs, tmp_path_factory):
    from conftest import LORA_LIMITS
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    path = tmp_path_factory.mktemp("lora-config") / "adapters.json"
    write_adapters(path, adapter_dirs)
    port = free_port()
    settings = engine_settings(tiny_model_path, port=port, adapters_file=path, **LORA_LIMITS)
    app = build_app(settings, lora_engine)
    async with serving(uvicorn_config(settings, app)):
        yield f"http://127.0.0.1:{port}", app


async def chat(c: httpx.AsyncClient, model: str | None = None, **extra) -> str:
    body = {"messages": MESSAGES, **GREEDY, **extra, **({"model": model} if model else {})}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def test_adapters_change_the_answer_and_the_base_stays_the_same(lora_server):
    url, app = lora_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        base = await chat(c)
        alpha, beta = await chat(c, "alpha"), await chat(c, "beta")
        assert len({base, alpha, beta}) == 3, (base, alpha, beta)
        assert await chat(c) == base == await chat(c, "tiny")  # after adapter requests too
        assert await chat(c, "alpha") == alpha  # deterministic

        models = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            ("tiny", None), ("alpha", "tiny"), ("beta", "tiny")]  # fmt: skip
        state = {s["name"]: s for s in app.state.services.adapters.status()}
        assert state["too-big"]["state"] == "Failed"
        assert "max_lora_rank" in state["too-big"]["reason"], state
        r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "model": "too-big"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "`tiny`, `alpha`, `beta`" in r.json()["error"]["message"]
        metrics = (await c.get("/metrics")).text
        assert "vllm:lora_requests_info" in metrics
        # As an endpoint picker reads it (llm-d-router's extractor rules): no error, and the
        # engine's adapter slots (max_lora) as an int.
        epp = extract(metrics)
        assert epp.errors == [] and epp.max_adapters > 0, epp
        assert 'sluice_adapter_state{adapter="alpha"' in metrics


async def test_every_protocol_serves_an_adapter_by_name(lora_server):
    url, _ = lora_server

    async def each(c: httpx.AsyncClient, model: str | None) -> dict[str, str]:
        m = {"model": model} if model else {}
        out = {"chat": await chat(c, model)}
        r = await c.post("/v1/completions", json={"prompt": "hello there", **GREEDY, **m})
        out["completions"] = r.json()["choices"][0]["text"]
        r = await c.post("/v1/responses", json={"input": "hello there", "temperature": 0,
                                                "max_output_tokens": 12, **m})  # fmt: skip
        out["responses"] = r.json()["output"][-1]["content"][0]["text"]
        r = await c.post("/v1/messages", json={"messages": MESSAGES, **GREEDY, "model": model
                                               or "tiny"})  # fmt: skip
        out["messages"] = r.json()["content"][0]["text"]
        events = await sse_events(c, "POST", "/v1/stream", json={"messages": MESSAGES,
                                                                  **GREEDY, **m})  # fmt: skip
        out["sse-post"] = "".join(p["token"] for p in token_payloads(events))
        events = await sse_events(c, "GET", "/v1/stream", params={
            "messages": json.dumps(MESSAGES), **GREEDY, **m})  # fmt: skip
        out["sse-get"] = "".join(p["token"] for p in token_payloads(events))
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"id": 1, "messages": MESSAGES, "params": GREEDY, **m}))
            text = ""
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert f.get("type") != "error", f
                text += f["token"]
                if f["finished"]:
                    break
        out["websocket"] = text
        return out

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        base, alpha = await each(c, None), await each(c, "alpha")
    for protocol in base:
        assert base[protocol] != alpha[protocol], protocol
    # The token stream and the WebSocket render the chat prompt as vLLM's chat route does.
    assert alpha["sse-post"] == alpha["sse-get"] == alpha["websocket"] == alpha["chat"]


async def test_concurrent_streams_on_the_base_and_two_adapters(lora_server):
    url, _ = lora_server
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def stream(c: httpx.AsyncClient, model: str | None) -> str:
        events = await sse_events(c, "POST", "/v1/stream",
                                  json={**body, **({"model": model} if model else {})})  # fmt: skip
        return "".join(p["token"] for p in token_payloads(events))

    models = [None, "alpha", "beta"]
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        alone = [await stream(c, m) for m in models]
        together = await asyncio.gather(*(stream(c, m) for m in models * 2))
    assert len(set(alone)) == 3
    assert list(together) == alone * 2  # each its own answer, none mixed with another's


async def test_an_adapter_stream_is_aborted_when_its_client_goes(lora_server, lora_engine):
    url, _ = lora_server
    engine = lora_engine
    op = engine.llm.output_processor
    real = op.process_outputs
    log: list[tuple[float, int]] = []

    def spy(outputs, engine_core_timestamp=None, *args, **kwargs):
        log.append((engine_core_timestamp or time.monotonic(),
                    sum(len(o.new_token_ids) for o in outputs
                        if not o.request_id.startswith(PROBE))))  # fmt: skip
        return real(outputs, engine_core_timestamp, *args, **kwargs)

    op.process_outputs = spy
    try:
        client = httpx.AsyncClient(timeout=30)
        body = {"prompt": "The river", "max_tokens": 400, "ignore_eos": True, "model": "beta"}
        async with client.stream("POST", url + "/v1/stream", json=body) as r:
            assert r.status_code == 200
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: {")
                if got >= 20:
                    break
            t_gone = time.monotonic()
            await client.aclose()  # drop the connection
        await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=5,
                               interval=0.005, message="the engine request to finish")  # fmt: skip
        await engine_flushed(engine)  # every batch the core made before the abort counted
    finally:
        del op.process_outputs
    after = sum(n for ts, n in log if ts > t_gone)
    print(f"\nTIMING adapter sse disconnect: engine tokens after disconnect={after}")
    assert sum(n for _, n in log) < 400 and after <= 2


async def test_unknown_model_is_404_on_every_protocol(lora_server):
    url, _ = lora_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for route, body in (
            ("/v1/chat/completions", {"messages": MESSAGES}),
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/responses", {"input": "x"}),
            ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4}),
            ("/v1/stream", {"prompt": "x"}),
        ):
            r = await c.post(route, json={**body, "model": "gamma"})
            assert r.status_code == 404, (route, r.text)
            assert "`tiny`, `alpha`, `beta`" in r.json()["error"]["message"]
        r = await c.get("/v1/stream", params={"prompt": "x", "model": "gamma"})
        assert r.status_code == 404
    async with websockets.connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"id": 1, "prompt": "x", "model": "gamma"}))
        f = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert f["type"] == "error" and f["error"]["code"] == "model_not_found"


async def test_a_stalled_adapter_stream_is_cut_off_as_any_stream(
    lora_engine, tiny_model_path, adapter_dirs, tmp_path
):
    """Backpressure is the same for an adapter: its reader stalls, past 16 undelivered
    events the engine request is aborted early, and when the reader comes back it gets the
    error event and [DONE] (test_stream_backpressure.py, on the base)."""
    from conftest import LORA_LIMITS
    from test_stream_abort import generated_tokens, settle
    from test_stream_backpressure import MAX_TOKENS, read_all, small_buffer_server, stalled_request

    path = tmp_path / "adapters.json"
    write_adapters(path, {"beta": adapter_dirs["beta"]})
    body = json.dumps({"prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "model": "beta"}).encode()  # fmt: skip
    async with small_buffer_server(lora_engine, tiny_model_path, adapters_file=path,
                                   stream_buffer_tokens=16, send_timeout_seconds=30,
                                   **LORA_LIMITS) as port:  # fmt: skip
        s, before = await stalled_request(port, body=body)
        await asyncio.sleep(0.2)
        await settle(lora_engine, limit_s=20)  # the engine request ends while we stall
        generated = generated_tokens() - before
        data = await read_all(s)
        s.close()
    text = data.decode(errors="replace")
    assert text.startswith("HTTP/1.1 200"), text[:300]  # served by the adapter
    assert generated < MAX_TOKENS * 0.8, "the adapter's request was not aborted early"
    assert "event: error" in text and "too slow" in text.lower(), text[-600:]
    assert text.rstrip("\r\n0 ").endswith("data: [DONE]"), text[-300:]
