"""Admission: the concurrent-stream cap and the drain switch, plus the live stream set
that drain aborts when its timeout runs out."""

from __future__ import annotations

import asyncio
from typing import Protocol

from .errors import ApiError


class Abortable(Protocol):
    def fail(self, message: str) -> None: ...


class Gate:
    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
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
        if self.active >= self.max_streams:
            raise ApiError(
                429,
                f"Server at capacity ({self.max_streams} concurrent streams); retry shortly.",
                reason="capacity",
                code="capacity_exceeded",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        self._idle.clear()

    def release(self) -> None:
        self.active -= 1
        if self.active <= 0:
            self.active = 0
            self._idle.set()

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new streams, wait up to `grace_seconds` for in-flight ones, then fail the rest.
        Returns how many were cut off."""
        self.draining = True
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
