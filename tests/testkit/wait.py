"""`eventually`: the one way tests wait for something the system under test will record
(a metric, a log line, a state), instead of a hand-written deadline loop or a sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def eventually(check: Callable[[], Any], within: float = 15.0, interval: float = 0.02,
                     what: str = "condition") -> Any:  # fmt: skip
    """Call `check()` (a function or a coroutine function) until it returns something true;
    that value. AssertionError naming `what` and the last value after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within:g} s (last: {value!r})")
        await asyncio.sleep(interval)
