"""The official SDKs against our server on the real engine: OpenAI Responses (`openai`),
Anthropic Messages (`anthropic`), and the utility routes (tokenize, detokenize,
count_tokens, version). Streamed text deltas concatenate to the final text; usage is
present and matches the engine's counts; each API has its `protocol` metric label."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

PROMPT = "Tell me about the river."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def prompt_tokens(tokenizer) -> int:
    """The chat-templated prompt's size (Responses and Messages both render it)."""
    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture
async def openai_client(server_url):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def anthropic_client(server_url):
    from anthropic import AsyncAnthropic

    async with AsyncAnthropic(base_url=server_url, api_key="unused", max_retries=0) as c:
        yield c


async def test_responses_create_and_stream(openai_client, prompt_tokens):
    kw = dict(model="tiny", input=PROMPT, max_output_tokens=24, temperature=0)
    whole = await openai_client.responses.create(**kw)
    # Cut short by max_output_tokens (the tiny model never emits EOS), as vLLM says it.
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text
    # vLLM renders Responses input with the chat template too (its exact size is checked
    # against vLLM's own server in test_stream_apis_compat.py).
    assert whole.usage.input_tokens >= prompt_tokens and whole.usage.output_tokens == 24
    deltas, types = [], []
    async with openai_client.responses.stream(**kw) as stream:
        async for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert len(deltas) > 1  # streamed, not one blob
    assert "".join(deltas) == final.output_text == whole.output_text  # temperature 0
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 24)
    assert final.usage.total_tokens == whole.usage.input_tokens + 24


async def test_anthropic_messages_create_and_stream(anthropic_client, prompt_tokens):
    # This SDK release has no `temperature` argument; the API takes it in the body.
    kw = dict(model="tiny", max_tokens=24, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    whole = await anthropic_client.messages.create(**kw)
    assert whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (prompt_tokens, 24)
    deltas = []
    async with anthropic_client.messages.stream(**kw) as stream:
        async for text in stream.text_stream:
            deltas.append(text)
        final = await stream.get_final_message()
    assert len(deltas) > 1
    assert "".join(deltas) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24 and final.usage.input_tokens == prompt_tokens
    counted = await anthropic_client.messages.count_tokens(model="tiny", messages=kw["messages"])
    assert counted.input_tokens == prompt_tokens


async def test_anthropic_errors_have_anthropic_shape(anthropic_client, server_url):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as info:  # an unknown model (or adapter)
        await anthropic_client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
    assert "nope" in info.value.body["error"]["message"]
    async with httpx.AsyncClient(base_url=server_url) as c:
        r = await c.post("/v1/messages", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


async def test_tokenize_detokenize_round_trip(server_url, tokenizer):
    text = "The cat sends a message to the river."
    async with httpx.AsyncClient(base_url=server_url) as c:
        tok = (await c.post("/tokenize", json={"model": "tiny", "prompt": text})).json()
        assert tok["tokens"] == tokenizer(text)["input_ids"]
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
        back = await c.post("/detokenize", json={"model": "tiny", "tokens": tok["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json()["prompt"] == tokenizer.decode(tok["tokens"])
        assert text in back.json()["prompt"]
        chat = await c.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
        assert chat.json()["count"] > tok["count"]  # the chat template adds its markers
        bad = await c.post("/detokenize", json={"tokens": ["x"]})
        assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
        version = (await c.get("/version")).json()
    import vllm

    assert version == {"version": vllm.__version__}


async def test_metrics_carry_each_apis_label(server_url, openai_client, anthropic_client):
    def samples(text: str, protocol: str) -> float:
        for line in text.splitlines():
            if line.startswith(f'sluice_ttft_seconds_count{{model="tiny",protocol="{protocol}"}}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no TTFT series for {protocol}")

    async with httpx.AsyncClient(base_url=server_url) as c:
        before = (await c.get("/metrics")).text
        async with openai_client.responses.stream(model="tiny", input="hi",
                                                  max_output_tokens=4) as s:  # fmt: skip
            await s.get_final_response()
        async with anthropic_client.messages.stream(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            await s.get_final_message()
        after = (await c.get("/metrics")).text
    for protocol in ("responses", "anthropic"):
        assert samples(after, protocol) == samples(before, protocol) + 1, protocol
    assert samples(after, "openai") == samples(before, "openai")


async def test_disabled_api_is_404_naming_the_flag(make_server):
    url = await make_server(protocols=["sse"])
    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/responses", json={"input": "hi"})
        m = await c.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        ok = await c.post("/tokenize", json={"prompt": "hi"})
    assert r.status_code == 404 and "--protocols" in r.json()["error"]["message"]
    assert "spec.streaming.protocols" in r.json()["error"]["message"]
    assert "'responses'" in r.json()["error"]["message"]
    assert m.status_code == 404 and "'anthropic'" in m.json()["error"]["message"]
    assert ok.status_code == 200


async def test_drain_lets_streams_in_flight_finish(make_server):
    """Drain (what SIGTERM starts, `serve.py`) with a Responses and a Messages stream in
    flight: new requests get 503 at once, both streams run to their normal last event."""
    import asyncio

    url = await make_server()
    gate = make_server.apps[url].state.services.gate
    streams = {
        "responses": ("/v1/responses", {"model": "tiny", "input": "drain me", "stream": True,
                                        "max_output_tokens": 300}),
        "anthropic": ("/v1/messages", {"model": "tiny", "max_tokens": 300, "stream": True,
                                       "messages": [{"role": "user", "content": "drain me"}]}),
    }  # fmt: skip
    started = {name: asyncio.Event() for name in streams}
    events: dict[str, list[str]] = {name: [] for name in streams}

    async def read(c: httpx.AsyncClient, name: str) -> None:
        path, body = streams[name]
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    events[name].append(line[7:])
                    if len(events[name]) > 4:
                        started[name].set()

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        readers = [asyncio.create_task(read(c, name)) for name in streams]
        for name in streams:
            await asyncio.wait_for(started[name].wait(), 60)
        drain = asyncio.create_task(gate.drain(120))
        await asyncio.sleep(0)
        for path, body in streams.values():
            refused = await c.post(path, json={**body, "stream": False})
            assert refused.status_code == 503, refused.text
        assert not any(t.done() for t in readers), "streams should still be running"
        await asyncio.wait_for(asyncio.gather(*readers), 120)
        assert await asyncio.wait_for(drain, 10) == 0  # none had to be cut off
    assert events["responses"][-1] == "response.completed", events["responses"][-3:]
    assert events["anthropic"][-2:] == ["message_delta", "message_stop"], events["anthropic"]
    assert "error" not in events["responses"] + events["anthropic"]
