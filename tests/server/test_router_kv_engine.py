"""The router's hashes equal the real engine's, read from its own KV events.

One real vLLM engine (CPU build, tiny model) with prefix caching and KV events on ZMQ, and
a fixed PYTHONHASHSEED in its processes, serves both tests here (one module: one engine
start); the router's `Subscriber` follows it.

Block hashes: a prompt's `BlockStored` hashes, decoded by `kvcache.kvevents`, must equal
`kvcache.blockhash`'s hashes of the prompt's token ids: precise placement works only if they
do. The prompt is about 300 tokens: the CPU build's block is 128 tokens (the GPU default is
16), so the router must take the block size from the engine's configuration. Controls: the
same prompt with a `cache_salt` is stored under other hashes, which `blockhash` predicts
with the salt; hashes computed with another seed match nothing. This test runs first: the
first blocks the engine ever stores are its prompt's.

Prompt hashes: a router-side `PromptHasher`, built from what the pod serves at
`GET /internal/prefix-cache` (block size, hash, seed and the tokenizer files with vLLM's
resolved chat template), predicts the `BlockStored` hashes vLLM publishes for a chat, a
completions, an OpenAI Responses, an Anthropic Messages and a token-stream request sent to
our server, and for a request salted with its caller's tenant. Its prompts begin with a
fresh uuid, so none shares a block with the first test's. Controls: another block size, or
the chat's text without the template, predicts none of them, and a Responses or Messages
request's text hashed as a plain completion differs from its hashes (the chat template is
in them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid

import httpx
import pytest
import pytest_asyncio
from app_helpers import ENGINE_KV_BYTES, another_engine, engine_settings, serving
from sluice_server.engine.base import StreamRequest
from sluice_server.kvcache import blockhash, kvevents
from sluice_server.router.prompts import PromptHasher, fetch_hasher
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

SEED = "20261203"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def kv_engine(tiny_model_path):
    """A second engine (prefix caching and KV events are fixed at engine start), its
    processes started with PYTHONHASHSEED=SEED; yields (engine, events, replay)."""
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": events.replace("127.0.0.1", "*"), "replay_endpoint": replay}  # fmt: skip
    settings = engine_settings(
        tiny_model_path,
        engine_args=["--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE_KV_BYTES),
                     "--enable-prefix-caching", "--kv-events-config", json.dumps(config)],
    )  # fmt: skip
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = SEED  # read by the engine core process it starts
    try:
        async with another_engine(settings) as engine:
            if saved is None:
                os.environ.pop("PYTHONHASHSEED")
            else:
                os.environ["PYTHONHASHSEED"] = saved
            yield engine, events, replay
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved


async def prefill(engine, rid: str, ids: list[int], salt: str | None = None) -> int:
    """Run the prompt (one output token) on vLLM's AsyncLLM; its num_cached_tokens."""
    from vllm import SamplingParams

    prompt: dict = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    outputs = []

    async def run() -> None:
        async for out in engine.llm.generate(prompt, SamplingParams(max_tokens=1), rid):
            outputs.append(out)

    await asyncio.wait_for(run(), 120)
    assert outputs and outputs[-1].finished
    return outputs[0].num_cached_tokens


def stored(updates) -> list[int | bytes]:
    return [h for u in updates if isinstance(u, kvevents.Batch) for e in u.batch.events
            if isinstance(e, kvevents.BlockStored) for h in e.block_hashes]  # fmt: skip


async def test_block_stored_hashes_equal_the_routers(kv_engine):
    engine, events, replay = kv_engine
    sub = kvevents.Subscriber("tiny-0", events, replay_endpoint=replay)
    task = asyncio.create_task(sub.run())
    try:
        bs = engine.llm.vllm_config.cache_config.block_size
        text = " ".join(f"word{i} and" for i in range(54))
        req = StreamRequest(request_id="kv-probe", prompt=text)
        engine.prepare(req)
        ids = list(req.prompt_token_ids)
        assert 2 * bs < len(ids) < 500, (len(ids), bs)
        hasher = blockhash.BlockHasher("sha256", SEED, bs)
        want = [blockhash.external(h) for h in hasher.block_hashes(ids)]
        salted = [blockhash.external(h) for h in hasher.block_hashes(ids, cache_salt="tenant-b")]
        assert not set(want) & set(salted)

        assert await prefill(engine, "kv-1", ids) == 0
        # One more batch after it, so a subscriber that joined late replays from 0.
        assert await prefill(engine, "kv-2", ids, salt="tenant-b") == 0
        # The same prompt again: its full blocks, never its last token (as blockhash says).
        assert await prefill(engine, "kv-3", ids) == bs * blockhash.cacheable_blocks(len(ids), bs)

        got: list[kvevents.Update] = []

        async def both_seen() -> bool:
            while (u := sub.get_nowait()) is not None:
                got.append(u)
            seen = set(stored(got))
            return set(want) <= seen and set(salted) <= seen

        await eventually_async(
            both_seen, timeout=20, interval=0.05, message="the engine's KV events"
        )
        blocks = [e for u in got if isinstance(u, kvevents.Batch) for e in u.batch.events
                  if isinstance(e, kvevents.BlockStored)]  # fmt: skip
        first = blocks[0]
        assert first.block_hashes == want and first.parent_block_hash is None
        assert first.token_ids == ids[: len(want) * bs] and first.block_size == bs
        assert blocks[1].block_hashes == salted  # the control: another salt, other hashes
        assert not any(isinstance(u, kvevents.Reset) for u in got)
        # A router with the wrong seed would match nothing.
        wrong = blockhash.BlockHasher("sha256", blockhash.DEFAULT_NONE_HASH_SEED, bs)
        assert not set(map(blockhash.external, wrong.block_hashes(ids))) & set(stored(got))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def text() -> str:
    """About 300 tokens (two of the CPU build's 128-token blocks), new to the cache."""
    return uuid.uuid4().hex + " " + " ".join(f"word{i} and" for i in range(50))


@contextlib.asynccontextmanager
async def server(engine, tiny_model_path, **overrides):
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    port = free_port()
    settings = engine_settings(tiny_model_path, port=port, **overrides)
    async with serving(uvicorn_config(settings, build_app(settings, engine))):
        yield f"http://127.0.0.1:{port}"


async def test_router_hashes_equal_the_engines(kv_engine, tiny_model_path, tmp_path, monkeypatch):
    engine, events, replay = kv_engine
    # The pod's environment as its engine core has it (the fixture restores the test's).
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    sub = kvevents.Subscriber("tiny-0", events, replay_endpoint=replay)
    task = asyncio.create_task(sub.run())
    keys = tmp_path / "keys"
    keys.write_text("sk-a tenant=acme\n")
    chat = {"model": "tiny", "max_tokens": 1,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": text()}]}  # fmt: skip
    requests = [
        ("open", "/v1/chat/completions", chat, None),
        ("open", "/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": text()}, None),
        ("open", "/v1/stream", {"max_tokens": 1, "messages": [{"role": "user", "content": text()}]}, None),
        ("keyed", "/v1/chat/completions", {**chat, "cache_salt": "mine"}, "acme"),
        ("open", "/v1/responses", {"model": "tiny", "max_output_tokens": 1,
                                   "instructions": "You are terse.", "input": [
                                       {"role": "user", "content": [
                                           {"type": "input_text", "text": text()}]}]}, None),
        ("open", "/v1/messages", {"model": "tiny", "max_tokens": 1,
                                  "system": [{"type": "text", "text": "You are terse."}],
                                  "messages": [{"role": "user", "content": text()}]}, None),
    ]  # fmt: skip
    try:
        async with (
            server(engine, tiny_model_path, describe_prefix_cache=True) as open_url,
            server(engine, tiny_model_path, api_key_file=keys) as keyed_url,
            httpx.AsyncClient(timeout=120) as client,
        ):
            desc = (await client.get(open_url + "/internal/prefix-cache")).json()
            bs = engine.llm.vllm_config.cache_config.block_size
            assert desc["block_size"] == bs and desc["none_hash_seed"] == SEED, desc
            assert desc["tokenizer"]["kind"] == "hf" and desc["enabled"]
            hasher = await fetch_hasher(client, open_url, tmp_path / "tokenizers")
            assert hasher is not None, desc["tokenizer"].get("default_chat_template_kwargs")
            urls = {"open": open_url, "keyed": keyed_url}
            wants = []
            for where, path, body, tenant in requests:
                raw = json.dumps(body).encode()
                want = hasher.hashes(path, raw, tenant)
                assert want is not None and len(want) >= 2, (path, want)
                wants.append(want)
                headers = {"content-type": "application/json", "authorization": "Bearer sk-a"}
                r = await client.post(urls[where] + path, content=raw, headers=headers)
                assert r.status_code == 200, (path, r.text)
            # The chat salted by its tenant is stored under other hashes than unsalted.
            assert not set(wants[0]) & set(wants[3])

            got: list[kvevents.Update] = []

            async def all_seen() -> bool:
                while (u := sub.get_nowait()) is not None:
                    got.append(u)
                return all(set(w) <= set(stored(got)) for w in wants)

            await eventually_async(all_seen, timeout=30, interval=0.05, message="KV events")
            seen = set(stored(got))
            # Controls: another block size; the chat's text without its template.
            wrong = PromptHasher.from_description({**desc, "block_size": 16}, hasher_dir(tmp_path))
            assert wrong is not None
            assert not set(wrong.hashes(requests[0][1], json.dumps(chat).encode(), None)) & seen
            tok = hasher.tokens.tok  # type: ignore[union-attr]
            plain = tok.encode("\n".join(m["content"] for m in chat["messages"]))
            plain_hashes = hasher.hasher.block_hashes(plain)
            assert len(plain_hashes) >= 2
            assert not set(map(blockhash.external, plain_hashes)) & seen
            # The Responses and Messages requests' text as a plain completion: other hashes.
            responses, messages = requests[4][2], requests[5][2]
            for body, prompt, want in [
                (responses, responses["input"][0]["content"][0]["text"], wants[4]),
                (messages, messages["messages"][0]["content"], wants[5]),
            ]:
                completion = json.dumps({"model": "tiny", "prompt": prompt}).encode()
                as_completion = hasher.hashes("/v1/completions", completion, None)
                assert as_completion and len(as_completion) >= 2
                assert not set(as_completion) & set(want), body
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def hasher_dir(tmp_path):
    (folder,) = [p for p in (tmp_path / "tokenizers").iterdir() if p.is_dir()]
    return folder
