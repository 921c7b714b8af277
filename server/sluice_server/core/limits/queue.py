"""The admission queue (`--queue-size`): a request that finds the pod's stream slots taken
waits here instead of getting a 429, and each free slot goes to a waiting request by
priority, then by tenant weight. Shared by every worker of the pod (core/limits/shared_memory.py
`QueueTable`, under the pod's lock); each worker keeps its own waiters' futures.

The policy, in the order it decides:

1. **Bound.** At most `size` requests wait. One more: the worst waiting request (lowest
   priority; within it the tenant with the most queue places per weight; its newest) is
   shed to make room if the newcomer is better (higher priority, or the same priority
   from a tenant with fewer places per weight), else the newcomer is refused. Either gets
   429 `queue_full` at once, with `Retry-After` from the measured drain rate (freed slots
   per second, weighted over the last `DRAIN_TAU_SECONDS`): requests waiting ahead at the
   same or a higher priority, plus one, over that rate. An admitted stream is never shed.
2. **Slot shares** (`sharing`). A tenant's share of the slots is `slots x weight / sum of
   the active tenants' weights` (active: holds a slot, waits, or was seen within `window`
   seconds). Below its share a tenant may always take a free slot. Above it, it may borrow
   one only if that still leaves free slots for each other active tenant below its share:
   room to reach the most slots it held at once lately (its peak within `window`, at least
   one more slot, at most its share), and at most `RESERVE_FRACTION` of the slots for all
   of them. A steady tenant beside a flooding one then finds a slot at once, for each of
   its requests that overlap as they did lately, instead of waiting for one of the flood's
   long streams to end (no admitted stream is ever preempted, so a slot the flood took is
   back only when its stream ends). The cost is the flood's: those slots stay idle while it
   waits.
3. **Order.** Among the requests allowed a slot: the highest priority class first; within
   it the tenant with the least virtual time, then arrival order. A tenant's virtual time
   is the tokens its streams generated divided by its weight (charged as they are
   generated, `CHARGE_EVERY` tokens at a time), so a tenant of long generations gets no
   more than its weight's share of tokens, whatever its request count. A tenant that
   becomes active starts at the least virtual time of the active ones (it gets no credit
   for having been idle).

This is virtual-time fair queueing (start-time fair queueing, as CFS schedules threads),
not deficit round robin: DRR charges each request its size when it is dequeued, and a
stream's size is only known when it ends, minutes later; virtual time is charged as the
tokens come, so the order is right while the long streams are still running.

A waiting request leaves the queue at once when its client goes away (no engine request
was started), is refused when its timeout passes (429 `queue_timeout`, `Retry-After`) or
when the worker drains (503 `draining`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..auth.identity import Principal, Priorities
from ..errors import ApiError
from .shared_memory import FREE, GRANTED, REFUSED, WAITING, QueueShape, QueueTable, WakeLines

if TYPE_CHECKING:
    from ...engine.base import Delta
    from ..telemetry.metrics import Metrics

DRAIN_TAU_SECONDS = 10.0
RESERVE_FRACTION = 0.25
CHARGE_EVERY = 16  # tokens charged to the tenant's virtual time at a time
SWEEP_SECONDS = 1.0  # a worker with waiters re-decides this often (activity windows end)

# Why the queue refused a request (an entry's `e_reason`), and its shed metric label.
QUEUE_FULL, DISPLACED, TIMEOUT, DRAINING = 1, 2, 3, 4
REASONS = {
    QUEUE_FULL: "queue_full",
    DISPLACED: "displaced",
    TIMEOUT: "timeout",
    DRAINING: "draining",
}

# Ticket states.
ADMITTED, QUEUED, REFUSED_T, RELEASED = "admitted", "queued", "refused", "released"


class Ticket:
    """One request's claim on a stream slot: admitted at once, or waiting in the queue.
    `release()` (idempotent) gives the slot back, or leaves the queue."""

    __slots__ = ("adm", "entry", "seq", "row", "tenant", "priority", "rank", "state",
                 "future", "timer", "queued_at", "admitted_at", "refused_at", "error",
                 "release_slot", "on_admit")  # fmt: skip

    def __init__(self, adm: Admission | None, tenant: str, priority: str, rank: int) -> None:
        self.adm = adm
        self.entry = self.seq = self.row = -1
        self.tenant, self.priority, self.rank = tenant, priority, rank
        self.state = ADMITTED
        self.future: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.queued_at = time.perf_counter()
        self.admitted_at: float | None = self.queued_at  # None while waiting or when refused
        self.refused_at: float | None = None
        self.error: ApiError | None = None
        # Set by the gate: its own count of a slot given back, or granted after a wait.
        self.release_slot: Callable[[], None] | None = None
        self.on_admit: Callable[[Ticket], None] | None = None

    @property
    def admitted(self) -> bool:
        return self.state == ADMITTED

    @property
    def waiting(self) -> bool:
        return self.state == QUEUED

    @property
    def queued(self) -> bool:
        """Went through an admission queue (with `--queue-size`)."""
        return self.adm is not None

    @property
    def waited(self) -> float:
        """Seconds in the queue (so far, while waiting)."""
        end = self.admitted_at
        if end is None:
            end = self.refused_at if self.refused_at is not None else time.perf_counter()
        return max(0.0, end - self.queued_at)

    async def wait(self) -> None:
        """Until admitted; raises the refusal (ApiError). Cancelling the wait leaves the
        ticket as it is (release it to leave the queue)."""
        if self.state == QUEUED and self.future is not None:
            await asyncio.shield(self.future)
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        state, self.state = self.state, RELEASED
        if state == ADMITTED:
            if self.adm is not None:
                self.adm.release(self)
            if self.release_slot is not None:
                self.release_slot()
        elif state == QUEUED and self.adm is not None:
            self.adm.leave(self)

    def charge(self, tokens: int) -> None:
        """Tokens this request generated, to its tenant's virtual time."""
        if self.adm is not None and tokens > 0 and self.row >= 0:
            self.adm.charge(self.row, self.tenant, tokens)

    async def metered(self, source: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """`source` (engine deltas), charging its tokens as they are generated."""
        pending = 0
        try:
            async for delta in source:
                pending += delta.num_tokens
                if pending >= CHARGE_EVERY:
                    self.charge(pending)
                    pending = 0
                yield delta
        finally:
            self.charge(pending)
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()


class Admission:
    """One worker's side of the pod's queue."""

    def __init__(
        self,
        table: QueueTable,
        lock: Any,
        worker: int,
        *,
        timeout: float,
        priorities: Priorities,
        sharing: bool = True,
        window: float = 30.0,
        wake: WakeLines | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.t, self.lock, self.worker = table, lock, worker
        self.slots, self.size = table.shape.slots, table.shape.size
        self.timeout, self.priorities = timeout, priorities
        self.sharing, self.window = sharing, window
        self.reserve = max(1, int(self.slots * RESERVE_FRACTION))
        self.wake, self.metrics, self.clock = wake, metrics, clock
        self.waiters: dict[int, Ticket] = {}  # entry -> this worker's waiting ticket
        self._sweeper: asyncio.TimerHandle | None = None
        self._reading = False

    @classmethod
    def local(cls, shape: QueueShape, **kw: Any) -> Admission:
        """A queue for this process alone (one worker, or the per-worker control)."""
        table = QueueTable(multiprocessing.get_context("spawn"), shape)
        return cls(table, contextlib.nullcontext(), 0, **kw)

    # -- the request's side ---------------------------------------------------------

    def enter(self, who: Principal) -> Ticket:
        """Admitted at once, or waiting; ApiError 429 when the queue is full and the caller
        is not better than anyone waiting."""
        rank = self.priorities.rank(who.priority)
        ticket = Ticket(self, who.tenant, who.priority, rank)
        woken: list[int] = []
        refused: ApiError | None = None
        with self.lock:
            now = self.clock()
            row = ticket.row = self._activate(who.tenant, who.weight, now)
            woken += self._dispatch(now)
            if self._free() > 0 and self._allowed(row, now):
                self._hold(row, now)
            else:
                refused = self._enqueue(ticket, now, woken)
        self._deliver(woken)
        if refused is not None:
            self._shed(ticket.priority, QUEUE_FULL)
            raise refused
        if ticket.state == ADMITTED:
            self._observe(ticket)
            return ticket
        self._watch(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """A waiting request's client went away (or it is released): out of the queue at
        once; a slot granted meanwhile goes back."""
        self._unwatch(ticket)
        woken: list[int] = []
        with self.lock:
            e = ticket.entry
            if self.t.e_seq[e] == ticket.seq:
                state = self.t.e_state[e]
                if state == WAITING:
                    self._remove(e)
                elif state == GRANTED:
                    self.t.e_state[e] = FREE
                    woken += self._unhold(ticket.row, self.clock())
                elif state == REFUSED:
                    self.t.e_state[e] = FREE
        self._deliver(woken)

    def release(self, ticket: Ticket) -> None:
        """An admitted stream ended: its slot to the next request allowed one."""
        with self.lock:
            woken = self._unhold(ticket.row, self.clock())
        self._deliver(woken)

    def charge(self, row: int, tenant: str, tokens: int) -> None:
        """`tokens` to the tenant's virtual time (unless its row went to another tenant:
        the last tokens of a stream can come after its slot was given back)."""
        key = self.t.tenant_key(tenant)
        with self.lock:
            if self.t.t_key[row] == key:
                self.t.t_vt[row] += tokens / (self.t.t_weight[row] or 1.0)

    def refuse_waiting(self) -> int:
        """Drain: every request this worker has waiting gets 503 now."""
        refused = 0
        for ticket in list(self.waiters.values()):
            with self.lock:
                e = ticket.entry
                if self.t.e_seq[e] != ticket.seq or self.t.e_state[e] != WAITING:
                    continue  # decided meanwhile: its own outcome is on its way
                self._remove(e)
            self._settle(ticket, REFUSED, DRAINING)
            refused += 1
        return refused

    @property
    def depth(self) -> int:
        """Requests waiting in the pod's queue."""
        return int(self.t.waiting.value)

    # -- decisions (lock held) ------------------------------------------------------

    def _free(self) -> int:
        return int(self.slots - self.t.held.value)

    def _activate(self, tenant: str, weight: int, now: float) -> int:
        t = self.t
        row = t.tenant_row(tenant)
        t.t_weight[row] = float(weight)
        if not t.t_active[row]:
            # Joins at the least virtual time of the active tenants: no credit for idling.
            floor = min((t.t_vt[r] for r in self._active_rows(now)), default=0.0)
            t.t_vt[row] = max(t.t_vt[row], floor)
            t.t_active[row] = 1
            t.active[t.n_active.value] = row
            t.n_active.value += 1
        t.t_seen[row] = now
        return row

    def _active_rows(self, now: float) -> list[int]:
        """The active tenants' rows; drops those that hold nothing, wait for nothing and
        were last seen more than `window` ago."""
        t = self.t
        rows, keep = [], 0
        for i in range(t.n_active.value):
            row = t.active[i]
            if t.t_held[row] or t.t_queued[row] or now - t.t_seen[row] < self.window:
                t.active[keep] = row
                keep += 1
                rows.append(row)
            else:
                t.t_active[row] = 0
        t.n_active.value = keep
        return rows

    def _allowed(self, row: int, now: float) -> bool:
        """May this tenant take a free slot now (rule 2 of the module docstring)?"""
        if not self.sharing:
            return True
        t = self.t
        rows = self._active_rows(now)
        total = sum(t.t_weight[r] for r in rows) or 1.0
        share = self.slots * t.t_weight[row] / total
        if t.t_held[row] < share:
            return True
        keep = 0  # free slots the other tenants below their share may need
        for r in rows:
            if r == row:
                continue
            held, room = t.t_held[r], self.slots * t.t_weight[r] / total - t.t_held[r]
            if room > 0:
                keep += min(math.ceil(room), max(1, self._peak(r, now) - held))
        return self._free() - 1 >= min(keep, self.reserve)

    def _peak(self, row: int, now: float) -> int:
        """The most slots the tenant held at once within `window` (or now)."""
        t = self.t
        if now - t.t_peak_at[row] > self.window:
            return int(t.t_held[row])
        return int(max(t.t_peak[row], t.t_held[row]))

    def _hold(self, row: int, now: float) -> None:
        t = self.t
        held = t.t_held[row] = t.t_held[row] + 1
        t.held.value += 1
        t.t_seen[row] = now
        if held >= t.t_peak[row] or now - t.t_peak_at[row] > self.window:
            t.t_peak[row], t.t_peak_at[row] = held, now

    def _unhold(self, row: int, now: float) -> list[int]:
        t = self.t
        t.t_held[row] = max(0, t.t_held[row] - 1)
        t.held.value = max(0, t.held.value - 1)
        t.t_seen[row] = now
        count, stamp = t.releases[0], t.releases[1]
        if not t.releases[2]:
            t.releases[2] = now  # the first freed slot: the rate's history starts here
        t.releases[0] = count * math.exp(-(now - stamp) / DRAIN_TAU_SECONDS) + 1.0
        t.releases[1] = now
        return self._dispatch(now)

    def _dispatch(self, now: float) -> list[int]:
        """Grant free slots to the best allowed waiting requests; the entries granted."""
        t = self.t
        granted: list[int] = []
        if not t.waiting.value:
            return granted
        waiting = [e for e in range(t.entries) if t.e_state[e] == WAITING]
        while waiting and self._free() > 0:
            allowed: dict[int, bool] = {}
            best, best_key = -1, None
            for e in waiting:
                row = t.e_tenant[e]
                ok = allowed.get(row)
                if ok is None:
                    ok = allowed[row] = self._allowed(row, now)
                if ok:
                    key = (t.e_prio[e], t.t_vt[row], t.e_seq[e])
                    if best_key is None or key < best_key:
                        best, best_key = e, key
            if best < 0:
                break
            waiting.remove(best)
            row = t.e_tenant[best]
            self._unqueue(best)
            t.e_state[best] = GRANTED
            self._hold(row, now)
            granted.append(best)
        return granted

    def _enqueue(self, ticket: Ticket, now: float, woken: list[int]) -> ApiError | None:
        """Queue the request (shedding a worse one when full); the refusal when it is the
        one that does not fit."""
        t = self.t
        if t.waiting.value >= self.size:
            victim = self._worst()
            if victim < 0 or not self._better(ticket, victim):
                return self._full(ticket.rank, now)
            self._remove(victim)
            t.e_state[victim] = REFUSED
            t.e_reason[victim] = DISPLACED
            woken.append(victim)
        e = t.free_entry()
        if e < 0:  # every entry awaits its owner's reading: as good as full
            return self._full(ticket.rank, now)
        seq = t.next_seq.value = t.next_seq.value + 1
        t.e_state[e], t.e_worker[e], t.e_prio[e] = WAITING, self.worker, ticket.rank
        t.e_tenant[e], t.e_seq[e], t.e_reason[e] = ticket.row, seq, 0
        t.waiting.value += 1
        t.depth[ticket.rank] += 1
        t.t_queued[ticket.row] += 1
        ticket.entry, ticket.seq, ticket.state = e, seq, QUEUED
        ticket.admitted_at = None
        return None

    def _remove(self, e: int) -> None:
        """A waiting entry out of the queue and free."""
        self._unqueue(e)
        self.t.e_state[e] = FREE

    def _unqueue(self, e: int) -> None:
        t = self.t
        t.waiting.value -= 1
        t.depth[t.e_prio[e]] -= 1
        row = t.e_tenant[e]
        t.t_queued[row] = max(0, t.t_queued[row] - 1)

    def _places(self, row: int, extra: int = 0) -> float:
        return float((self.t.t_queued[row] + extra) / (self.t.t_weight[row] or 1.0))

    def _worst(self) -> int:
        t = self.t
        worst, worst_key = -1, None
        for e in range(t.entries):
            if t.e_state[e] != WAITING:
                continue
            key = (t.e_prio[e], self._places(t.e_tenant[e]), t.e_seq[e])
            if worst_key is None or key > worst_key:
                worst, worst_key = e, key
        return worst

    def _better(self, ticket: Ticket, victim: int) -> bool:
        t = self.t
        if ticket.rank != t.e_prio[victim]:
            return bool(ticket.rank < t.e_prio[victim])
        row = t.e_tenant[victim]
        return row != ticket.row and self._places(ticket.row, 1) < self._places(row)

    def _full(self, rank: int, now: float) -> ApiError:
        ahead = sum(self.t.depth[r] for r in range(rank + 1))
        retry = self._retry_after(ahead, now)
        return ApiError(
            429,
            f"Server at capacity and its queue is full ({self.size} "
            f"waiting); retry after {retry} s.",
            reason="capacity",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    def _retry_after(self, ahead: int, now: float) -> int:
        """Seconds until `ahead` + 1 requests will have left the queue at the rate slots
        were freed lately (an exponentially weighted count over DRAIN_TAU_SECONDS, divided
        by the weight of the time it covers, so a young pod is not read as a slow one);
        the queue's timeout when nothing was freed yet, and never more."""
        count, stamp, first = self.t.releases[0], self.t.releases[1], self.t.releases[2]
        cap = max(1, math.ceil(self.timeout))
        if not first:
            return cap
        tau = DRAIN_TAU_SECONDS
        covered = tau * (1.0 - math.exp(-max(now - first, 1e-3) / tau))
        rate = count * math.exp(-(now - stamp) / tau) / covered
        if rate <= 0:
            return cap
        return int(max(1, min(cap, math.ceil((ahead + 1) / rate))))

    # -- this worker's waiters ------------------------------------------------------

    def _watch(self, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        ticket.future = loop.create_future()
        ticket.timer = loop.call_later(self.timeout, self._expire, ticket)
        self.waiters[ticket.entry] = ticket
        self._gauge(ticket.priority, 1)
        if self.wake is not None and not self._reading:
            loop.add_reader(self.wake.reader(self.worker), self._on_wake)
            self._reading = True
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_SECONDS, self._sweep_tick)

    def _unwatch(self, ticket: Ticket) -> None:
        if self.waiters.pop(ticket.entry, None) is ticket:
            self._gauge(ticket.priority, -1)
        if ticket.timer is not None:
            ticket.timer.cancel()
            ticket.timer = None

    def _expire(self, ticket: Ticket) -> None:
        """Its timeout passed: refused, unless a slot reached it first. An event loop may
        run a timer up to a clock tick early (uvloop's are whole milliseconds, on a cached
        clock): one that fires before the ticket's own clock says `timeout` waits out the
        rest, so no request is refused before its queue timeout."""
        left = self.timeout - (time.perf_counter() - ticket.queued_at)
        if left > 0:
            ticket.timer = asyncio.get_running_loop().call_later(left, self._expire, ticket)
            return
        ticket.timer = None
        with self.lock:
            e = ticket.entry
            if self.t.e_seq[e] != ticket.seq:
                return
            state = self.t.e_state[e]
            if state == WAITING:
                self._remove(e)
                state = REFUSED
                self.t.e_reason[e] = TIMEOUT
            reason = self.t.e_reason[e]
        self._settle(ticket, state, reason if state == REFUSED else 0)

    def _deliver(self, entries: list[int]) -> None:
        """Tell each decided entry's worker: this one settles its own at once."""
        others: set[int] = set()
        for e in entries:
            ticket = self.waiters.get(e)
            if ticket is not None and ticket.seq == self.t.e_seq[e]:
                with self.lock:
                    state, reason = self.t.e_state[e], self.t.e_reason[e]
                self._settle(ticket, state, reason)
            else:
                others.add(self.t.e_worker[e])
        others.discard(self.worker)
        if self.wake is not None:
            for worker in others:
                self.wake.wake(worker)

    def _on_wake(self) -> None:
        if self.wake is not None:  # only then is this the pipe's reader
            with contextlib.suppress(BlockingIOError, InterruptedError):
                os.read(self.wake.reader(self.worker), 4096)
        self._sweep()

    def _sweep(self) -> None:
        """Settle this worker's waiters that other workers decided (or that a dispatch
        now admits)."""
        decided = []
        with self.lock:
            decided += self._dispatch(self.clock())
            for e, ticket in self.waiters.items():
                if self.t.e_seq[e] == ticket.seq and self.t.e_state[e] in (GRANTED, REFUSED):
                    decided.append(e)
        self._deliver(decided)

    def _sweep_tick(self) -> None:
        self._sweeper = None
        self._sweep()
        if self.waiters:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._sweep_tick)

    def _settle(self, ticket: Ticket, state: int, reason: int) -> None:
        """Resolve a waiting ticket: admitted (its slot is held) or refused."""
        if ticket.state != QUEUED:
            return
        self._unwatch(ticket)
        with self.lock:
            if self.t.e_seq[ticket.entry] == ticket.seq:
                self.t.e_state[ticket.entry] = FREE
            if state == GRANTED:
                ticket.state, ticket.admitted_at = ADMITTED, time.perf_counter()
                if ticket.on_admit is not None:
                    ticket.on_admit(ticket)
                self._observe(ticket)
            else:
                ticket.state, ticket.refused_at = REFUSED_T, time.perf_counter()
                ticket.error = self._refusal(reason, ticket.rank)
        if state != GRANTED:
            self._shed(ticket.priority, reason)
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_result(None)

    def _refusal(self, reason: int, rank: int) -> ApiError:
        if reason == DRAINING:
            return ApiError(
                503,
                "Server is shutting down; retry on another replica.",
                reason="draining",
                code="draining",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        now = self.clock()
        retry = self._retry_after(sum(self.t.depth[r] for r in range(rank + 1)), now)
        if reason == DISPLACED:
            why = (
                "made room in the full queue for a request of higher priority or of a "
                "tenant below its share"
            )
            code = "queue_full"
        else:
            why = f"waited {self.timeout:g} s in the queue for a stream slot"
            code = "queue_timeout"
        return ApiError(
            429,
            f"Server at capacity: {why}; retry after {retry} s.",
            reason="capacity",
            code=code,
            headers={"Retry-After": str(retry)},
        )

    def _shed(self, priority: str, reason: int) -> None:
        if self.metrics is not None:
            self.metrics.queue_sheds.labels(self.metrics.model, priority, REASONS[reason]).inc()

    def _observe(self, ticket: Ticket) -> None:
        if self.metrics is not None:
            self.metrics.queue_wait.labels(
                self.metrics.model, ticket.tenant, ticket.priority
            ).observe(ticket.waited)

    def _gauge(self, priority: str, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.labels(self.metrics.model, priority).inc(delta)
