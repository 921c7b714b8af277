"""The simulator's prefix cache and its KV events (no real engine).

The events are decoded by the router's own code (`kvcache.kvevents`, which
tests/server/unit/test_router_vllm_compat.py proves against vLLM's publisher) and their
hashes matched with `kvcache.blockhash` (proven against vLLM's hasher there too). Verdicts
come from what the simulator reports (cached tokens, its prefill record), not wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
from sluice_server.engine.base import SamplingOptions, StreamRequest
from sluice_server.engine.builtin_events import openai_usage
from sluice_server.engine.simcache import EventPublisher, KvEventsConfig, PrefixCache
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.kvcache import blockhash, kvevents
from testkit.net import free_port
from testkit.wait import eventually_async

BS = 16


def engine_hasher() -> blockhash.BlockHasher:
    """The hashes a router computes for the simulator: its algorithm, the seed rule."""
    return blockhash.BlockHasher("sha256", blockhash.none_hash_seed("sha256", os.environ))


def prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def run(engine: SimulatorEngine, rid: str, text: str, max_tokens: int = 2):
    req = StreamRequest(request_id=rid, prompt=text, options=SamplingOptions(max_tokens=max_tokens))
    deltas = [d async for d in engine.generate(req)]
    return req, deltas


def cached_engine(**kw) -> SimulatorEngine:
    base = dict(ttft_ms=1.0, itl_ms=0.0, prefix_cache_blocks=64, prefill_us_per_token=50.0)
    return SimulatorEngine(**{**base, **kw})


async def test_a_repeated_prompt_is_served_from_the_cache_and_starts_sooner():
    engine = cached_engine()
    text = prompt("w", 100)
    _, first = await run(engine, "a", text)
    _, again = await run(engine, "b", text)
    one, two = engine.prefills
    assert (one.prompt_tokens, one.cached_tokens) == (100, 0)
    # Whole blocks only, and never the last prompt token: (100 - 1) // 16 = 6 blocks.
    assert two.cached_tokens == 96 == again[-1].cached_tokens
    assert first[-1].cached_tokens == 0
    assert one.ttft_s == pytest.approx(0.001 + 100 * 50e-6)
    assert two.ttft_s == pytest.approx(0.001 + 4 * 50e-6)
    usage = openai_usage(again[-1])
    assert usage["prompt_tokens_details"] == {"cached_tokens": 96}
    # A prompt sharing only its first 40 words hits its 2 full shared blocks.
    await run(engine, "c", prompt("w", 40) + " " + prompt("x", 60))
    assert engine.prefills[-1].cached_tokens == 32


async def test_without_a_cache_the_simulator_is_unchanged():
    engine = SimulatorEngine(ttft_ms=1.0, itl_ms=0.0)
    assert engine.cache is None
    text = prompt("w", 100)
    await run(engine, "a", text)
    _, again = await run(engine, "b", text)
    assert again[-1].cached_tokens is None and engine.prefills[-1].cached_tokens == 0
    assert engine.prefills[-1].ttft_s == pytest.approx(0.001)
    assert "prompt_tokens_details" not in openai_usage(again[-1])


async def test_a_prompt_plus_its_answer_is_cached_for_the_next_turn():
    """vLLM caches the output's full blocks too: the next turn, which resends the history
    (prompt + answer), hits beyond the first prompt."""
    engine = cached_engine()
    text = prompt("w", 30)
    _, deltas = await run(engine, "t1", text, max_tokens=40)
    answer = "".join(d.text for d in deltas)
    await run(engine, "t2", text + answer + " " + prompt("next", 20))
    assert engine.prefills[-1].cached_tokens == 64  # (30 + 40) // 16 = 4 blocks


def test_the_salt_and_the_adapter_separate_cache_entries():
    cache = PrefixCache(64, blockhash.BlockHasher())
    ids = list(range(100))
    hit = cache.lookup(ids)
    cache.store(ids, hit.hashes)
    assert cache.lookup(ids).cached_blocks == 6
    assert cache.lookup(ids, cache_salt="tenant-b").cached_blocks == 0
    assert cache.lookup(ids, lora=blockhash.Lora("sql", "/a/sql")).cached_blocks == 0


@contextlib.asynccontextmanager
async def subscribed(engine: SimulatorEngine, config: KvEventsConfig):
    sub = kvevents.Subscriber(
        "sim-0",
        config.endpoint.replace("*", "127.0.0.1"),
        replay_endpoint=config.replay_endpoint,
    )
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await engine.shutdown()


async def drain(sub: kvevents.Subscriber, until) -> list[kvevents.Update]:
    got: list[kvevents.Update] = []

    async def done() -> bool:
        while (u := sub.get_nowait()) is not None:
            got.append(u)
        return until(got)

    await eventually_async(done, timeout=10, interval=0.02, message="the KV events")
    return got


def stored(updates) -> list[int]:
    return [h for u in updates if isinstance(u, kvevents.Batch) for e in u.batch.events
            if isinstance(e, kvevents.BlockStored) for h in e.block_hashes]  # fmt: skip


def removed(updates) -> list[int]:
    return [h for u in updates if isinstance(u, kvevents.Batch) for e in u.batch.events
            if isinstance(e, kvevents.BlockRemoved) for h in e.block_hashes]  # fmt: skip


def events_config() -> KvEventsConfig:
    raw = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{free_port()}",
                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})  # fmt: skip
    config = KvEventsConfig.from_json(raw)
    assert config is not None
    return config


async def test_the_simulators_events_decode_with_the_routers_code_and_match_its_hashes():
    config = events_config()
    engine = cached_engine(kv_events=config)
    async with subscribed(engine, config) as sub:
        req, _ = await run(engine, "a", prompt("w", 100), max_tokens=1)
        # The subscriber connects late (a PUB drops what came before): it catches up from 0
        # through the replay endpoint once it sees a batch, so publish one more.
        await run(engine, "b", prompt("v", 40), max_tokens=1)
        want = [blockhash.external(h) for h in engine_hasher().block_hashes(
            req.prompt_token_ids)]  # fmt: skip
        got = await drain(sub, lambda us: len(stored(us)) >= len(want) + 2)
        assert stored(got)[: len(want)] == want
        assert not any(isinstance(u, kvevents.Reset) for u in got)
        first = next(e for u in got if isinstance(u, kvevents.Batch) for e in u.batch.events)
        assert isinstance(first, kvevents.BlockStored)
        assert first.parent_block_hash is None and first.block_size == BS
        assert first.token_ids == req.prompt_token_ids[: len(want) * BS]
        assert [u.seq for u in got if isinstance(u, kvevents.Batch)] == list(range(len(got)))


async def test_lru_eviction_publishes_block_removed_and_keeps_the_capacity():
    config = events_config()
    engine = cached_engine(prefix_cache_blocks=8, kv_events=config)
    hasher = engine_hasher()
    async with subscribed(engine, config) as sub:
        reqs = []
        for i in range(3):  # 5 full blocks each (81 tokens): 15 blocks through 8 slots
            req, _ = await run(engine, f"r{i}", prompt(f"p{i}-", 81), max_tokens=1)
            reqs.append(req)
            assert engine.cache is not None and len(engine.cache) <= 8
        got = await drain(sub, lambda us: len(removed(us)) >= 7)
        hashes = [[blockhash.external(h) for h in hasher.block_hashes(r.prompt_token_ids)]
                  for r in reqs]  # fmt: skip
        # Oldest first: all of the first prompt's blocks, then the second's first two.
        assert removed(got) == hashes[0] + hashes[1][:2]
        assert len(engine.cache) == 8
        # The first prompt is gone: asked again, it is computed in full.
        await run(engine, "again", prompt("p0-", 81), max_tokens=1)
        assert engine.prefills[-1].cached_tokens == 0


def publisher_batch(i: int) -> list[kvevents.KVEvent]:
    return [kvevents.BlockRemoved(block_hashes=[i], medium=kvevents.MEDIUM_GPU)]


async def test_a_gap_is_filled_from_the_replay_endpoint_else_the_index_resets():
    config = events_config()
    pub = EventPublisher(config)
    sub = kvevents.Subscriber("p", "tcp://127.0.0.1:1", replay_endpoint=config.replay_endpoint)
    try:
        for i in range(6):
            pub.publish(publisher_batch(i))
        batch = kvevents.KVEventBatch(ts=0.0, events=publisher_batch(0))
        await sub._accept(0, batch)
        await sub._accept(4, batch)  # 1..3 were dropped: replayed, in order
        assert [u.seq for u in iter(sub.get_nowait, None)] == [0, 1, 2, 3, 4]
        await sub._accept(2, batch)  # the sequence went back: a new publisher
        updates = list(iter(sub.get_nowait, None))
        assert isinstance(updates[0], kvevents.Reset)
        assert [u.seq for u in updates[1:]] == [0, 1, 2]  # caught up from the new start
    finally:
        pub.close()
    # Without a replay endpoint a gap clears the pod's index.
    lone = kvevents.Subscriber("p", "tcp://127.0.0.1:1")
    await lone._accept(0, batch)
    await lone._accept(3, batch)
    updates = list(iter(lone.get_nowait, None))
    assert [type(u).__name__ for u in updates] == ["Batch", "Reset", "Batch"]
    assert lone.resets == 1


async def test_a_consumer_that_falls_behind_gets_a_reset_then_the_latest():
    sub = kvevents.Subscriber("p", "tcp://127.0.0.1:1", queue_size=4)
    batch = kvevents.KVEventBatch(ts=0.0, events=[])
    for seq in range(10):
        await sub._accept(seq, batch)
    updates = list(iter(sub.get_nowait, None))
    assert isinstance(updates[0], kvevents.Reset) and sub.resets >= 1
    assert [u.seq for u in updates[1:]] == list(range(10 - len(updates) + 1, 10))
    assert len(updates) <= 4
