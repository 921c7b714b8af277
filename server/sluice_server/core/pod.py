"""What the worker processes of one pod share (`--api-workers N`): the stream slots, the
rate-limit buckets and one readiness flag per worker, in shared memory the supervisor
creates before it spawns the workers.

Every piece is plain shared memory (`multiprocessing` raw arrays) behind one
`multiprocessing` lock, handed to each worker as a spawn argument: the pod's limits stay
exact whatever worker a request lands on (`--max-concurrent-streams 8` is 8 per pod, not
8 per worker), without a round trip to another process. The critical sections are a few
arithmetic operations, so the lock is taken on the event loop directly.

A worker that dies holding slots leaks them; that is fine because a dead worker takes
the whole pod down (the supervisor exits non-zero and the kubelet restarts the
container, with fresh shared memory).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
from typing import Any

# Rate-limit buckets the pod can hold at once (two per active caller: requests and
# tokens). A bucket that has refilled completely is free again, so this bounds the
# callers active within one refill window, not the callers ever seen.
BUCKET_SLOTS = 1 << 15
PROBES = 32  # open addressing: slots tried per key before the closest-to-full is evicted


class SharedBuckets:
    """A fixed hash table of token buckets in shared memory: key -> (level, stamp,
    full_at). `full_at` is when the bucket will be full again: past it, the bucket is the
    same as a new one, so its slot may be reused. Call only with `lock` held."""

    def __init__(self, ctx: Any, slots: int = BUCKET_SLOTS) -> None:
        self.slots = slots
        self.keys = ctx.RawArray("q", slots)  # 0: empty
        self.values = ctx.RawArray("d", 3 * slots)

    @staticmethod
    def _hash(key: str) -> int:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little",
                           signed=True)  # fmt: skip
        return h or 1

    def _find(self, key: str, now: float) -> tuple[int, bool]:
        """(slot, found): the key's slot, else the slot to store it in."""
        h = self._hash(key)
        keys, values, n = self.keys, self.values, self.slots
        free = -1
        oldest, oldest_full_at = -1, float("inf")
        for i in range(PROBES):
            slot = (h + i) % n
            k = keys[slot]
            if k == h:
                return slot, True
            full_at = values[3 * slot + 2]
            if free < 0 and (k == 0 or full_at <= now):
                free = slot
            if k == 0:
                break  # the key is not further along the probe sequence
            if full_at < oldest_full_at:
                oldest, oldest_full_at = slot, full_at
        return (free if free >= 0 else oldest), False

    def get(self, key: str, now: float) -> tuple[float, float] | None:
        slot, found = self._find(key, now)
        if not found:
            return None
        v = self.values
        return v[3 * slot], v[3 * slot + 1]

    def put(self, key: str, level: float, stamp: float, full_at: float) -> None:
        slot, _ = self._find(key, stamp)
        self.keys[slot] = self._hash(key)
        v = self.values
        v[3 * slot], v[3 * slot + 1], v[3 * slot + 2] = level, stamp, full_at


class PodState:
    """Created once by the supervisor (`PodState(workers)`), pickled into every worker as
    a spawn argument (shared memory and locks travel that way only)."""

    def __init__(self, workers: int, share_limits: bool = True, ctx: Any | None = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.workers = workers
        # False only for the tests' negative control: each worker then limits on its own.
        self.share_limits = share_limits
        self.lock = ctx.Lock()
        self.streams: ctypes.c_int = ctx.RawValue("i", 0)
        self.ready = ctx.RawArray("b", workers)
        self.buckets = SharedBuckets(ctx)

    def not_ready(self) -> None:
        """Every worker's flag down: the pod answers 503 on /ready from any worker (the
        supervisor calls this when a worker died)."""
        for i in range(self.workers):
            self.ready[i] = 0


class PodSeat:
    """One worker's view of the pod: its index, the shared slot counter and readiness."""

    def __init__(self, state: PodState, index: int) -> None:
        self.state, self.index = state, index

    @property
    def limits(self) -> PodSeat | None:
        """This seat where the pod's limits are shared, else None (per-worker limits)."""
        return self if self.state.share_limits else None

    @property
    def workers(self) -> int:
        return self.state.workers

    def take_slot(self, limit: int) -> bool:
        with self.state.lock:
            if self.state.streams.value >= limit:
                return False
            self.state.streams.value += 1
            return True

    def give_slot(self) -> None:
        with self.state.lock:
            self.state.streams.value = max(0, self.state.streams.value - 1)

    @property
    def active(self) -> int:
        return self.state.streams.value

    def set_ready(self, ready: bool) -> None:
        self.state.ready[self.index] = 1 if ready else 0

    def waiting_for(self) -> list[int]:
        """The workers that are not ready (empty: the whole pod is)."""
        return [i for i in range(self.state.workers) if not self.state.ready[i]]
