"""The per-stream core between the engine and the socket writer.

`Stream` hands the consumer (the socket writer, through `events.events`) everything the
engine produced since its last read at once, so a slow reader gets fewer, larger events
instead of an ever-growing backlog (coalescing). Past the cap on undelivered outputs, the
whole-stream deadline, a drain timeout or an engine error the stream *fails*: the engine
request is aborted and the consumer ends with an error event. Cancelling the consumer (the
client left) aborts the engine request too (below).

Who drains the engine. While a consumer is attached, the consumer itself: `next_batch`
awaits the engine's output stream (an async iterator) in the consumer's own task, so a
token costs no task switch, no wake-up of a second task and no buffer hand-over (a producer
task that fed a buffer cost one of each per engine output). After each output it takes,
without waiting, whatever else the engine has ready (`_harvest` steps the iterator by hand
and keeps the first step that would wait, with the future it waits on, for the next read,
which hands that future to its task as a task does with a future it is given). While the
consumer writes, nothing steps the iterator: the engine's outputs wait at the source,
where both engines merge them (vLLM's output collector merges the deltas of a consumer that
falls behind, and so does the simulator), and the next read takes them as one batch. That
is the coalescing: when the transport backs up, the consumer's send waits
(transport/sendwatch.py: a reader is cut only when no bytes move) and the outputs merge
meanwhile. The cap on undelivered outputs counts what one read takes, whoever drains.
Cancelling the consumer while it waits cancels the engine stream where it waits, which
aborts the request at once; `fail` and `stop` do the same by cancelling the consumer's task
once, which `next_batch` takes back (`uncancel`, as `asyncio.timeout` does) while any other
cancellation (the client left) wins.

A task drains instead only while no consumer can: while the stream waits for admission
(below), and while a resumable stream is *detached* (its client dropped, `detach`): the
engine keeps generating into the buffer, and a consumer that attaches again (`attach`)
reads the buffer; the task hands the engine back to it at the next output. A resumable
stream's consumer waits for the engine through a future of its own (the engine's future
resolves it), so the client leaving, which cancels the consumer, leaves the engine's step
intact for the task to go on with.

The protocols read a Stream through `events.events`, the one loop that turns it into
typed events and records the edge metrics. A *replayable* stream also keeps the text of
every event it handed to a writer (the delivered answer, so at most `max_tokens` worth),
so that a second consumer can take over after the first one went away (resumable token
SSE, lifecycle.py); the cap on undelivered outputs is the same.

A stream may start *waiting*: with `admission` (a queued request's ticket, core/admission.py)
a task first waits for it and only then is the engine request started (`source` is not
touched before), while the one keep-alive writer (core/keepalive.py) wakes the consumer every
`keepalive` seconds with `KEEPALIVE` instead of a batch, which the events loop hands the
protocol as a `Waiting` event. A refusal while waiting ends the stream like a failure, with
the refusal's status and code; the client leaving, a stop or a drain end the wait (the ticket
leaves the queue when the stream's cleanup releases it).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import types
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ..engine.base import Delta
from .keepalive import KeepAlive

log = logging.getLogger(__name__)
T = TypeVar("T")
KEEPALIVE: list[Any] = []  # next_batch's answer when a keep-alive is due (compared by identity)
_closing: set[asyncio.Task[None]] = set()  # engine streams being closed (strong references)


class Admitting(Protocol):
    """What a waiting stream reads from its admission ticket (core/admission.py)."""

    @property
    def waited(self) -> float:
        """Seconds waited so far."""

    async def wait(self) -> None:
        """Until admitted; raises the refusal."""


@types.coroutine
def _until(fut: Any) -> Generator[Any, None, None]:
    """Wait in the calling task for `fut`, the future a hand-stepped engine step is waiting
    on (None: a bare yield, one pass of the loop), as that step's own `await` would have."""
    if fut is None or not fut.done():
        yield fut


@types.coroutine
def _unwound(step: Any) -> Generator[Any, None, None]:
    """Cancel `step` (an engine step waiting on a future, stepped by hand) as a task's
    cancellation would, and drive its cleanup to the end in the calling task."""
    exc: BaseException | None = asyncio.CancelledError()
    while True:
        try:
            fut = step.send(None) if exc is None else step.throw(exc)
        except (StopIteration, StopAsyncIteration, asyncio.CancelledError):
            return
        exc = None
        try:
            yield fut
        except BaseException as e:  # noqa: BLE001 - handed to the step, as `await` would
            exc = e


class Stream(Generic[T]):
    __slots__ = ("_source", "_next", "_cap", "_items", "_waiter", "_task", "_timer", "_done",
                 "_loop", "_step", "_on", "_reader", "_interrupted", "_ended", "_detached",
                 "_own_wait", "_lag", "_ctx", "error", "first_output_at", "stopped",
                 "n_events", "sent", "ended", "error_code", "error_status", "admission",
                 "_beat_due", "_unbeat")  # fmt: skip

    def __init__(
        self,
        source: AsyncIterator[T],
        *,
        cap: int,
        timeout: float,
        replayable: bool = False,
        admission: Admitting | None = None,
        keepalive: float = 0.0,
    ) -> None:
        self._source = source
        self._next = source.__anext__
        self._cap = cap
        self._items: list[T] = []
        # The consumer's wake-up while it waits on the stream rather than on the engine: a
        # bare future while it waits, else None. (An asyncio.Event costs a loop lookup and
        # a waiter deque per wait and per set: tests/bench/stack_cost.py.)
        self._waiter: asyncio.Future[None] | None = None
        # The engine's step that would wait (an `__anext__()` awaitable stepped by hand) and
        # the future it waits on; the consumer's task while it waits there itself.
        self._step: Any = None
        self._on: Any = None
        self._reader: asyncio.Task[Any] | None = None
        self._interrupted = False  # fail/stop cancelled the reader (taken back after)
        self._ended = False  # the engine stream is over, or being closed: nothing to abort
        self._detached = False  # no consumer: the task drains (resumable streams)
        self._own_wait = replayable  # the consumer waits on its own future (see above)
        # `_backlog`, bound once, and the consumer's context it runs in (set at the first
        # output): a done-callback on each kept future costs no allocation or context copy.
        self._lag: Any = None
        self._ctx: contextvars.Context | None = None
        self._task: asyncio.Task[None] | None = None  # drains while no consumer can
        self._done = False
        self.error: str | None = None
        self.error_code, self.error_status = "stream_error", 500
        self.first_output_at: float | None = None
        self.stopped = False
        # What the event loop (events.py) handed to writers: how many token events, and with
        # `replayable` their texts and the terminal event, so a client that reconnects gets
        # exactly the events after the last one it saw (resumable streams).
        self.n_events = 0
        self.sent: list[str] | None = [] if replayable else None
        self.ended: object | None = None
        self._loop = loop = asyncio.get_running_loop()
        # Waiting for admission: the first keep-alive at once (the client learns why it
        # waits), then one per beat of the keep-alive writer.
        self.admission = admission
        self._beat_due = admission is not None
        self._unbeat = (KeepAlive.on(loop, keepalive).add(self._beat)
                        if admission is not None and keepalive > 0 else None)  # fmt: skip
        self._timer = loop.call_later(
            timeout, self.fail, f"Stream exceeded the server's time limit ({timeout:g} s)."
        )
        if admission is not None:
            self._task = loop.create_task(self._produce(admit=True))

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

    def _harvest(self, step: Any) -> None:
        """Step the engine stream as far as it goes without waiting, into the buffer:
        `step` first (a kept step whose future is done; None: a new one), then new steps,
        until one would wait (kept, with its future, for the next read), the stream ends or
        fails, or the buffer passes the cap. Runs in the task that drains."""
        items, nxt = self._items, self._next
        if step is None:
            step = nxt()
        while True:
            try:
                fut = step.send(None)
            except StopIteration as out:
                if self.first_output_at is None:
                    self.first_output_at = time.perf_counter()
                items.append(out.value)
                if len(items) > self._cap:
                    # The reader has stalled: drop the backlog so memory stays bounded.
                    items.clear()
                    self.error = (
                        f"Client too slow: more than {self._cap} undelivered events; "
                        "request aborted."
                    )
                    self._halt()
                    return
                step = nxt()
            except StopAsyncIteration:
                self._ended = self._done = True
                return
            except asyncio.CancelledError:  # the engine stream cancelled itself: it ended
                self._ended = self._done = True
                return
            except Exception as e:
                self._ended = True
                self._engine_failed(e)
                return
            else:
                self._step, self._on = step, fut
                if fut is not None and self._task is None:  # in case the consumer lags
                    if self._lag is None:
                        self._lag, self._ctx = self._backlog, contextvars.copy_context()
                    fut.add_done_callback(self._lag, context=self._ctx)
                return

    def _engine_failed(self, e: Exception) -> None:
        """An engine error after the 200: it becomes an error event."""
        log.warning("engine stream failed: %s: %s", type(e).__name__, e)
        if self.error is None:
            self.error = (
                f"Engine error: {type(e).__name__}: {e}"
                if str(e)
                else (f"Engine error: {type(e).__name__}")
            )
            self.error_status = getattr(e, "status", 500)  # the engine's refusal (4xx)
        self._done = True

    async def _produce(self, admit: bool = False) -> None:
        """The stream's task while the consumer cannot drain: with `admit` the admission
        wait (the consumer hears the keep-alives meanwhile); then the engine into the
        buffer, bounded by the cap, while the consumer is away (writing to a reader that fell
        behind, or detached), until it waits for output again."""
        try:
            if admit and self.admission is not None:
                try:
                    await self.admission.wait()
                except Exception as e:  # refused while waiting: its status and code
                    self.error = getattr(e, "message", None) or str(e)
                    self.error_code = getattr(e, "code", None) or "stream_error"
                    self.error_status = getattr(e, "status", 500)
                    self._halt()
                    return
                finally:
                    self._end_wait()
                if not self._detached:
                    return  # the consumer starts the engine request, in its own task
                self._harvest(None)
                self._wake()
            while not self._done:
                step, fut = self._step, self._on
                if step is None:
                    return
                if fut is None or not fut.done():
                    await _until(fut)
                waiter = self._waiter
                if not self._detached and waiter is not None and not waiter.done():
                    return  # the consumer waits for output: it takes the step
                self._step = self._on = None
                self._harvest(step)
                self._wake()
        finally:
            if self._task is asyncio.current_task():
                self._task = None
            self._wake()

    def _backlog(self, fut: object) -> None:
        """The engine's output is ready and the consumer did not come back for it (it is
        still writing: the reader fell behind): a task drains meanwhile, so the cap on
        undelivered outputs holds (`_produce`). A consumer that came back first has taken
        the step (and a new future is kept): nothing to do."""
        if fut is self._on and self._task is None and not self._done:
            self._task = self._loop.create_task(self._produce())

    def detach(self) -> None:
        """The consumer went away but the stream may be resumed: a task drains the engine
        into the buffer (bounded by the cap) until a consumer attaches again."""
        self._detached = True
        if self._task is None and not self._done:
            self._task = self._loop.create_task(self._produce())

    def attach(self) -> None:
        """A consumer reads again: the draining task hands it the engine at the first
        output it waits for (the buffer meanwhile is read as before)."""
        self._detached = False

    def _wake(self, _: object = None) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _halt(self) -> None:
        """The stream is over: end the draining task, abort the engine request, and
        interrupt or wake the consumer."""
        self._done = True
        self._lag = None
        task = self._task
        if task is not None:
            self._task = None
            if task is not asyncio.current_task():
                task.cancel()
        reader = self._reader
        if reader is None:
            self._close_source()
        elif not self._interrupted:
            # The reader is inside the engine stream: cancel it there (which aborts the
            # request, as a client that left does); `_read` takes the cancellation back.
            self._interrupted = True
            reader.cancel()
        self._wake()

    def _close_source(self) -> None:
        """Abort an unfinished engine request: cancel the kept step (as cancelling a task
        that awaited it would) and close the engine stream, in a task of its own (both may
        wait). Closing an unfinished engine generator aborts its request."""
        if self._ended:
            return
        self._ended = True
        step, fut = self._step, self._on
        self._step = self._on = None
        task = self._loop.create_task(self._close(step, fut))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def _close(self, step: Any, fut: Any) -> None:
        try:
            if step is not None:
                if fut is not None:
                    fut.cancel()
                await _unwound(step)
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:  # pragma: no cover - cleanup must not mask the cause
            log.exception("closing the engine stream failed")

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
        self._halt()

    def stop(self) -> None:
        """The client asked to stop: abort now, drop what is buffered, end without error."""
        if self._done:
            return
        self._end_wait()
        self.stopped = True
        self._items.clear()
        self._halt()

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
            if self._task is None and not self._own_wait:
                # The consumer steps the engine stream in its own task: the kept step (its
                # future handed to this task, as a task does with a future it is given) or
                # a new one, then whatever else is ready. Cancelling the consumer here
                # cancels the engine stream where it waits, which aborts the request
                # (fail/stop do it too: `_halt`).
                step, fut = self._step, self._on
                if step is None:
                    step = self._next()
                elif fut is not None:
                    fut.remove_done_callback(self._lag)  # back for it: no lag
                    fut._asyncio_future_blocking = False
                self._step = self._on = None
                self._reader = task = asyncio.current_task()
                assert task is not None  # a consumer runs in a task
                cancelling = task.cancelling()
                try:
                    item = await step
                except StopAsyncIteration:
                    self._ended = self._done = True
                except asyncio.CancelledError:
                    self._ended = True  # it went through the engine stream, which ended
                    if not self._interrupted or task.uncancel() > cancelling:
                        raise  # cancelled by someone else (the client left): that wins
                except Exception as e:
                    self._ended = True
                    self._engine_failed(e)
                else:
                    if self._interrupted:  # the engine stream went on regardless: drop it
                        if task.uncancel() > cancelling:
                            raise asyncio.CancelledError from None
                    else:
                        if self.first_output_at is None:
                            self.first_output_at = time.perf_counter()
                        self._items.append(item)
                        self._reader = None
                        self._harvest(None)
                finally:
                    self._reader = None
                    self._interrupted = False
                if self._done:
                    self._close_source()  # after fail/stop (nothing is closed while inside)
                continue
            if self._task is None:  # a resumable stream's consumer drains it itself
                step, fut = self._step, self._on
                if step is not None and fut is not None and not fut.done():
                    fut.remove_done_callback(self._lag)  # back for it: no lag
                    fut.add_done_callback(self._wake)  # wakes this consumer's own future
                else:
                    if step is not None and fut is None:
                        await _until(None)  # the engine stream asked for one pass of the loop
                    self._step = self._on = None
                    self._harvest(step)
                    continue
            # `_wake` resolves and clears it; a cancelled wait leaves a done future behind,
            # which `_wake` skips and the next wait replaces.
            self._waiter = self._loop.create_future()
            await self._waiter

    def close(self) -> None:
        """Consumer finished or went away: stop draining (aborts an unfinished request)."""
        self._done = True
        self._lag = None  # (a bound method: a reference cycle while the stream runs)
        self._timer.cancel()
        self._end_wait()
        task = self._task
        if task is not None:
            self._task = None
            task.cancel()
        self._close_source()


class StreamFailed(Exception):
    def __init__(self, message: str, code: str = "stream_error", status: int = 500) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def join_batch(batch: Sequence[Delta]) -> tuple[str, int]:
    """Text and token count of the deltas a slow reader let pile up (one event for all)."""
    if len(batch) == 1:
        return batch[0].text, batch[0].num_tokens
    return "".join([d.text for d in batch]), sum([d.num_tokens for d in batch])
