"""Waiting for something the system under test does in its own time: `eventually()`.

A test that waits for a log line, a status condition, a port that listens or a counter
that settles polls for it with one deadline, and fails saying what it waited for and the
last thing it saw, instead of sleeping for a guess of how long that takes. This module is
the one place such a loop is written. (A sleep that only lets time pass, to show that
something does *not* happen, is not a wait.)

`eventually(fn, timeout=..., ...)` calls `fn` until it returns something truthy and
returns that value. An exception listed in `retry_on` (by default `AssertionError`, so `fn`
may assert) counts as "not yet"; any other exception propagates at once, which is how a
caller fails fast (a process that exited, a bug in `fn`). `fn` is called at least once and
once more at the deadline, so the last word is never a stale one. After `timeout` seconds
it raises `AssertionError` with `message`, the number of tries and the last value or
exception (chained as the cause). `message` says what was awaited; a message of several
lines (say, with a log tail) has its first line before that verdict and the rest after.

`eventually_async` is the same on the running event loop: `fn` may return an awaitable, and
the deadline is on the loop's clock (so it also works on `testkit.clock`'s virtual time).
An attempt is never interrupted: bound the I/O inside `fn` with its own timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

Retry = tuple[type[BaseException], ...]
Message = str | Callable[[], str]


class _Tries:
    """The bookkeeping both variants share: tries, the last value or exception, the error."""

    def __init__(self, fn: Callable[..., Any], timeout: float, message: Message) -> None:
        self.fn, self.timeout, self.message = fn, timeout, message
        self.count = 0
        self.last: object = None
        self.error: BaseException | None = None

    def failed(self) -> AssertionError:
        message = self.message() if callable(self.message) else self.message
        what, _, more = (message or getattr(self.fn, "__qualname__", repr(self.fn))).partition("\n")
        if self.error is not None:
            last = f"{type(self.error).__name__}: {self.error}"
        else:
            last = repr(self.last)
        tries = f"{self.count} tr{'y' if self.count == 1 else 'ies'}"
        more = f"\n{more}" if more else ""
        return AssertionError(
            f"{what}: not within {self.timeout:g} s ({tries}); last: {last}{more}"
        )


def eventually(
    fn: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.05,
    message: Message = "",
    retry_on: Retry = (AssertionError,),
) -> T:
    """Call `fn` until it returns something truthy; return that (see the module docstring).
    `message` (a string, or a callable for one built from what `fn` saw) says what was
    awaited."""
    tries = _Tries(fn, timeout, message)
    deadline = time.monotonic() + timeout
    while True:
        tries.count += 1
        try:
            value = fn()
        except retry_on as e:
            tries.error = e
        else:
            if value:
                return value
            tries.last, tries.error = value, None
        left = deadline - time.monotonic()
        if left <= 0:
            raise tries.failed() from tries.error
        time.sleep(min(interval, left))


async def eventually_async(
    fn: Callable[[], T | Awaitable[T]],
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline for the polls; an attempt is never cut
    interval: float = 0.05,
    message: Message = "",
    retry_on: Retry = (AssertionError,),
) -> T:
    """`eventually` for async code: `fn` may be a coroutine function (or return an
    awaitable); the deadline is on the running loop's clock."""
    loop = asyncio.get_running_loop()
    tries = _Tries(fn, timeout, message)
    deadline = loop.time() + timeout
    while True:
        tries.count += 1
        try:
            value = fn()
            if inspect.isawaitable(value):
                value = await value
        except retry_on as e:
            tries.error = e
        else:
            if value:
                return value
            tries.last, tries.error = value, None
        left = deadline - loop.time()
        if left <= 0:
            raise tries.failed() from tries.error
        await asyncio.sleep(min(interval, left))
