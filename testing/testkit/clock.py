"""Virtual time for asyncio code whose behaviour is defined by its timers.

`VirtualTimeLoop` is an event loop whose clock (`loop.time()`) stands still while callbacks
run and jumps straight to the next timer when nothing is ready, instead of sleeping. Code
that schedules on the loop's clock (`call_later`, `asyncio.sleep`, `asyncio.timeout`) then
sees exactly the delays it asked for, whatever else the machine is doing, and a test of
"the first token comes after 80 ms" can assert the timing model itself rather than a
wall-clock window widened for busy machines. It runs in no time at all, too.

Real I/O still works (the loop polls its selector without waiting whenever a timer is
pending, and waits for real only when nothing is scheduled), but sockets served by other
threads or processes do not follow the virtual clock: use it for code that lives on the
loop, such as the simulator engine.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that, instead of blocking for `timeout`, moves the loop's clock by it."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing scheduled: only I/O can wake the loop
            return super().select(None)
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that starts at 0 (see the module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        # The wall-clock time that virtual time 0 stands for (`wall_time`).
        self.wall_epoch = time.time()
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def wall_time(self) -> float:
        """`time.time()` as it would read if the wall clock followed this loop's clock;
        patch it in where code under test reads the wall clock."""
        return self.wall_epoch + self._now


def run_in_virtual_time(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh `VirtualTimeLoop` (leaves the current event
    loop, such as pytest-asyncio's, alone)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


def virtual_time(test: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    """Decorator for an `async def` test: run it on a `VirtualTimeLoop` of its own instead
    of pytest-asyncio's loop (fixtures are passed through unchanged)."""
    if not inspect.iscoroutinefunction(test):
        raise TypeError(f"{test.__name__} is not an async def function")

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return run_in_virtual_time(test(*args, **kwargs))

    return run
