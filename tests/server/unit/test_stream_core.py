"""The streaming core with a scripted source: coalescing, cap, timeout, stop, cleanup."""

from __future__ import annotations

import asyncio

import pytest
from sluice_server.core.stream import Stream, StreamFailed
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


class Paced:
    """A source on a queue the test feeds (as an engine's output collector is fed): records
    the task each of its steps ran in, and whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.tasks: set[asyncio.Task | None] = set()
        self.closed = False

    def put(self, n: int = 1, finished: bool = False) -> None:
        for _ in range(n):
            self.queue.put_nowait(Delta("t ", 1, finished, "length" if finished else None))

    async def gen(self):
        try:
            while True:
                self.tasks.add(asyncio.current_task())
                delta = await self.queue.get()
                self.tasks.add(asyncio.current_task())
                yield delta
                if delta.finished:
                    return
        finally:
            self.closed = True


async def test_the_consumer_drains_the_engine_in_its_own_task():
    src = Paced()
    before = len(asyncio.all_tasks())
    s = Stream(src.gen(), cap=100, timeout=10)
    assert len(asyncio.all_tasks()) == before  # no producer task

    async def consume():
        got = []
        while (batch := await s.next_batch()) is not None:
            got.append(len(batch))
        return got

    reader = asyncio.create_task(consume())
    for _ in range(5):
        await asyncio.sleep(0.001)
        src.put()
    await asyncio.sleep(0.001)
    src.put(3)  # what piled up before the next read goes out as one batch
    src.put(1, finished=True)
    assert await reader == [1, 1, 1, 1, 1, 4]
    assert src.tasks == {reader}  # every step of the engine stream ran in the consumer's task
    s.close()


async def test_stop_interrupts_a_consumer_waiting_on_the_engine():
    src = Paced()
    s = Stream(src.gen(), cap=100, timeout=10)
    src.put()
    assert len(await s.next_batch()) == 1
    reader = asyncio.create_task(s.next_batch())
    await asyncio.sleep(0.01)  # the reader waits on the engine's own future
    s.stop()
    assert await reader is None and s.stopped
    assert reader.cancelling() == 0  # the interruption was taken back
    await asyncio.sleep(0)
    assert src.closed


async def test_fail_interrupts_a_waiting_consumer_and_a_cancel_still_wins():
    src = Paced()
    s = Stream(src.gen(), cap=100, timeout=10)
    reader = asyncio.create_task(s.next_batch())
    await asyncio.sleep(0.01)
    s.fail("drain timeout")
    with pytest.raises(StreamFailed, match="drain timeout"):
        await reader
    await asyncio.sleep(0)
    assert src.closed

    src2 = Paced()
    s2 = Stream(src2.gen(), cap=100, timeout=10)
    reader2 = asyncio.create_task(s2.next_batch())
    await asyncio.sleep(0.01)
    reader2.cancel()  # the client left ...
    s2.fail("drain timeout")  # ... and a failure interrupts the same wait
    with pytest.raises(asyncio.CancelledError):
        await reader2
    s2.close()
    await asyncio.sleep(0)
    assert src2.closed


async def test_a_cancelled_consumer_aborts_the_engine_stream_at_once():
    src = Paced()
    s = Stream(src.gen(), cap=100, timeout=10)
    reader = asyncio.create_task(s.next_batch())
    await asyncio.sleep(0.01)
    reader.cancel()  # the client left: the cancellation goes through the engine stream
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert src.closed
    s.close()


async def test_a_detached_stream_keeps_draining_into_its_buffer_and_hands_back():
    src = Paced()
    s = Stream(src.gen(), cap=5, timeout=10, replayable=True)
    src.put()
    assert len(await s.next_batch()) == 1
    reader = asyncio.create_task(s.next_batch())
    await asyncio.sleep(0.01)
    reader.cancel()  # the client dropped: the engine's step must survive it
    with pytest.raises(asyncio.CancelledError):
        await reader
    s.detach()
    src.put(3)
    await asyncio.sleep(0.01)
    assert src.queue.empty() and not src.closed  # drained into the stream's buffer
    s.attach()
    assert len(await s.next_batch()) == 3  # the buffer
    src.put()
    assert len(await s.next_batch()) == 1
    src.put(1, finished=True)
    assert (await s.next_batch())[-1].finished and await s.next_batch() is None
    s.close()


async def test_the_cap_holds_while_detached():
    src = Paced()
    s = Stream(src.gen(), cap=5, timeout=10, replayable=True)
    src.put()
    assert len(await s.next_batch()) == 1
    s.detach()
    src.put(10)
    await asyncio.sleep(0.01)
    with pytest.raises(StreamFailed, match="too slow"):
        await s.next_batch()
    await asyncio.sleep(0)
    assert src.closed
    s.close()


async def test_the_cap_holds_while_the_consumer_is_away_writing():
    """A consumer that does not come back for the engine's output (its write waits on a
    reader that fell behind): a task drains meanwhile and the cap aborts the request before
    the consumer returns; one that comes back catches up without a task."""
    src = Paced()
    s = Stream(src.gen(), cap=5, timeout=10)
    src.put()
    assert len(await s.next_batch()) == 1
    src.put(10)  # ... while the consumer is still "writing"
    await asyncio.sleep(0.01)
    assert src.closed and src.queue.qsize() == 4  # drained to the cap, then aborted
    with pytest.raises(StreamFailed, match="too slow"):
        await s.next_batch()
    s.close()

    src2 = Paced()
    s2 = Stream(src2.gen(), cap=5, timeout=10)
    src2.put()
    assert len(await s2.next_batch()) == 1
    src2.put(3)
    await asyncio.sleep(0.01)  # away, but within the cap: buffered for it
    assert len(await s2.next_batch()) == 3
    reader = asyncio.create_task(s2.next_batch())
    await asyncio.sleep(0.01)
    src2.put(1, finished=True)
    assert len(await reader) == 1 and await s2.next_batch() is None
    s2.close()
