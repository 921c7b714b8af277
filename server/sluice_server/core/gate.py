"""Admission: the concurrent-stream cap and the drain switch, plus the live stream set
that drain aborts when its timeout runs out.

With several worker processes (`--api-workers`), the cap is the pod's: the slot count
lives in the pod's shared memory (`core/pod.py`), and `active` stays this worker's own
(what its drain waits for)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from .errors import ApiError
from .pod import PodSeat


class Abortable(Protocol):
    def fail(self, message: str) -> None: ...


class Gate:
    def __init__(self, max_streams: int, pod: PodSeat | None = None) -> None:
        self.max_streams = max_streams
        self.pod = pod
        self.slots = pod.limits if pod is not None else None  # the pod's shared slot count
        self.active = 0
        self.draining = False
        self.streams: set[Abortable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        """Reserve a stream slot or refuse at once (no queue: the pod's load balancer or
        client retries elsewhere)."""
        if self.draining:
            raise ApiError(
                503,
                "Server is shutting down; retry on another replica.",
                reason="draining",
                code="draining",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if not self._take():
            raise ApiError(
                429,
                f"Server at capacity ({self.max_streams} concurrent streams); retry shortly.",
                reason="capacity",
                code="capacity_exceeded",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        self._idle.clear()

    def _take(self) -> bool:
        if self.slots is not None:
            return self.slots.take_slot(self.max_streams)
        return self.active < self.max_streams

    def release(self) -> None:
        if self.slots is not None and self.active > 0:
            self.slots.give_slot()
        self.active -= 1
        if self.active <= 0:
            self.active = 0
            self._idle.set()

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new streams, wait up to `grace_seconds` for in-flight ones, then fail the rest.
        Returns how many were cut off."""
        self.draining = True
        if self.pod is not None:
            self.pod.set_ready(False)  # the whole pod is not ready while any worker drains
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
            return 0
        except TimeoutError:
            pass
        left = list(self.streams)
        for s in left:
            s.fail("Server shut down before this stream finished (drain timeout).")
        # Give the error events a moment to be written before the process exits.
        try:
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except TimeoutError:
            pass
        return len(left)
