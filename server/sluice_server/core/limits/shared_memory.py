"""What the worker processes of one pod share (`--api-workers N`): the stream slots, the
rate-limit buckets, the admission queue (`QueueTable`, with `--queue-size`) and one
readiness flag per worker, in shared memory the supervisor creates before it spawns the
workers.

Every piece is plain shared memory (`multiprocessing` raw arrays) behind one
`multiprocessing` lock, handed to each worker as a spawn argument: the pod's limits stay
exact whatever worker a request lands on (`--max-concurrent-streams 8` is 8 per pod, not
8 per worker), without a round trip to another process. The critical sections are a few
arithmetic operations, so the lock is taken on the event loop directly.

A worker whose queued request got a slot, or was shed, by another worker's decision is told
so on its own wake-up pipe (`WakeLines`, one byte; it then reads the outcome from the
table): a queued request never polls.

A worker that dies holding slots leaks them; that is fine because a dead worker takes
the whole pod down (the supervisor exits non-zero and the kubelet restarts the
container, with fresh shared memory).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...settings import Settings

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
        h = int.from_bytes(
            hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True
        )
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


# Queue entry states.
FREE, WAITING, GRANTED, REFUSED = 0, 1, 2, 3


@dataclass(frozen=True)
class QueueShape:
    """The sizes the queue's table is made with (fixed for the pod's life)."""

    slots: int  # --max-concurrent-streams
    size: int  # --queue-size
    priorities: int  # priority classes (1 without --priority-classes)

    @classmethod
    def of(cls, settings: Settings) -> QueueShape | None:
        """The queue `settings` ask for; None without `--queue-size`."""
        if not settings.queue_size:
            return None
        return cls(
            settings.max_concurrent_streams,
            settings.queue_size,
            max(1, len(settings.priority_classes)),
        )


class QueueTable:
    """The admission queue's state in shared memory (the policy is core/limits/queue.py).
    Call everything with the pod's lock held.

    Entries (`entries` = twice the queue's size, plus some: an entry another worker granted
    or shed stays taken until its owner has read the outcome): state, owning worker,
    priority rank, tenant row, arrival number (identity and FIFO order). Tenant rows (an
    open-addressing table keyed by the tenant's hash): slots held, requests queued, weight,
    virtual time (generated tokens / weight), last seen, the most slots held at once lately
    and when, and whether the row is on the `active` list. A row is only ever overwritten, never emptied, so probe chains stay
    whole; one that holds nothing, waits for nothing and is off the active list may be
    taken by another tenant."""

    def __init__(self, ctx: Any, shape: QueueShape) -> None:
        self.shape = shape
        n = self.entries = 2 * shape.size + 16
        self.e_state = ctx.RawArray("b", n)
        self.e_worker = ctx.RawArray("i", n)
        self.e_prio = ctx.RawArray("i", n)
        self.e_tenant = ctx.RawArray("i", n)
        self.e_seq = ctx.RawArray("q", n)
        self.e_reason = ctx.RawArray("b", n)
        self.waiting = ctx.RawValue("i", 0)
        self.depth = ctx.RawArray("i", shape.priorities)
        self.next_seq = ctx.RawValue("q", 0)
        self.held = ctx.RawValue("i", 0)  # slots taken, pod-wide
        # Tenants: every row that holds a slot or a queued request pins one, so four times
        # that many rows keep probe chains short.
        t = self.tenants = min(1 << 20, max(64, 1 << (4 * (shape.slots + shape.size)).bit_length()))
        self.t_key = ctx.RawArray("q", t)
        self.t_held = ctx.RawArray("i", t)
        self.t_queued = ctx.RawArray("i", t)
        self.t_weight = ctx.RawArray("d", t)
        self.t_vt = ctx.RawArray("d", t)
        self.t_seen = ctx.RawArray("d", t)
        self.t_peak = ctx.RawArray("i", t)
        self.t_peak_at = ctx.RawArray("d", t)
        self.t_active = ctx.RawArray("b", t)
        self.active = ctx.RawArray("i", t)  # rows of active tenants, `n_active` of them
        self.n_active = ctx.RawValue("i", 0)
        # Freed slots: decayed count, when last, when first (the drain rate, Retry-After).
        self.releases = ctx.RawArray("d", 3)

    @staticmethod
    def tenant_key(name: str) -> int:
        return SharedBuckets._hash(name)

    def tenant_row(self, name: str) -> int:
        """The tenant's row, taken now if it has none (its counters zeroed)."""
        h = self.tenant_key(name)
        keys, n = self.t_key, self.tenants
        reuse = -1
        for i in range(n):
            row = (h + i) % n
            k = keys[row]
            if k == h:
                return row
            if k == 0:
                break
            if (
                reuse < 0
                and not self.t_active[row]
                and not self.t_held[row]
                and not self.t_queued[row]
            ):
                reuse = row
        else:  # pragma: no cover - four rows per pinned row: never full
            if reuse < 0:
                raise RuntimeError("tenant table full")
        row = reuse if reuse >= 0 else row
        keys[row] = h
        self.t_held[row] = self.t_queued[row] = self.t_peak[row] = 0
        self.t_vt[row] = self.t_seen[row] = self.t_peak_at[row] = 0.0
        self.t_weight[row] = 1.0
        return row

    def free_entry(self) -> int:
        """An unused entry, or -1."""
        state = self.e_state
        for e in range(self.entries):
            if state[e] == FREE:
                return e
        return -1


class WakeLines:
    """One pipe per worker: another worker writes a byte to wake it (non-blocking: a full
    pipe already holds a wake-up)."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]  # (reader, writer)

    def reader(self, worker: int) -> int:
        fd: int = self.pipes[worker][0].fileno()
        os.set_blocking(fd, False)
        return fd

    def wake(self, worker: int) -> None:
        fd = self.pipes[worker][1].fileno()
        try:
            os.write(fd, b"w")
        except BlockingIOError:
            pass


class PodState:
    """Created once by the supervisor (`PodState(workers)`), pickled into every worker as
    a spawn argument (shared memory and locks travel that way only)."""

    def __init__(
        self,
        workers: int,
        share_limits: bool = True,
        ctx: Any | None = None,
        queue: QueueShape | None = None,
    ) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.workers = workers
        # False only for the tests' negative control: each worker then limits on its own.
        self.share_limits = share_limits
        self.lock = ctx.Lock()
        self.streams: ctypes.c_int = ctx.RawValue("i", 0)
        self.ready = ctx.RawArray("b", workers)
        self.buckets = SharedBuckets(ctx)
        self.queue = QueueTable(ctx, queue) if queue is not None and share_limits else None
        self.wake = WakeLines(ctx, workers) if self.queue is not None else None

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
