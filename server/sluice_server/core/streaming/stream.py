"""The per-stream buffer between the engine and the socket writer.

`Stream` moves engine output into a bounded per-stream buffer on a producer task; the
consumer (the socket writer) takes everything buffered at once, so a slow reader gets
fewer, larger events instead of an ever-growing backlog (coalescing). Past the buffer cap,
the whole-stream deadline, a drain timeout or an engine error the stream *fails*: the
producer is cancelled (which aborts the engine request) and the consumer ends with an
error event, or, for an engine failure on a stream the router relays, as handed over
(`engine_failure_code`). Cancelling the consumer (client gone) cancels the producer the same way.

The protocols read a Stream through `events.events`, the one loop that turns it into
typed events and records the edge metrics. A *replayable* stream also keeps the text of
every event it handed to a writer (the delivered answer, so at most `max_tokens` worth),
so that a second consumer can take over after the first one went away (resumable token
SSE, lifecycle.py); the cap on undelivered outputs is the same.

A stream may start *waiting*: with `admission` (a queued request's ticket, core/limits/queue.py)
the producer first waits for it and only then starts the engine request (`source` is not
touched before), while the one keep-alive writer (core/streaming/keepalive.py) wakes the consumer every
`keepalive` seconds with `KEEPALIVE` instead of a batch, which the events loop hands the
protocol as a `Waiting` event. A refusal while waiting ends the stream like a failure, with
the refusal's status and code; the client leaving, a stop or a drain end the wait (the ticket
leaves the queue when the stream's cleanup releases it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ...engine.base import Delta
from .keepalive import KeepAlive

log = logging.getLogger(__name__)
T = TypeVar("T")
KEEPALIVE: list[Any] = []  # next_batch's answer when a keep-alive is due (compared by identity)


class Admitting(Protocol):
    """What a waiting stream reads from its admission ticket (core/limits/queue.py)."""

    @property
    def waited(self) -> float:
        """Seconds waited so far."""

    async def wait(self) -> None:
        """Until admitted; raises the refusal."""


class Stream(Generic[T]):
    __slots__ = ("_source", "_cap", "_items", "_waiter", "_task", "_timer", "_done", "_loop",
                 "error", "first_output_at", "stopped", "n_events", "sent", "ended",
                 "error_code", "error_status", "admission", "_beat_due", "_unbeat",
                 "marked", "first", "sent_ids")  # fmt: skip

    def __init__(
        self,
        source: AsyncIterator[T],
        *,
        cap: int,
        timeout: float,
        replayable: bool = False,
        admission: Admitting | None = None,
        keepalive: float = 0.0,
        marked: bool = False,
        first_event: int = 0,
    ) -> None:
        self._source = source
        self._cap = cap
        self._items: list[T] = []
        # The consumer's wake-up: a bare future while it waits, else None. (An
        # asyncio.Event costs a loop lookup and a waiter deque per wait and per set: about a
        # tenth of the server's CPU per token event, testing/sluice_bench/stack_cost.py.)
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self.error: str | None = None
        self.error_code, self.error_status = "stream_error", 500
        self.first_output_at: float | None = None
        self.stopped = False
        # What the event loop (events.py) handed to writers: how many token events, and with
        # `replayable` their texts and the terminal event, so a client that reconnects gets
        # exactly the events after the last one it saw (resumable streams).
        self.n_events = self.first = first_event
        self.sent: list[str] | None = [] if replayable else None
        # `marked`: a stream the router relays; its token events carry their token ids
        # (continuation.py), kept with the texts when replayable. `first_event`: the index
        # of its first event (a continuation goes on from another replica's).
        self.marked = marked
        self.sent_ids: list[list[int] | None] | None = [] if replayable and marked else None
        self.ended: object | None = None
        self._loop = loop = asyncio.get_running_loop()
        # Waiting for admission: the first keep-alive at once (the client learns why it
        # waits), then one per beat of the keep-alive writer.
        self.admission = admission
        self._beat_due = admission is not None
        self._unbeat = (
            KeepAlive.on(loop, keepalive).add(self._beat)
            if admission is not None and keepalive > 0
            else None
        )
        self._task = loop.create_task(self._produce())
        self._timer = loop.call_later(
            timeout, self.fail, f"Stream exceeded the server's time limit ({timeout:g} s)."
        )

    def _beat(self) -> None:
        self._beat_due = True
        if self._waiter is not None:
            self._wake()

    def _end_wait(self) -> None:
        self._beat_due = False
        if self._unbeat is not None:
            self._unbeat()
            self._unbeat = None

    @property
    def waited(self) -> float:
        """Seconds this stream has waited for admission."""
        return self.admission.waited if self.admission is not None else 0.0

    async def _produce(self) -> None:
        source = self._source
        try:
            if self.admission is not None:
                try:
                    await self.admission.wait()
                except Exception as e:  # refused while waiting: its status and code
                    self.error = getattr(e, "message", None) or str(e)
                    self.error_code = getattr(e, "code", None) or "stream_error"
                    self.error_status = getattr(e, "status", 500)
                    return
                finally:
                    self._end_wait()
            async for item in source:
                if self.first_output_at is None:
                    self.first_output_at = time.perf_counter()
                items = self._items
                items.append(item)
                if len(items) > self._cap:
                    # The reader has stalled: drop the backlog so memory stays bounded.
                    items.clear()
                    self.error = (
                        f"Client too slow: more than {self._cap} undelivered events; "
                        "request aborted."
                    )
                    return
                if self._waiter is not None:
                    self._wake()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine error after the 200: an error event, or handed over
            log.warning("engine stream failed: %s: %s", type(e).__name__, e)
            if self.error is None:
                self.error = (
                    f"Engine error: {type(e).__name__}: {e}"
                    if str(e)
                    else (f"Engine error: {type(e).__name__}")
                )
                self.error_status = getattr(e, "status", 500)  # the engine's refusal (4xx)
                self.error_code = engine_failure_code(self.marked, self.error_status)
        finally:
            self._done = True
            self._wake()
            # Closing an unfinished engine generator aborts its request (no-op if done).
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # pragma: no cover - cleanup must not mask the cause
                    log.exception("closing the engine stream failed")

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def aborted(self) -> bool:
        """True when the engine request was cut short (by us or by an error)."""
        return self.error is not None

    def fail(self, message: str) -> None:
        """Abort the engine request; the consumer ends with an error event."""
        if self._done and self.error is None and not self._items:
            return
        if self.error is None:
            self.error = message
        self._end_wait()
        self._task.cancel()
        self._done = True
        self._wake()

    def hand_over(self) -> None:
        """The pod drains: end the stream as handed to the router, which continues it on
        another replica (the protocols end its connection without a final event)."""
        if self._done:
            return
        self.error_code = HANDED_OVER
        self.fail("This replica is shutting down: the stream goes on on another replica.")

    def stop(self) -> None:
        """The client asked to stop: abort now, drop what is buffered, end without error."""
        if self._done:
            return
        self._end_wait()
        self.stopped = True
        self._task.cancel()
        self._items.clear()
        self._done = True
        self._wake()

    async def next_batch(self) -> list[T] | None:
        """Everything produced since the last call; None at the end. Raises StreamFailed
        after delivering what was buffered before a failure."""
        while True:
            items = self._items
            if items:
                self._items = []
                return items
            if self.error is not None:
                raise StreamFailed(self.error, self.error_code, self.error_status)
            if self._done:
                return None
            if self._beat_due:
                self._beat_due = False
                return KEEPALIVE
            # `_wake` resolves and clears it; a cancelled wait leaves a done future behind,
            # which `_wake` skips and the next wait replaces.
            self._waiter = self._loop.create_future()
            await self._waiter

    def close(self) -> None:
        """Consumer finished or went away: stop producing (aborts an unfinished request)."""
        self._timer.cancel()
        self._end_wait()
        if not self._task.done():
            self._task.cancel()


# The failure code of a stream handed to the router (`Stream.hand_over`).
HANDED_OVER = "handed_over"


def engine_failure_code(marked: bool, status: int = 500, code: str = "stream_error") -> str:
    """The failure code of an engine failure after the 200: the engine raised (status 5xx,
    not its refusal of the request), aborted the request itself or ended it unfinished. A
    stream the router relays and can continue elsewhere (`marked`) is handed over, as in a
    drain: the router continues it on another replica, at most its model's maxMigrations
    times; any other stream ends with the protocol's error event (`code`)."""
    return HANDED_OVER if marked and status >= 500 else code


class StreamFailed(Exception):
    def __init__(self, message: str, code: str = "stream_error", status: int = 500) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def join_batch(batch: Sequence[Delta]) -> tuple[str, int]:
    """Text and token count of the deltas a slow reader let pile up (one event for all)."""
    if len(batch) == 1:
        return batch[0].text, batch[0].num_tokens
    return "".join([d.text for d in batch]), sum([d.num_tokens for d in batch])
