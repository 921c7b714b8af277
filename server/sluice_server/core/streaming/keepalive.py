"""The one keep-alive writer: a timer per event loop and interval that beats everything
registered on it, so a client that is only waiting (for a stream slot in the admission
queue, or for a replica to come up) hears from the server every interval and its proxies
keep the connection open.

    beats = KeepAlive.on(loop, interval)
    remove = beats.add(callback)   # callback() every `interval` s, on the loop
    remove()                       # idempotent

A beat only marks what it beats as due (the stream core wakes the stream's writer, which
writes the keep-alive in its protocol's own form, core/streaming/events.py `Waiting`): the writes go
out through each stream's own send path, with its send timeout, and one slow client holds
up nobody else's beat. One timer for all, not one sleeping task per waiting client; it
stops when the last registration is removed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)


class KeepAlive:
    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, KeepAlive]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop, self.interval = loop, interval
        self.beats: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def on(cls, loop: asyncio.AbstractEventLoop, interval: float) -> KeepAlive:
        """The writer for `interval` on `loop` (made on first use)."""
        per_loop = cls._by_loop.setdefault(loop, {})
        if interval not in per_loop:
            per_loop[interval] = cls(loop, interval)
        return per_loop[interval]

    def add(self, beat: Callable[[], None]) -> Callable[[], None]:
        """Call `beat()` every interval until the returned remover is called."""
        key = next(self._ids)
        self.beats[key] = beat
        if self._timer is None:
            self._timer = self.loop.call_later(self.interval, self._tick)
        return lambda: self._remove(key)

    def _remove(self, key: int) -> None:
        self.beats.pop(key, None)
        if not self.beats and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        for beat in list(self.beats.values()):
            try:
                beat()
            except Exception:  # pragma: no cover - a beat only marks and wakes
                log.exception("keep-alive beat failed")
        self._timer = self.loop.call_later(self.interval, self._tick) if self.beats else None
