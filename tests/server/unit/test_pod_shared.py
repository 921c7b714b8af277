"""The pod's shared memory (core/limits/shared_memory.py) under the gate and the memory rate limiter: two
workers' limiters and gates on one `PodState` limit together, exactly as one process does;
without it (the control) each admits its own share again. One test crosses a real process
boundary."""

from __future__ import annotations

import multiprocessing

import pytest
from sluice_server.core.auth.identity import Plan
from sluice_server.core.errors import ApiError
from sluice_server.core.limits.ratelimit import MemoryLimiter
from sluice_server.core.limits.shared_memory import PodSeat, PodState, SharedBuckets
from sluice_server.core.limits.slots import Gate


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _admitted(limiters, principal: str, plan: Plan, tries: int) -> int:
    n = 0
    for i in range(tries):
        try:
            await limiters[i % len(limiters)].admit(principal, plan)
            n += 1
        except ApiError as e:
            assert e.status == 429
    return n


@pytest.mark.parametrize("shared", [True, False], ids=["pod", "per-worker-control"])
async def test_two_workers_share_the_requests_bucket(shared):
    clock, pod = Clock(), PodState(2)
    workers = [MemoryLimiter(clock=clock, pod=pod if shared else None) for _ in range(2)]
    assert await _admitted(workers, "k", Plan(rpm=5), 20) == (5 if shared else 10)
    clock.t += 12  # one request refilled (5 per 60 s)
    assert await _admitted(workers, "k", Plan(rpm=5), 4) == (1 if shared else 2)


async def test_shared_buckets_keep_the_single_process_semantics():
    clock, pod = Clock(), PodState(2)
    a, b = MemoryLimiter(clock=clock, pod=pod), MemoryLimiter(clock=clock, pod=pod)
    plan = Plan(tpm=600)  # 10 tokens/s
    await a.admit("k", plan)
    await b.charge("k", plan, 650)  # 50 in debt, charged by the other worker
    with pytest.raises(ApiError) as e:
        await a.admit("k", plan)
    assert e.value.headers["Retry-After"] == "6"  # (50 + 1) / 10 -> 5.1 s -> 6
    clock.t += 6
    await a.admit("k", plan)
    await b.admit("other", plan)  # per principal


def test_full_buckets_free_their_slots():
    buckets = SharedBuckets(multiprocessing.get_context("spawn"), slots=4)
    for i in range(4):
        buckets.put(f"k{i}", 0.0, 10.0, full_at=20.0)
    assert buckets.get("k2", 15.0) == (0.0, 10.0)
    # At 25 every bucket is full again (as good as absent): a new key takes a slot and the
    # others read as new.
    buckets.put("new", 3.0, 25.0, full_at=30.0)
    assert buckets.get("new", 25.0) == (3.0, 25.0)
    # A full table of live buckets evicts the one closest to full, never refuses.
    for i in range(4):
        buckets.put(f"live{i}", 0.0, 40.0, full_at=100.0 + i)
    buckets.put("late", 0.0, 41.0, full_at=200.0)
    assert buckets.get("late", 41.0) == (0.0, 41.0)
    assert buckets.get("live0", 41.0) is None and buckets.get("live3", 41.0) is not None


def test_two_workers_gates_share_the_cap():
    pod = PodState(2)
    g0, g1 = Gate(2, PodSeat(pod, 0)), Gate(2, PodSeat(pod, 1))
    g0.admit()
    held = g1.admit()
    with pytest.raises(ApiError) as e:
        g0.admit()
    assert e.value.status == 429
    held.release()
    g0.admit()
    assert (g0.active, g1.active, pod.streams.value) == (2, 0, 2)
    held.release()  # a ticket gives its slot back once
    assert pod.streams.value == 2


def test_per_worker_control_gates_admit_each():
    pod = PodState(2, share_limits=False)
    g0, g1 = Gate(2, PodSeat(pod, 0)), Gate(2, PodSeat(pod, 1))
    for g in (g0, g0, g1, g1):
        g.admit()
    assert pod.streams.value == 0


async def test_drain_marks_the_worker_not_ready():
    pod = PodState(2)
    seats = [PodSeat(pod, i) for i in range(2)]
    for s in seats:
        s.set_ready(True)
    assert seats[1].waiting_for() == []
    await Gate(2, seats[0]).drain(0.1)
    assert seats[1].waiting_for() == [0]


def _take(state: PodState, n: int) -> None:
    seat = PodSeat(state, 1)
    for _ in range(n):
        assert seat.take_slot(10)


def test_slots_are_shared_across_processes():
    ctx = multiprocessing.get_context("spawn")
    pod = PodState(2, ctx=ctx)
    p = ctx.Process(target=_take, args=(pod, 3))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    seat = PodSeat(pod, 0)
    assert seat.active == 3
    assert [seat.take_slot(4), seat.take_slot(4)] == [True, False]
