"""The send timeout, enforced by one watchdog timer per connection instead of a timeout
scope per message.

A client that stops reading fills the socket buffers; then a send waits for the transport
to drain and would wait forever. `asyncio.timeout` / anyio's `move_on_after` around every
send bound that, but cost a timer-heap push and pop and a context object per token event:
about a third of the server's CPU under SSE fan-out (`tests/bench/stack_cost.py cpu`), a
fifth under WebSocket fan-out. Here each send only records when it started; one timer per
connection fires about once per `timeout` while sends complete (at the oldest pending
send's deadline otherwise) and cancels a send pending that long, which then raises the
caller's timeout error from its `await send(...)`, never from anywhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class SendWatchdog:
    def __init__(self, timeout: float | None, expired: Callable[[], BaseException]) -> None:
        self.timeout = timeout
        self._make_error = expired
        self._pending: dict[asyncio.Task[Any], float] = {}  # task -> when its send started
        self._expired: asyncio.Task[Any] | None = None  # the task whose send was cut
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_send = 0.0  # loop time the last send started (idle detection)

    def start(self) -> None:
        """Arm on the running loop (no timer without a timeout)."""
        self._loop = loop = asyncio.get_running_loop()
        self.last_send = loop.time()
        if self.timeout is not None:
            self._timer = loop.call_at(loop.time() + self.timeout, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def send(
        self,
        send: Callable[[Any], Awaitable[None]],
        message: Any,
        task: asyncio.Task[Any] | None = None,
    ) -> None:
        """`await send(message)`; raises `expired()` if it was pending for `timeout` s.
        `task`: the calling task when the caller knows it (saves a lookup per send)."""
        loop = self._loop
        if self._timer is None:  # no timeout, or not started
            self.last_send = loop.time() if loop is not None else 0.0
            await send(message)
            return
        assert loop is not None  # a timer is armed only on a started loop
        if task is None:
            task = asyncio.current_task()
            assert task is not None  # sends are made from tasks
        pending = self._pending
        pending[task] = self.last_send = loop.time()
        try:
            await send(message)
        except asyncio.CancelledError:
            if task is not self._expired:
                raise
            self._expired = None
            if task.uncancel() > 0:  # also cancelled by someone else: let that win
                raise
            raise self._make_error() from None
        finally:
            del pending[task]

    def _check(self) -> None:
        """Cancel a send pending for `timeout`; re-arm for the next deadline."""
        loop, timeout = self._loop, self.timeout
        assert loop is not None and timeout is not None  # armed by start() only with both
        now = loop.time()
        next_at = now + timeout
        for task, since in self._pending.items():
            if task is self._expired:
                continue  # already cancelled, unwinding
            deadline = since + timeout
            if deadline <= now + 1e-3:
                if self._expired is None:
                    self._expired = task
                    task.cancel()  # raises in its `await send(...)`, never elsewhere
            elif deadline < next_at:
                next_at = deadline
        self._timer = loop.call_at(next_at, self._check)
