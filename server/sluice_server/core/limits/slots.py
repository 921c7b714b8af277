"""Admission: the concurrent-stream cap, the admission queue in front of it
(core/limits/queue.py, with `--queue-size`) and the drain switch, plus the live stream set
that drain aborts when its timeout runs out.

`admit(who)` hands out a `Ticket`: admitted (it holds a slot), or, with a queue, waiting
for one. With several worker processes (`--api-workers`), the cap and the queue are the
pod's (shared memory, `core/limits/shared_memory.py`), and `active` stays this worker's own count of
admitted streams (what its drain waits for).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ..auth.identity import ANONYMOUS_TENANT, NO_LIMITS, Principal
from ..errors import ApiError
from .queue import Admission, Ticket
from .shared_memory import PodSeat

log = logging.getLogger(__name__)
ANYONE = Principal("anonymous", ANONYMOUS_TENANT, NO_LIMITS)


class Abortable(Protocol):
    marked: bool  # the router relays it and can continue it elsewhere

    def fail(self, message: str) -> None: ...

    def hand_over(self) -> None: ...


class Gate:
    def __init__(
        self, max_streams: int, pod: PodSeat | None = None, queue: Admission | None = None
    ) -> None:
        self.max_streams = max_streams
        self.pod = pod
        self.slots = pod.limits if pod is not None else None  # the pod's shared slot count
        self.queue = queue
        self.active = 0
        self.draining = False
        self.streams: set[Abortable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, who: Principal = ANYONE) -> Ticket:
        """A slot now, or (with a queue) a place in the queue; otherwise refused at once
        (429, or 503 while draining)."""
        if self.draining:
            raise ApiError(
                503,
                "Server is shutting down; retry on another replica.",
                reason="draining",
                code="draining",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if self.queue is not None:
            ticket = self.queue.enter(who)  # raises 429 when the queue is full
            ticket.release_slot = lambda: self._release(ticket)
            if ticket.admitted:
                self._seated(ticket)
            else:
                ticket.on_admit = self._seated
            return ticket
        if not self._take():
            raise ApiError(
                429,
                f"Server at capacity ({self.max_streams} concurrent streams); retry shortly.",
                reason="capacity",
                code="capacity_exceeded",
                headers={"Retry-After": "1"},
            )
        ticket = Ticket(None, who.tenant, who.priority, 0)
        ticket.release_slot = lambda: self._release(ticket)
        self._seated(ticket)
        return ticket

    def _take(self) -> bool:
        if self.slots is not None:
            return self.slots.take_slot(self.max_streams)
        return self.active < self.max_streams

    def _seated(self, ticket: Ticket) -> None:
        self.active += 1
        self._idle.clear()

    def _release(self, ticket: Ticket) -> None:
        """An admitted ticket's slot is back (the queue's own count is the ticket's)."""
        if self.queue is None and self.slots is not None and self.active > 0:
            self.slots.give_slot()
        self.active -= 1
        if self.active <= 0:
            self.active = 0
            self._idle.set()

    async def drain(self, grace_seconds: float, handover_seconds: float | None = None) -> int:
        """Refuse new streams and every queued one (503 at once), wait up to
        `grace_seconds` for in-flight ones, then fail the rest. Returns how many were cut
        off. `handover_seconds` (a pod that takes continuations): after that long, the
        streams the router relays are handed to it (`hand_over`: their connections end
        without a final event, and the router continues them on another replica), so
        only the others keep the pod up to `grace_seconds`."""
        self.draining = True
        if self.pod is not None:
            self.pod.set_ready(False)  # the whole pod is not ready while any worker drains
        if self.queue is not None:
            self.queue.refuse_waiting()
        first = grace_seconds if handover_seconds is None else min(handover_seconds, grace_seconds)
        try:
            await asyncio.wait_for(self._idle.wait(), first)
            return 0
        except TimeoutError:
            pass
        handed = [s for s in self.streams if s.marked] if first < grace_seconds else []
        if handed:
            for s in handed:
                s.hand_over()
            log.info("drain: %d streams handed to the router after %g s", len(handed), first)
            try:
                await asyncio.wait_for(self._idle.wait(), grace_seconds - first)
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
