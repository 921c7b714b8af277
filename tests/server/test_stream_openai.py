"""The official `openai` SDK against our server on the real engine: chat and completions,
streaming and not, with usage, stop, max_tokens and seed honoured."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
PROMPT = "The cat sends a message"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def chat_prompt_tokens(tokenizer) -> int:
    # vLLM renders the template to text, then tokenizes it without adding BOS.
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture
async def client(server_url):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_models_lists_served_name(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_chat_non_streaming_usage_and_seed(client, chat_prompt_tokens):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=16, seed=7, temperature=1.0)
    a = await client.chat.completions.create(**kw)
    b = await client.chat.completions.create(**kw)
    choice = a.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"  # the tiny model never emits EOS
    assert a.usage.prompt_tokens == chat_prompt_tokens
    assert a.usage.completion_tokens == 16
    assert a.usage.total_tokens == chat_prompt_tokens + 16
    assert b.choices[0].message.content == choice.message.content  # same seed, same text
    c = await client.chat.completions.create(**{**kw, "seed": 8})
    assert c.choices[0].message.content != choice.message.content


async def test_chat_streaming_matches_non_streaming_and_reports_usage(client, chat_prompt_tokens):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=24, seed=11, temperature=1.0)
    whole = await client.chat.completions.create(**kw)
    stream = await client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage_chunks, content_chunks = [], None, [], 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
                content_chunks += 1
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert content_chunks > 1  # streamed, not one blob
    assert finish == "length"
    # include_usage: exactly one usage chunk, the last, with no choices.
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    usage = usage_chunks[0].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (chat_prompt_tokens, 24)


async def test_chat_stop_string_is_honoured(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=40, seed=3, temperature=1.0)
    full = (await client.chat.completions.create(**kw)).choices[0].message.content
    stop = full[20:23]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            s = await client.chat.completions.create(**kw, stop=[stop], stream=True)
            text, finish = "", None
            async for chunk in s:
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
        else:
            r = await client.chat.completions.create(**kw, stop=[stop])
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", stream
        assert text == expected, stream


async def test_completions_non_streaming_and_streaming(client, tokenizer):
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, seed=5, temperature=1.0)
    whole = await client.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, 20)
    stream = await client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    text, usage, chunks = "", None, 0
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            chunks += bool(ch.text)
        usage = chunk.usage or usage
    assert text == whole.choices[0].text
    assert chunks > 1
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        n_prompt,
        20,
        n_prompt + 20,
    )


async def test_completions_max_tokens_and_stop(client):
    kw = dict(model="tiny", prompt=PROMPT, seed=9, temperature=1.0)
    one = await client.completions.create(**kw, max_tokens=1)
    assert one.usage.completion_tokens == 1 and one.choices[0].text
    full = (await client.completions.create(**kw, max_tokens=30)).choices[0].text
    stop = full[12:14]
    r = await client.completions.create(**kw, max_tokens=30, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


async def test_unknown_model_is_an_openai_error(client):
    import openai

    with pytest.raises((openai.NotFoundError, openai.BadRequestError)) as info:
        await client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert "nope" in str(info.value)
    # and the server keeps serving
    ok = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert ok.usage.completion_tokens == 2
