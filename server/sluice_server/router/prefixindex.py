"""Which prompt blocks each pod's KV cache holds: the prefix half of placement.

Two indexes per pod, both keyed by block hash (opaque: `kvcache/blockhash.py` computes the
ints vLLM computes; this module only compares them):

- *precise*: the blocks the pod's engine says it holds, fed by its KV events
  (`stored` adds, `removed` drops, `cleared` empties). Used while the pod's event feed is
  live (`feed(pod, live=True)`). A lost feed (sequence gap that replay could not fill, a
  dropped subscriber) or a container restart makes the set untrustworthy: it is emptied,
  and the pod is scored from the approximate index until the feed is live again.
- *approximate*: the blocks the router itself sent to the pod (`sent`), an LRU bounded by
  count and by age. For engines without events and for the moments a feed is down. It
  over-estimates (the engine may have evicted the blocks since), which the age bound limits.

`longest_prefix(pod, hashes)` is the number of the request's leading blocks present. vLLM
chains block hashes (each includes its parent's), so a block's presence implies its prefix's
and the first miss ends the run, as in the engine's own lookup.

Memory is bounded per pod: at most `max_precise` hashes in the precise set (a live engine
never reports more blocks than its cache holds; past the bound, which only lost `removed`
events can cause, the oldest stored are dropped first) and `max_approx` in the approximate
one. With the defaults (131,072 + 16,384 hashes, each a small int of about 100 bytes of
dict entry and object), a pod costs at most about 15 MB; the router forgets pods that
leave (`forget`), so the total is that times the Ready pods of the models it serves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

BlockHash: TypeAlias = Hashable

# 131,072 blocks of 16 tokens = 2M tokens: above the KV cache of one 80 GB GPU for an 8B
# model (about 0.5M tokens), so a consistent feed never reaches it.
DEFAULT_MAX_PRECISE = 131_072
DEFAULT_MAX_APPROX = 16_384
DEFAULT_APPROX_AGE_S = 120.0


@dataclass
class _Pod:
    live: bool = False
    # dicts as ordered sets: insertion order is the eviction order.
    precise: dict[BlockHash, None] = field(default_factory=dict)
    approx: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)


class PrefixIndex:
    """Per pod, the block hashes its cache holds (precise) or was recently sent (approximate).

    Pure and single-threaded (the router's event loop calls it); `clock` is injected so
    tests and the placement model control the age bound.
    """

    def __init__(
        self,
        *,
        max_precise: int = DEFAULT_MAX_PRECISE,
        max_approx: int = DEFAULT_MAX_APPROX,
        approx_age_s: float = DEFAULT_APPROX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_precise < 1 or max_approx < 1 or approx_age_s <= 0:
            raise ValueError("index bounds must be positive")
        self.max_precise = max_precise
        self.max_approx = max_approx
        self.approx_age_s = approx_age_s
        self._clock = clock
        self._pods: dict[str, _Pod] = {}

    def _pod(self, pod: str) -> _Pod:
        entry = self._pods.get(pod)
        if entry is None:
            entry = self._pods[pod] = _Pod()
        return entry

    # -- the event feed (kvcache/kvevents.py calls these) --------------------------------
    def feed(self, pod: str, *, live: bool) -> None:
        """The pod's event feed came up (precise scoring from now) or went down (the
        precise set is emptied: events were missed, so it cannot be trusted)."""
        entry = self._pod(pod)
        if not live:
            entry.precise.clear()
        entry.live = live

    def stored(
        self, pod: str, hashes: Iterable[BlockHash], parent: BlockHash | None = None
    ) -> None:
        """BlockStored: the pod's cache now holds these blocks. `parent` is accepted for the
        event's shape; chained hashes already carry it."""
        del parent
        precise = self._pod(pod).precise
        for h in hashes:
            precise.pop(h, None)  # re-stored: it is the newest again
            precise[h] = None
        while len(precise) > self.max_precise:
            del precise[next(iter(precise))]

    def removed(self, pod: str, hashes: Iterable[BlockHash]) -> None:
        """BlockRemoved: the pod's cache evicted these blocks."""
        precise = self._pod(pod).precise
        for h in hashes:
            precise.pop(h, None)

    def cleared(self, pod: str) -> None:
        """AllBlocksCleared: the pod's cache was reset."""
        self._pod(pod).precise.clear()

    # -- what the router sent --------------------------------------------------------
    def sent(self, pod: str, hashes: Sequence[BlockHash]) -> None:
        """The router placed a request with these block hashes on `pod`."""
        approx = self._pod(pod).approx
        now = self._clock()
        for h in hashes:
            approx[h] = now
            approx.move_to_end(h)
        while len(approx) > self.max_approx:
            approx.popitem(last=False)

    # -- lookup ----------------------------------------------------------------------
    def is_live(self, pod: str) -> bool:
        entry = self._pods.get(pod)
        return entry is not None and entry.live

    def longest_prefix(self, pod: str, hashes: Sequence[BlockHash]) -> int:
        """How many of the request's leading blocks the pod holds: from its events while
        its feed is live, else from what the router sent it within the age bound."""
        entry = self._pods.get(pod)
        if entry is None:
            return 0
        if entry.live:
            held: dict[BlockHash, None] | OrderedDict[BlockHash, float] = entry.precise
        else:
            self._expire(entry.approx)
            held = entry.approx
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _expire(self, approx: OrderedDict[BlockHash, float]) -> None:
        oldest = self._clock() - self.approx_age_s
        while approx:
            h, at = next(iter(approx.items()))
            if at >= oldest:
                break
            del approx[h]

    # -- pods coming and going -------------------------------------------------------
    def forget(self, pod: str) -> None:
        """The pod left, restarted or lost its feed for good: nothing of it is kept."""
        self._pods.pop(pod, None)

    def pods(self) -> list[str]:
        return list(self._pods)

    def size(self, pod: str) -> tuple[int, int]:
        """(precise, approximate) hashes held for the pod: for metrics and the bound test."""
        entry = self._pods.get(pod)
        return (0, 0) if entry is None else (len(entry.precise), len(entry.approx))
