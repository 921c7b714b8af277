"""Every client API on the simulator engine (no model): the official `openai` and
`anthropic` SDKs stream Responses and Messages from it, the utility routes answer, and a
failure after the 200 is each API's own error event. Fast: the route layer is the same as
on vLLM (`protocols/engine_api.py`), only the serving layer is the built-in one."""

from __future__ import annotations

import json

import httpx
import pytest
from app_helpers import serve_simulator, sse_events
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [{"role": "user", "content": "hello river"}]


def sim() -> SimulatorEngine:
    return SimulatorEngine("sim", ttft_ms=5, itl_ms=2)


async def test_official_sdks_stream_responses_and_messages():
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async with serve_simulator(sim()) as url:
        oc = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        whole = await oc.responses.create(model="sim", input="hello river", max_output_tokens=8)
        assert whole.status == "incomplete" and len(whole.output_text.split()) == 8
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (2, 8)
        async with oc.responses.stream(model="sim", input="hello river",
                                       max_output_tokens=8) as s:  # fmt: skip
            deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        assert "".join(deltas) == final.output_text == whole.output_text
        assert final.usage.total_tokens == 10

        ac = AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        msg = await ac.messages.create(model="sim", max_tokens=8, messages=MESSAGES)
        assert msg.stop_reason == "max_tokens" and len(msg.content[0].text.split()) == 8
        async with ac.messages.stream(model="sim", max_tokens=8, messages=MESSAGES) as s:
            texts = [t async for t in s.text_stream]
            fm = await s.get_final_message()
        assert "".join(texts) == fm.content[0].text == msg.content[0].text
        assert (fm.usage.input_tokens, fm.usage.output_tokens) == (2, 8)
        assert (await ac.messages.count_tokens(model="sim", messages=MESSAGES)).input_tokens == 2
        await oc.close()
        await ac.close()


async def test_utility_routes_on_the_simulator():
    async with serve_simulator(sim()) as url, httpx.AsyncClient(base_url=url) as c:
        tok = (await c.post("/tokenize", json={"prompt": "a b c"})).json()
        assert tok["count"] == 3 == len(tok["tokens"])
        detok = await c.post("/detokenize", json={"tokens": tok["tokens"]})
        assert detok.status_code == 501 and "vocabulary" in detok.json()["error"]["message"]
        assert (await c.get("/version")).json() == {"version": "simulator"}
        both = await c.post("/tokenize", json={"prompt": "a", "messages": MESSAGES})
        assert both.status_code == 400


async def test_error_after_the_200_is_each_apis_own_event():
    """The whole-stream time limit runs out mid-stream: Responses ends with its `error`
    event numbered after the events sent; Messages with Anthropic's `error` event; chat with
    OpenAI's error object and `[DONE]`."""
    engine = SimulatorEngine("sim", ttft_ms=5, itl_ms=20)
    calls = {
        "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 400}),
        "anthropic": ("/v1/messages", {"model": "sim", "max_tokens": 400, "messages": MESSAGES}),
        "openai": ("/v1/chat/completions", {"max_tokens": 400, "messages": MESSAGES}),
    }
    async with serve_simulator(engine, stream_timeout_seconds=0.3) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            got = {name: await sse_events(c, "POST", path, json={**body, "stream": True})
                   for name, (path, body) in calls.items()}  # fmt: skip
    r = got["responses"]
    assert r[-1]["event"] == "error"
    err = json.loads(r[-1]["data"])
    assert err["type"] == "error" and err["code"] == "stream_error" and err["message"]
    assert err["sequence_number"] == len(r) - 1  # continues the stream's numbering
    assert [json.loads(e["data"])["sequence_number"] for e in r] == list(range(len(r)))
    a = got["anthropic"]
    assert a[-1]["event"] == "error" and "message_stop" not in [e["event"] for e in a]
    assert json.loads(a[-1]["data"])["error"]["type"] == "api_error"
    o = got["openai"]
    assert o[-2]["event"] == "error" and o[-1]["data"] == "[DONE]"
    assert json.loads(o[-2]["data"])["error"]["code"] == "stream_error"


async def test_auth_and_disabled_apis_on_every_route(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    async with serve_simulator(sim(), api_key_file=keys, protocols=["sse"]) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            no_key = await c.post("/tokenize", json={"prompt": "a"})
            assert no_key.status_code == 401
            # Anthropic's SDK sends its key as x-api-key.
            ok = await c.post("/tokenize", json={"prompt": "a"}, headers={"x-api-key": "k1"})
            assert ok.status_code == 200
            off = await c.post("/v1/messages", headers={"x-api-key": "k1"},
                               json={"model": "sim", "max_tokens": 2, "messages": MESSAGES})  # fmt: skip
            assert off.status_code == 404
            assert off.json()["type"] == "error"  # Anthropic's error shape on its routes
            assert "spec.streaming.protocols" in off.json()["error"]["message"]


async def test_token_rate_limit_charges_each_apis_usage():
    """tpm: a streamed Messages answer and a whole Responses answer are charged from their
    own usage (input + output tokens); then the key is refused until the bucket refills."""
    async with serve_simulator(sim(), rate_limit_tpm=10) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            body = {"model": "sim", "max_tokens": 12, "messages": MESSAGES, "stream": True}
            await sse_events(c, "POST", "/v1/messages", json=body)  # 2 + 12 tokens: in debt
            refused = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
            assert refused.status_code == 429, refused.text


async def test_heartbeats_during_a_long_prefill_keep_sdks_happy():
    """A slow first token: `: ping` comments go out on the Responses and Messages streams,
    and the official SDKs read through them."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    engine = SimulatorEngine("sim", ttft_ms=400, itl_ms=2)
    async with serve_simulator(engine, heartbeat_seconds=0.05) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            body = {"model": "sim", "max_tokens": 3, "messages": MESSAGES, "stream": True}
            async with c.stream("POST", "/v1/messages", json=body) as r:
                raw = (await r.aread()).decode()
        assert raw.count(": ping") >= 3 and raw.index(": ping") < raw.index("message_start")
        oc = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        async with oc.responses.stream(model="sim", input="hi", max_output_tokens=3) as s:
            assert len((await s.get_final_response()).output_text.split()) == 3
        ac = AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        async with ac.messages.stream(model="sim", max_tokens=3, messages=MESSAGES) as s:
            assert len((await s.get_final_message()).content[0].text.split()) == 3
        await oc.close()
        await ac.close()
