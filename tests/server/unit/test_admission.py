"""The admission queue's policy (core/limits/queue.py) on its own, on a virtual clock: the
bound, priority order and shedding, tenant shares by virtual time and by slots, timeouts,
leaving and draining; and two workers' queues on one pod table, woken across by its pipes."""

from __future__ import annotations

import asyncio

import pytest
from sluice_server.core.auth.identity import Plan, Principal, Priorities
from sluice_server.core.errors import ApiError
from sluice_server.core.limits.queue import Admission
from sluice_server.core.limits.shared_memory import PodState, QueueShape

CLASSES = Priorities(("high", "low"))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def caller(tenant: str = "a", priority: str = "low", weight: int = 1) -> Principal:
    return Principal(f"id-{tenant}-{priority}", tenant, Plan(), priority, weight)


def queue(slots: int, size: int, **kw) -> Admission:
    kw = {"timeout": 30.0, "priorities": CLASSES, "clock": Clock(), **kw}
    return Admission.local(QueueShape(slots, size, len(kw["priorities"].names)), **kw)


def held(adm: Admission, tenant: str) -> int:
    return adm.t.t_held[adm.t.tenant_row(tenant)]


def end_one(tickets: list) -> None:
    """The first admitted stream among `tickets` ends."""
    running = next(t for t in tickets if t.admitted)
    running.release()


async def test_bound_is_exact_and_the_refusal_says_when_to_come_back():
    adm = queue(2, 3)
    tickets = [adm.enter(caller()) for _ in range(5)]
    assert [t.admitted for t in tickets] == [True, True, False, False, False]
    with pytest.raises(ApiError) as e:
        adm.enter(caller())
    assert (e.value.status, e.value.code) == (429, "queue_full")
    assert e.value.headers["Retry-After"] == "30"  # nothing drained yet: the timeout
    # One slot per second freed for a while: Retry-After = waiting ahead / drain rate.
    for _ in range(20):
        adm.clock.t += 1.0
        tickets.pop(0).release()
        tickets.append(adm.enter(caller()))
    with pytest.raises(ApiError) as e:
        adm.enter(caller())
    assert e.value.headers["Retry-After"] == "4"  # (3 waiting + 1) / about 1 freed per s
    assert adm.depth == 3 and adm.t.held.value == 2


async def test_free_slots_go_by_priority_then_arrival():
    adm = queue(1, 10)
    first = adm.enter(caller())
    low1, high, low2 = (adm.enter(caller(priority=p)) for p in ("low", "high", "low"))
    order = []
    for _ in range(3):
        first.release()
        first = next(t for t in (low1, high, low2) if t.admitted and t not in order)
        order.append(first)
    assert order == [high, low1, low2]


async def test_a_full_queue_sheds_the_lowest_priority_never_a_stream():
    adm = queue(1, 2)
    streaming = adm.enter(caller(priority="low"))
    waiting = [adm.enter(caller(priority="low")) for _ in range(2)]
    urgent = adm.enter(caller(priority="high"))  # displaces the newest low one
    assert urgent.waiting and waiting[0].waiting and not waiting[1].waiting
    with pytest.raises(ApiError) as e:
        await waiting[1].wait()
    assert (e.value.status, e.value.code) == (429, "queue_full")
    with pytest.raises(ApiError):  # a low one more is refused, the queue holds high and low
        adm.enter(caller(priority="low"))
    assert streaming.admitted and adm.depth == 2


async def test_a_full_queue_makes_room_for_a_tenant_below_its_share_of_places():
    adm = queue(1, 3)
    adm.enter(caller("a"))
    flood = [adm.enter(caller("a")) for _ in range(3)]
    steady = adm.enter(caller("b"))  # same priority, fewer places per weight: a's newest goes
    assert steady.waiting and [t.waiting for t in flood] == [True, True, False]
    with pytest.raises(ApiError):
        adm.enter(caller("a"))  # a's own newcomer never displaces a's own


async def test_within_a_priority_the_tenant_with_less_virtual_time_goes_first():
    adm = queue(1, 10, sharing=False)
    running = adm.enter(caller("a"))
    a_next = adm.enter(caller("a"))
    b_next = adm.enter(caller("b"))  # arrived later
    running.charge(500)  # a's stream generated 500 tokens: a's virtual time is ahead
    running.release()
    assert b_next.admitted and a_next.waiting


async def test_virtual_time_is_tokens_over_weight():
    adm = queue(1, 10, sharing=False)
    running = adm.enter(caller("a", weight=4))
    b_next, a_next = adm.enter(caller("b", weight=1)), adm.enter(caller("a", weight=4))
    running.charge(300)  # a: 300 / 4 = 75
    adm.charge(adm.t.tenant_row("b"), "b", 100)  # b: 100 / 1 = 100, though b arrived first
    running.release()
    assert a_next.admitted and b_next.waiting


async def test_a_tenant_that_was_idle_gets_no_credit_for_it():
    adm = queue(1, 10, sharing=False, window=0.0)
    t = adm.enter(caller("a"))
    t.charge(1000)
    t.release()  # a idle; b busy for a long time, then a returns
    b = adm.enter(caller("b"))
    b.charge(5000)
    a_again = adm.enter(caller("a"))
    row_a, row_b = adm.t.tenant_row("a"), adm.t.tenant_row("b")
    assert adm.t.t_vt[row_a] == adm.t.t_vt[row_b] == 5000  # joins at the active minimum
    assert a_again.waiting


async def test_a_flooding_tenant_leaves_a_slot_for_an_active_steady_one():
    adm = queue(4, 50)
    adm.enter(caller("b")).release()  # b is active (seen within the window)
    flood = [adm.enter(caller("a")) for _ in range(10)]
    assert sum(t.admitted for t in flood) == 3  # one slot kept free for b
    steady = adm.enter(caller("b"))
    assert steady.admitted  # at once, not after one of a's streams
    running = [t for t in flood if t.admitted]
    running[0].release()  # b now holds 1 < its share 2: the freed slot stays b's headroom
    assert held(adm, "a") == 2 and adm.depth == 7
    steady.release()  # b holds nothing: a may borrow all but b's one slot again
    assert held(adm, "a") == 3


async def test_the_headroom_is_what_the_steady_tenant_held_at_once_lately():
    adm = queue(8, 50, window=20.0)
    overlapping = [adm.enter(caller("b")) for _ in range(2)]  # b held two slots at once
    for t in overlapping:
        t.release()
    flood = [adm.enter(caller("a")) for _ in range(20)]
    assert held(adm, "a") == 6  # two slots kept for b, its recent peak
    again = [adm.enter(caller("b")) for _ in range(2)]
    assert all(t.admitted for t in again)  # both at once
    for t in again:
        t.release()
    adm.clock.t += 21  # b not seen for longer than the window: nobody else asks
    end_one(flood)
    assert held(adm, "a") == 8  # the slack is lent
    late = adm.enter(caller("b"))
    assert late.waiting  # no stream is ever preempted: b waits for one of a's to end
    end_one(flood)
    assert late.admitted and held(adm, "a") == 7
    end_one(flood)
    assert held(adm, "a") == 6  # b's peak is now 1: one more slot kept for it


async def test_control_without_slot_sharing_the_flood_takes_every_slot():
    adm = queue(4, 50, sharing=False)
    adm.enter(caller("b")).release()
    flood = [adm.enter(caller("a")) for _ in range(10)]
    assert sum(t.admitted for t in flood) == 4
    assert adm.enter(caller("b")).waiting


async def test_when_the_other_tenant_goes_quiet_the_slack_is_lent():
    adm = queue(4, 50, window=5.0)
    adm.enter(caller("b")).release()
    flood = [adm.enter(caller("a")) for _ in range(10)]
    assert sum(t.admitted for t in flood) == 3
    adm.clock.t += 6  # b not seen for longer than the window: a's share is every slot
    flood.append(adm.enter(caller("a")))
    assert held(adm, "a") == 4


async def test_both_backlogged_slots_follow_the_weights():
    adm = queue(8, 100)
    tickets = {"a": [], "b": []}
    for _ in range(20):
        for tenant, weight in (("a", 3), ("b", 1)):
            tickets[tenant].append(adm.enter(caller(tenant, weight=weight)))
    # While the queue filled, b borrowed past its share (a had not asked for all of its
    # own yet); no slot is taken back, so the shares come as b's streams end.
    for step in range(200):  # streams end one at a time, each tenant's in turn
        tenant = "ab"[step % 2]
        running = [t for t in tickets[tenant] if t.admitted]
        if running:
            running[0].charge(64)
            running[0].release()
            tickets[tenant].remove(running[0])
        weight = 3 if tenant == "a" else 1
        tickets[tenant].append(adm.enter(caller(tenant, weight=weight)))
        if step >= 10:
            assert (held(adm, "a"), held(adm, "b")) in ((6, 2), (5, 2), (6, 1)), step


async def test_timeout_refuses_with_retry_after():
    adm = queue(1, 4, timeout=0.2)
    adm.enter(caller())
    waiting = adm.enter(caller())
    with pytest.raises(ApiError) as e:
        await waiting.wait()
    assert (e.value.status, e.value.code) == (429, "queue_timeout")
    assert int(e.value.headers["Retry-After"]) >= 1 and waiting.waited >= 0.2
    assert adm.depth == 0


async def test_a_timer_run_early_refuses_no_sooner_than_the_timeout():
    """An event loop may run a timer a clock tick early (uvloop's are whole milliseconds):
    the refusal waits for the ticket's own clock to pass the timeout."""
    adm = queue(1, 4, timeout=0.3)
    adm.enter(caller())
    waiting = adm.enter(caller())
    task = asyncio.ensure_future(waiting.wait())
    await asyncio.sleep(0)  # it is watched: its timer is armed
    waiting.timer.cancel()
    adm._expire(waiting)  # the loop runs its timer now, 0.3 s early
    await asyncio.sleep(0)
    assert not task.done() and adm.depth == 1
    with pytest.raises(ApiError) as e:
        await task
    assert e.value.code == "queue_timeout" and waiting.waited >= 0.3


async def test_leaving_frees_the_place_at_once():
    adm = queue(1, 1)
    running = adm.enter(caller())
    gone = adm.enter(caller())
    gone.release()  # the client went away while it waited
    assert adm.depth == 0
    nxt = adm.enter(caller())  # its place is free: queued, not refused
    running.release()
    assert nxt.admitted and not gone.admitted


async def test_drain_refuses_every_waiting_request_with_503():
    adm = queue(1, 4)
    running = adm.enter(caller())
    waiting = [adm.enter(caller()) for _ in range(3)]
    assert adm.refuse_waiting() == 3
    for t in waiting:
        with pytest.raises(ApiError) as e:
            await t.wait()
        assert (e.value.status, e.value.code) == (503, "draining")
    assert running.admitted and adm.depth == 0


async def test_two_workers_share_one_queue_and_wake_each_other():
    pod = PodState(2, queue=QueueShape(1, 2, 2))
    kw = {"timeout": 30.0, "priorities": CLASSES, "wake": pod.wake}
    w0, w1 = (Admission(pod.queue, pod.lock, i, **kw) for i in (0, 1))
    running = w1.enter(caller())
    on_w0 = w0.enter(caller())
    on_w1 = w1.enter(caller())
    with pytest.raises(ApiError):  # the pod's bound, whichever worker is asked
        w0.enter(caller())
    running.release()  # worker 1 frees a slot: worker 0's request waited longest
    await asyncio.wait_for(on_w0.wait(), 5)  # delivered through worker 0's wake-up pipe
    assert on_w0.admitted and on_w1.waiting and pod.queue.held.value == 1
