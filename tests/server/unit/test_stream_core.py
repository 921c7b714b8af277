"""The streaming core with a scripted source: coalescing, cap, timeout, stop, cleanup."""

from __future__ import annotations

import asyncio

import pytest
from sluice_server.core.streaming.stream import Stream, StreamFailed
from sluice_server.engine.base import Delta

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Source:
    """Async generator stand-in that records whether it was closed or cancelled."""

    def __init__(self, n: int, gap: float = 0.0) -> None:
        self.n, self.gap = n, gap
        self.closed = False
        self.produced = 0

    async def gen(self):
        try:
            for i in range(self.n):
                if self.gap:
                    await asyncio.sleep(self.gap)
                self.produced += 1
                yield Delta(f"t{i} ", 1, i == self.n - 1, "length" if i == self.n - 1 else None,
                            3, i + 1)  # fmt: skip
        finally:
            self.closed = True


async def test_slow_reader_gets_coalesced_batches():
    src = Source(50)
    s = Stream(src.gen(), cap=1000, timeout=10)
    await asyncio.sleep(0.05)  # the reader lags: everything piles up
    batch = await s.next_batch()
    assert len(batch) == 50 and batch[-1].finished
    assert await s.next_batch() is None
    s.close()


async def test_cap_aborts_and_bounds_memory():
    src = Source(10_000)
    s = Stream(src.gen(), cap=100, timeout=10)
    await asyncio.sleep(0.05)
    with pytest.raises(StreamFailed, match="too slow"):
        await s.next_batch()
    await asyncio.sleep(0)
    assert src.closed and src.produced <= 101  # production stopped at the cap
    s.close()


async def test_timeout_fails_the_stream_and_cancels_the_source():
    src = Source(1000, gap=0.01)
    s = Stream(src.gen(), cap=1000, timeout=0.1)
    got = 0
    with pytest.raises(StreamFailed, match="time limit"):
        while (b := await s.next_batch()) is not None:
            got += len(b)
    await asyncio.sleep(0.01)
    assert 0 < got < 1000 and src.closed
    s.close()


async def test_stop_and_close_cancel_the_producer():
    src = Source(1000, gap=0.01)
    s = Stream(src.gen(), cap=1000, timeout=10)
    await s.next_batch()
    s.stop()
    assert s.stopped and await s.next_batch() is None
    await asyncio.sleep(0.01)
    assert src.closed

    src2 = Source(1000, gap=0.01)
    s2 = Stream(src2.gen(), cap=1000, timeout=10)
    await s2.next_batch()
    s2.close()  # consumer went away
    await asyncio.sleep(0.01)
    assert src2.closed and src2.produced < 1000


async def test_engine_error_becomes_stream_failure():
    async def broken():
        yield Delta("a", 1)
        raise RuntimeError("engine died")

    s = Stream(broken(), cap=10, timeout=10)
    assert [d.text for d in await s.next_batch()] == ["a"]
    with pytest.raises(StreamFailed, match="engine died"):
        await s.next_batch()
    s.close()
