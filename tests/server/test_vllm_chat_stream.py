"""A plain streamed chat request is written by `engine/vllm_chat_stream.py`, every other
by vLLM's own generator; on the real engine both give the same chunks, byte for byte but
for the request id and the creation time, for the same requests (seeded sampling).

Both generators read the same engine outputs: the first run's, recorded as the engine
gave them, are handed again to the second. Which outputs come out of a request is not
fixed by its seed alone: vLLM merges a request's outputs when its reader falls behind the
engine (one chunk with two steps' text), and with several choices (`n`) the engine's
steps decide how one choice's chunks interleave with another's. Each choice's own chunks
are compared too, so a difference says which choice it is in."""

from __future__ import annotations

import copy
import json
import re

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
PLAIN = {
    "usage": {"stream_options": {"include_usage": True}},
    "no usage": {},
    "a stop string": {"stop": [" the", "a"], "max_tokens": 64},
    "stop_token_ids": {"stop_token_ids": [5, 17, 42, 99], "max_tokens": 64},
    "one token": {"max_tokens": 1, "stream_options": {"include_usage": True}},
    "not unicode-safe text": {"temperature": 1.5, "seed": 3},
}
NOT_PLAIN = {
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "continuous usage": {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}
    },  # fmt: skip
    "n=2": {"n": 2},
    "echo": {"echo": True},
    "token ids": {"return_token_ids": True},
}


class Replay:
    """The engine client's `generate`, recording what the engine gave for the first
    request and giving exactly that (copies) for every later one."""

    def __init__(self, client) -> None:
        self.real, self.outputs, self.calls = client.generate, None, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.outputs is None:
            self.outputs = []
            return self._record(self.real(*args, **kwargs))
        return self._replay()

    async def _record(self, source):
        async for out in source:
            self.outputs.append(copy.deepcopy(out))
            yield out

    async def _replay(self):
        for out in self.outputs:
            yield copy.deepcopy(out)


async def _chunks(serving, api, body: dict) -> list[str]:
    request = api.parse(body, "chat")
    out = []
    async for text in await serving.create_chat_completion(request, None):
        out.append(re.sub(r'"id":"[^"]*"|"created":\d+', '"id":"","created":0', text))
    return out


def _by_choice(chunks: list[str]) -> dict[tuple[int, ...], list[str]]:
    """The chunks of each choice index, in their order (the usage chunk and `[DONE]`, which
    name no choice, under `()`)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for chunk in chunks:
        data = chunk[6:] if chunk.startswith("data: {") else None
        key = tuple(c["index"] for c in json.loads(data)["choices"]) if data else ()
        groups.setdefault(key, []).append(chunk)
    return groups


def _body(extra: dict) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0,
            "seed": 11, "stream": True, **extra}  # fmt: skip


@pytest.mark.parametrize("case", list(PLAIN) + list(NOT_PLAIN))
async def test_the_same_chunks_as_vllms_generator(engine, case, monkeypatch):
    from sluice_server.engine.vllm_chat_stream import is_plain

    serving, api = engine.api.state.openai_serving_chat, engine.api
    body = _body(PLAIN[case] if case in PLAIN else NOT_PLAIN[case])
    assert is_plain(serving, api.parse(body, "chat")) is (case in PLAIN)
    replay = Replay(serving.engine_client)
    monkeypatch.setattr(serving.engine_client, "generate", replay.generate)
    ours = await _chunks(serving, api, body)
    monkeypatch.delattr(serving, "chat_completion_stream_generator")  # vLLM's, unchanged
    theirs = await _chunks(serving, api, body)
    assert replay.calls == 2 and replay.outputs, replay.calls  # one engine request each
    assert _by_choice(ours) == _by_choice(theirs)
    assert ours == theirs
    if "n" in body:
        assert set(_by_choice(ours)) == {(0,), (1,), ()}, ours  # one choice per chunk
    assert ours[-1] == "data: [DONE]\n\n" and len(ours) >= 3
    if case in NOT_PLAIN:
        return
    finish = [json.loads(c[6:])["choices"][0].get("finish_reason") for c in ours[1:-1]
              if '"choices":[{' in c]  # fmt: skip
    assert finish[-1] in ("length", "stop") and set(finish[:-1]) <= {None}, finish


async def test_a_plain_stream_takes_the_fast_path(engine, monkeypatch):
    """The negative control of the comparison above: the route really is ours for a plain
    request (a stream that always went to vLLM would pass it too)."""
    from sluice_server.engine import vllm_chat_stream

    taken = []
    real = vllm_chat_stream.plain_stream

    def spy(*args, **kwargs):
        taken.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(vllm_chat_stream, "plain_stream", spy)
    serving, api = engine.api.state.openai_serving_chat, engine.api
    await _chunks(serving, api, _body(PLAIN["usage"]))
    await _chunks(serving, api, _body(NOT_PLAIN["logprobs"]))
    assert len(taken) == 1 and not taken[0].logprobs


async def test_an_engine_error_mid_stream_ends_with_vllms_error_chunk(engine):
    """An engine failure after the first chunk: vLLM's error chunk, then [DONE]."""
    from sluice_server.engine.vllm_chat_stream import plain_stream

    serving, api = engine.api.state.openai_serving_chat, engine.api
    request = api.parse(_body({}), "chat")

    class Out:
        index, text, token_ids, finish_reason, stop_reason = 0, "hi", [1], None, None

    class Res:
        prompt_token_ids, encoder_prompt_token_ids, outputs = [1, 2], None, [Out()]
        num_cached_tokens = num_cache_creation_tokens = None

    async def failing():
        yield Res()
        raise RuntimeError("engine core died")

    class Meta:
        final_usage_info = None

    chunks = [c async for c in plain_stream(serving, request, failing(), "chatcmpl-x", "tiny",
                                            Meta())]  # fmt: skip
    assert len(chunks) == 4 and chunks[-1] == "data: [DONE]\n\n", chunks
    assert json.loads(chunks[1][6:])["choices"][0]["delta"] == {"content": "hi"}
    error = json.loads(chunks[2][6:])["error"]
    assert "engine core died" in error["message"], error
