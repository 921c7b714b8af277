"""Unit tests of the simulator engine: timing, abort, stop, max_tokens, bookkeeping.

The timing tests run on a virtual clock (`testkit.clock.virtual_time`): the simulator
schedules every token on the event loop's clock, so there the timing model is exact and
the windows below hold whatever else the machine is doing."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import sys
import time
from types import SimpleNamespace

import pytest
from sluice_server.engine.base import Engine, SamplingOptions, StreamRequest
from sluice_server.engine.simulator import EngineDeadError, SimulatorEngine
from testkit.clock import virtual_time


def req(rid: str = "r1", prompt: str = "hello there", **opts) -> StreamRequest:
    return StreamRequest(request_id=rid, prompt=prompt, options=SamplingOptions(**opts))


def now() -> float:
    """The running loop's clock: the engine's timebase (time.monotonic() on a real loop)."""
    return asyncio.get_running_loop().time()


async def collect(engine: SimulatorEngine, request: StreamRequest):
    """All deltas of a request, each with its arrival time on the loop's clock."""
    out = []
    async for delta in engine.generate(request):
        out.append((now(), delta))
    return out


def test_implements_engine_protocol():
    assert isinstance(SimulatorEngine(), Engine)


async def test_tokens_are_deterministic_and_counted():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=0)
    a = await collect(engine, req(max_tokens=12))
    b = await collect(engine, req(max_tokens=12))
    text_a = "".join(d.text for _, d in a)
    assert text_a == "".join(d.text for _, d in b)
    assert len(text_a.split()) == 12
    last = a[-1][1]
    assert last.finished and last.finish_reason == "length"
    assert last.completion_tokens == 12 == sum(d.num_tokens for _, d in a)
    assert last.prompt_tokens == 2
    assert all(not d.finished for _, d in a[:-1])
    # A different seed starts elsewhere in the word list.
    c = await collect(engine, req(max_tokens=12, seed=7))
    assert "".join(d.text for _, d in c) != text_a


@virtual_time
async def test_ttft_and_itl_within_tolerance():
    engine = SimulatorEngine(ttft_ms=80, itl_ms=25)
    start = now()
    deltas = await collect(engine, req(max_tokens=11))
    ttft = deltas[0][0] - start
    gaps = [b[0] - a[0] for a, b in zip(deltas, deltas[1:], strict=False)]
    assert sum(d.num_tokens for _, d in deltas) == 11
    # One token per delta while the consumer keeps up; a starved CPU may coalesce a few.
    assert len(deltas) >= 8
    assert 0.075 <= ttft <= 0.200, ttft  # upper bounds leave room for a busy shared CPU
    assert 0.015 <= statistics.median(gaps) <= 0.045, gaps
    # Absolute deadlines: the whole stream does not drift.
    total = deltas[-1][0] - start
    assert 0.080 + 10 * 0.025 - 0.005 <= total <= 0.080 + 10 * 0.025 + 0.150, total


@virtual_time
async def test_ttft_grows_with_in_flight_streams():
    engine = SimulatorEngine(ttft_ms=20, itl_ms=10, ttft_per_stream_ms=30)
    background = [
        asyncio.create_task(collect(engine, req(f"bg{i}", max_tokens=50))) for i in range(4)
    ]
    await asyncio.sleep(0)  # let them register
    assert engine.num_unfinished_requests() == 4
    start = now()
    deltas = await collect(engine, req("probe", max_tokens=1))
    ttft = deltas[0][0] - start
    # 20 ms + 4 streams x 30 ms = 140 ms
    assert 0.135 <= ttft <= 0.300, ttft
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    assert engine.num_unfinished_requests() == 0


@virtual_time
async def test_jitter_is_bounded_and_reproducible():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=20, jitter=0.5)
    values = [engine._factor(random.Random(1)) for _ in range(3)]
    assert len(set(values)) == 1  # same seed, same draw
    rng = random.Random(1)
    values = [engine._factor(rng) for _ in range(2000)]
    assert min(values) >= 0.0 and max(values) <= 2.5  # clipped at 1 +- 3 sigma
    assert 0.3 < statistics.pstdev(values) < 0.6
    start = now()
    deltas = await collect(engine, req(max_tokens=20))
    gaps = [b[0] - a[0] for a, b in zip(deltas, deltas[1:], strict=False)]
    assert statistics.pstdev(gaps) > 0.003  # the gaps really vary
    assert now() - start < 1.5


@virtual_time
async def test_abort_ends_stream_at_once():
    engine = SimulatorEngine(ttft_ms=10, itl_ms=1000)
    gen = engine.generate(req(max_tokens=100))
    first = await gen.__anext__()
    assert first.num_tokens == 1
    started = now()
    asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(engine.abort("r1")))
    rest = [d async for d in gen]
    assert now() - started < 0.5  # did not wait for the 1 s token
    assert [d.finish_reason for d in rest] == ["abort"]
    assert rest[0].finished and rest[0].completion_tokens == 1
    assert engine.num_unfinished_requests() == 0


@virtual_time
async def test_abort_before_first_token():
    engine = SimulatorEngine(ttft_ms=5000, itl_ms=10)
    task = asyncio.create_task(collect(engine, req(max_tokens=5)))
    await asyncio.sleep(0.01)
    await engine.abort("r1")
    deltas = await asyncio.wait_for(task, 1)
    assert [d.finish_reason for _, d in deltas] == ["abort"]
    assert engine.num_unfinished_requests() == 0
    await engine.abort("unknown")  # a no-op, not an error


async def test_cancelling_the_consumer_frees_the_request():
    engine = SimulatorEngine(ttft_ms=5, itl_ms=5)
    task = asyncio.create_task(collect(engine, req(max_tokens=10_000)))
    await asyncio.sleep(0.05)
    assert engine.num_unfinished_requests() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished_requests() == 0


async def test_closing_the_iterator_frees_the_request():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=5)
    gen = engine.generate(req(max_tokens=10_000))
    await gen.__anext__()
    assert engine.num_unfinished_requests() == 1
    await gen.aclose()
    assert engine.num_unfinished_requests() == 0


async def test_stop_string_across_tokens_is_cut_and_not_leaked():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=1, words=["ab", "cd", "ef", "gh"])
    deltas = [d for _, d in await collect(engine, req(max_tokens=50, seed=0, stop=["d ef"]))]
    text = "".join(d.text for d in deltas)
    assert text == " ab c"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].finished
    # No delta ever carried part of the stop string.
    assert all("d e" not in d.text for d in deltas)
    assert engine.num_unfinished_requests() == 0


async def test_stop_string_never_matching_keeps_all_text():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=0, words=["ab", "cd"])
    deltas = [d for _, d in await collect(engine, req(max_tokens=6, seed=0, stop=["zz"]))]
    assert "".join(d.text for d in deltas) == " ab cd ab cd ab cd"
    assert deltas[-1].finish_reason == "length"


async def test_eos_and_ignore_eos():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=0, eos_after_tokens=3)
    natural = [d for _, d in await collect(engine, req(max_tokens=10))]
    assert natural[-1].completion_tokens == 3 and natural[-1].finish_reason == "stop"
    forced = [d for _, d in await collect(engine, req(max_tokens=10, ignore_eos=True))]
    assert forced[-1].completion_tokens == 10 and forced[-1].finish_reason == "length"


async def test_max_tokens_capped_by_context_and_long_prompt_rejected():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=0, max_model_len=10)
    deltas = [d for _, d in await collect(engine, req(prompt="one two three", max_tokens=100))]
    assert deltas[-1].completion_tokens == 7
    with pytest.raises(ValueError):
        await collect(engine, req(prompt=" ".join(["w"] * 10)))
    assert engine.num_unfinished_requests() == 0


def test_prepare_checks_the_prompt_before_streaming():
    engine = SimulatorEngine(max_model_len=5)
    request = req(prompt="one two three")
    assert engine.prepare(request) == 3
    assert len(request.prompt_token_ids) == 3
    with pytest.raises(ValueError, match="maximum context length"):
        engine.prepare(req(prompt="a b c d e"))


async def test_chat_messages_count_as_prompt():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=0)
    request = StreamRequest(
        request_id="c", messages=[{"role": "user", "content": "one two three four"}]
    )
    deltas = [d for _, d in await collect(engine, request)]
    assert deltas[-1].prompt_tokens == 4


@virtual_time
async def test_stamped_tokens_carry_their_due_wall_time(monkeypatch):
    # The engine reads the wall clock once per stream to stamp due times: give it one that
    # follows the loop's clock, and read arrivals from the same clock at the stamps'
    # resolution (microseconds: the engine formats them with 6 decimals).
    wall = asyncio.get_running_loop().wall_time
    monkeypatch.setattr(sys.modules[SimulatorEngine.__module__], "time", SimpleNamespace(time=wall))
    engine = SimulatorEngine(ttft_ms=30, itl_ms=20, stamp_tokens=True)
    arrivals = []
    async for delta in engine.generate(req(max_tokens=5)):
        arrivals.append((round(wall(), 6), delta.text))
    for arrived, text in arrivals:
        stamp = float(text.rsplit("@", 1)[1])
        assert 0 <= arrived - stamp < 0.05


async def test_duplicate_request_id_rejected():
    engine = SimulatorEngine(ttft_ms=1000)
    task = asyncio.create_task(collect(engine, req("same")))
    await asyncio.sleep(0.01)
    with pytest.raises(ValueError):
        await collect(engine, req("same"))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@virtual_time
async def test_shutdown_aborts_everything_and_fails_health():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=500)
    await engine.check_health()
    tasks = [asyncio.create_task(collect(engine, req(f"s{i}", max_tokens=100))) for i in range(5)]
    await asyncio.sleep(0.05)
    await engine.shutdown()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert all(r[-1][1].finish_reason == "abort" for r in results)
    assert engine.num_unfinished_requests() == 0
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await collect(engine, req("late"))


async def test_thousands_of_streams_are_cheap():
    engine = SimulatorEngine(ttft_ms=10, itl_ms=20)
    n, tokens = 3000, 10
    # The cost is the CPU time of the loop's thread: unlike wall-clock time, other work on
    # the machine does not inflate it.
    start = time.thread_time()
    results = await asyncio.gather(
        *(collect(engine, req(f"m{i}", max_tokens=tokens)) for i in range(n))
    )
    elapsed = time.thread_time() - start
    assert all(r[-1][1].completion_tokens == tokens for r in results)
    # Ideal wall time is 0.19 s; 30,000 tokens must cost seconds of CPU at most.
    assert elapsed < 6.0, elapsed
    assert engine.num_unfinished_requests() == 0


def test_rejects_negative_settings():
    with pytest.raises(ValueError):
        SimulatorEngine(itl_ms=-1)
    with pytest.raises(ValueError):
        SimulatorEngine(prefill_interference_us_per_token=-1)
    with pytest.raises(ValueError):
        SimulatorEngine(prefill_chunk_tokens=0)


async def _gaps_beside(engine: SimulatorEngine, prompt_words: int, tokens: int = 60):
    """A stream's gaps (s) with a `prompt_words`-word prompt arriving after its 10th token,
    and the prefilling-token count the engine showed while that prompt prefilled."""
    seen: list[int] = []

    async def long_prompt() -> None:
        prefill = asyncio.create_task(
            collect(engine, req("long", " ".join(["w"] * prompt_words), max_tokens=1))
        )
        await asyncio.sleep(0)  # the prompt's request registers (its first step)
        assert engine.num_unfinished_requests() == 2
        seen.append(engine.prefilling_tokens)
        await prefill

    times, extra = [], None
    async for _ in engine.generate(req("stream", max_tokens=tokens)):
        times.append(now())
        if len(times) == 10:
            extra = asyncio.create_task(long_prompt())
    assert extra is not None
    await extra
    return [round(b - a, 6) for a, b in itertools.pairwise(times)], seen


@virtual_time
async def test_decode_gaps_grow_by_the_chunk_being_prefilled():
    """A 3,000-token prompt (300 ms of prefill) arriving mid-stream: the stream's gaps are
    itl + a chunk (1,000 tokens) x 20 us = 30 ms while it prefills, 10 ms before and after."""
    engine = SimulatorEngine(ttft_ms=0, itl_ms=10, prefill_us_per_token=100,
                             prefill_interference_us_per_token=20, prefill_chunk_tokens=1000)  # fmt: skip
    gaps, seen = await _gaps_beside(engine, 3000)
    assert seen == [3000]
    assert engine.prefilling_tokens == 0  # its first token came: the prefill is over
    slow = [g for g in gaps if g == 0.03]
    assert set(gaps) == {0.01, 0.03}, gaps
    assert 8 <= len(slow) <= 11, gaps  # ~300 ms of prefill in 30 ms gaps, priced at start
    assert gaps[:9] == [0.01] * 9 and gaps[-5:] == [0.01] * 5


@virtual_time
async def test_a_prompt_shorter_than_a_chunk_costs_its_own_tokens():
    engine = SimulatorEngine(ttft_ms=50, itl_ms=10, prefill_interference_us_per_token=20,
                             prefill_chunk_tokens=1000)  # fmt: skip
    gaps, seen = await _gaps_beside(engine, 250)
    assert seen == [250] and set(gaps) == {0.01, 0.015}, gaps  # 10 ms + 250 x 20 us


@virtual_time
async def test_no_interference_without_its_cost_or_for_cached_tokens():
    """Negative controls: the cost at 0 leaves every gap at itl; a prompt served from the
    prefix cache prefills only its uncached tail (its last block here)."""
    engine = SimulatorEngine(ttft_ms=0, itl_ms=10, prefill_us_per_token=100,
                             prefill_interference_us_per_token=0)  # fmt: skip
    gaps, _ = await _gaps_beside(engine, 3000)
    assert set(gaps) == {0.01}, gaps
    cached = SimulatorEngine(ttft_ms=0, itl_ms=10, prefill_us_per_token=100,
                             prefill_interference_us_per_token=20, prefix_cache_blocks=1000,
                             block_size=16)  # fmt: skip
    await collect(cached, req("warm", " ".join(["w"] * 3000), max_tokens=1))
    _, seen = await _gaps_beside(cached, 3000)
    assert seen == [3000 - 2992]  # 187 cached blocks of 16, the last token never cached


@virtual_time
async def test_an_aborted_prefill_stops_slowing_the_others():
    engine = SimulatorEngine(ttft_ms=0, itl_ms=10, prefill_us_per_token=100)
    task = asyncio.create_task(collect(engine, req("long", " ".join(["w"] * 3000))))
    await asyncio.sleep(0.01)
    assert engine.prefilling_tokens == 3000
    await engine.abort("long")
    await task
    assert engine.prefilling_tokens == 0 and engine._gap() == engine.itl_s


@virtual_time
async def test_a_decode_pod_prefills_only_what_the_hand_over_did_not_bring():
    """A prompt whose blocks came from a prefill pod (kv_transfer_params) slows the decode
    pod's streams by its uncomputed tail only; without the params it counts whole."""
    engine = SimulatorEngine(ttft_ms=0, itl_ms=10, prefill_us_per_token=100,
                             kv_transfer={"kv_connector": "NixlConnector"})  # fmt: skip
    text = " ".join(["w"] * 3000)
    params = {"do_remote_prefill": True, "remote_block_ids": list(range(187))}
    handed = StreamRequest(request_id="handed", prompt=text, options=SamplingOptions(),
                           kv_transfer_params=params)  # fmt: skip
    for request, expected in ((handed, 3000 - 187 * 16), (req("whole", text), 3000)):
        task = asyncio.create_task(collect(engine, request))
        await asyncio.sleep(0)
        assert engine.prefilling_tokens == expected
        await engine.abort(request.request_id)
        await task
        assert engine.prefilling_tokens == 0
