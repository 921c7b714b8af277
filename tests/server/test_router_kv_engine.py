"""The router's block hashes equal the real engine's, read from its own KV events.

One real vLLM engine (CPU build, tiny model) with prefix caching and KV events on ZMQ, and
a fixed PYTHONHASHSEED in its processes; the router's `Subscriber` follows it. A prompt's
`BlockStored` hashes, decoded by `kvcache.kvevents`, must equal `kvcache.blockhash`'s hashes
of the prompt's token ids: precise placement works only if they do. The prompt is about 300
tokens: the CPU build's block is 128 tokens (the GPU default is 16), so the router must take
the block size from the engine's configuration. Controls: the same prompt with a
`cache_salt` is stored under other hashes, which `blockhash` predicts with the salt; hashes
computed with another seed match nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
import pytest_asyncio
from app_helpers import ENGINE_KV_BYTES, another_engine, engine_settings
from sluice_server.engine.base import StreamRequest
from sluice_server.kvcache import blockhash, kvevents
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
