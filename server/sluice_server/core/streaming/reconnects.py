"""Recent token-SSE streams by id, so a reconnect carrying `Last-Event-ID` is answered
without ever starting a second generation: 204 for a stream that has ended, the stream
itself while it may be resumed, a clear 4xx for one that was aborted or is unknown.

Bounded: live entries are bounded by the stream cap (each holds a slot); ended streams
keep only their state, owner and end time, for `keep_seconds` and at most `max_ended`
of them (oldest dropped first), about 200 bytes each.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

LIVE, DETACHED, FINISHED, ABORTED = "live", "detached", "finished", "aborted"


class Entry:
    __slots__ = ("kid", "state", "handle", "timer", "ended_at")

    def __init__(self, kid: str, handle: Any) -> None:
        self.kid = kid
        self.state = LIVE
        self.handle = handle  # what lifecycle needs to resume it (None once ended)
        self.timer: Any = None  # the grace timer while detached
        self.ended_at = 0.0


class RecentStreams:
    def __init__(self, keep_seconds: float = 600.0, max_ended: int = 10_000) -> None:
        self.keep_seconds = keep_seconds
        self.max_ended = max_ended
        self.live: dict[str, Entry] = {}
        self.ended: OrderedDict[str, Entry] = OrderedDict()

    def add(self, rid: str, kid: str, handle: Any) -> Entry:
        entry = self.live[rid] = Entry(kid, handle)
        return entry

    def end(self, rid: str, state: str) -> None:
        """The stream is over (FINISHED: its terminal event went out; ABORTED: cut short)."""
        entry = self.live.pop(rid, None)
        if entry is None:
            return
        entry.state, entry.handle, entry.timer = state, None, None
        entry.ended_at = time.monotonic()
        self.ended[rid] = entry
        self._trim()

    def get(self, rid: str) -> Entry | None:
        entry = self.live.get(rid)
        if entry is not None:
            return entry
        self._trim()
        return self.ended.get(rid)

    def _trim(self) -> None:
        ended, horizon = self.ended, time.monotonic() - self.keep_seconds
        while ended and (
            len(ended) > self.max_ended or next(iter(ended.values())).ended_at < horizon
        ):
            ended.popitem(last=False)
