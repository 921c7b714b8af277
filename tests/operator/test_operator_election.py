"""Leader election (`election.Elector`) against a fake Lease API, in virtual time.

The fake is one Lease with resourceVersions (a PUT with a stale one is a conflict, as on a
real API server) and, per replica, a connection that can be cut (refused or never
answered). Virtual time (`testkit.clock`) makes the timing rules exact: lease duration,
renew deadline and retry period are the defaults (15 / 10 / 2 s), and a test of "the fence
closes before the Lease can be taken" compares the instants themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from sluice_operator.election import (
    ElectionSettings,
    Elector,
    LeaseConflict,
    LeaseRecord,
    micro_time,
)
from testkit.clock import run_in_virtual_time

LATENCY = 0.01  # one request's round trip


class LeaseServer:
    """The API server's side: one Lease, its resourceVersion, who called what when."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.revision = 0
        self.calls: list[tuple[float, str, str]] = []  # (time, replica, verb)

    def store(self, record: LeaseRecord) -> LeaseRecord:
        self.revision += 1
        self.record = dataclasses.replace(record, resource_version=str(self.revision))
        return self.record


class FakeLeases:
    """One replica's connection to the LeaseServer: `down` refuses, `hang` never answers."""

    def __init__(self, server: LeaseServer, replica: str) -> None:
        self.server, self.replica = server, replica
        self.down = False
        self.hang = False

    async def _reach(self, verb: str) -> None:
        await asyncio.sleep(LATENCY / 2)
        if self.hang:
            await asyncio.sleep(10**6)
        if self.down:
            raise ConnectionRefusedError("connection refused")
        self.server.calls.append((asyncio.get_running_loop().time(), self.replica, verb))

    async def get(self) -> LeaseRecord | None:
        await self._reach("get")
        record = self.server.record
        await asyncio.sleep(LATENCY / 2)
        return record

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        await self._reach("create")
        if self.server.record is not None:
            raise LeaseConflict("already exists")
        stored = self.server.store(record)
        await asyncio.sleep(LATENCY / 2)
        return stored

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        await self._reach("update")
        current = self.server.record
        if current is None or current.resource_version != record.resource_version:
            raise LeaseConflict("the object has been modified")
        stored = self.server.store(record)
        await asyncio.sleep(LATENCY / 2)
        return stored


class Replica:
    """An Elector with its connection, what it was told, and when it could write."""

    def __init__(self, server: LeaseServer, name: str, **timing: float) -> None:
        self.name = name
        self.leases = FakeLeases(server, name)
        self.started: list[float] = []
        self.stopped: list[tuple[float, str]] = []
        settings = ElectionSettings("sluice-operator", "sluice-system", name, **timing)
        self.elector = Elector(
            settings, self.leases, on_started=self._started, on_stopped=self._stopped
        )
        self.task: asyncio.Task | None = None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _started(self) -> None:
        self.started.append(self._now())

    def _stopped(self, reason: str) -> None:
        self.stopped.append((self._now(), reason))

    def start(self) -> Replica:
        self.task = asyncio.get_running_loop().create_task(self.elector.run())
        return self

    async def shut_down(self) -> None:
        """SIGTERM: the task is cancelled (the Lease is released)."""
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def kill(self) -> None:
        """SIGKILL: nothing more leaves the process, no release."""
        self.leases.down = True
        await self.shut_down()


async def _sample(replicas: list[Replica], seconds: float, step: float = 0.05) -> list[set[str]]:
    """Who could write, every `step` of virtual time."""
    seen = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        seen.append({r.name for r in replicas if r.elector.leading()})
        await asyncio.sleep(step)
    return seen


def _run(main):
    return run_in_virtual_time(main())


def test_one_candidate_takes_a_missing_lease_at_once():
    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(0.1)
        assert a.elector.leading() and a.started == [pytest.approx(LATENCY, abs=0.01)]
        assert server.record.holder == "a" and server.record.duration_seconds == 15
        assert server.record.transitions == 0
        renewals_before = sum(1 for _, _, v in server.calls if v == "update")
        await asyncio.sleep(20)
        renewals = sum(1 for _, _, v in server.calls if v == "update") - renewals_before
        assert 9 <= renewals <= 10  # every retry period (2 s) plus a request's round trip
        assert a.elector.leading() and not a.stopped
        await a.shut_down()

    _run(main)


def test_two_candidates_one_writer_at_every_instant():
    async def main():
        server = LeaseServer()
        replicas = [Replica(server, "a").start(), Replica(server, "b").start()]
        seen = await _sample(replicas, 60)
        assert all(len(s) <= 1 for s in seen)
        assert sum(1 for s in seen if s) >= len(seen) - 2  # someone leads from the start
        assert sorted(len(r.started) for r in replicas) == [0, 1]
        for r in replicas:
            await r.shut_down()

    _run(main)


def test_only_get_create_and_update_are_used():
    """What the chart's RBAC grants on leases (tests/chart checks the grant)."""

    async def main():
        server = LeaseServer()
        a, b = Replica(server, "a").start(), Replica(server, "b").start()
        await asyncio.sleep(30)
        await a.shut_down()
        await asyncio.sleep(5)
        await b.shut_down()
        assert {verb for _, _, verb in server.calls} == {"get", "create", "update"}

    _run(main)


def test_killed_leader_is_replaced_within_lease_duration_plus_a_retry():
    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(0.5)
        b = Replica(server, "b").start()
        await asyncio.sleep(7)
        last_renewal = max(t for t, who, verb in server.calls if who == "a" and verb == "update")
        await a.kill()
        await asyncio.sleep(30)
        (took_over,) = b.started
        # b measures 15 s from when it saw a's last renewal, and looks every 2 s.
        assert 15 <= took_over - last_renewal <= 15 + 2 + 3 * LATENCY
        assert server.record.holder == "b" and server.record.transitions == 1
        await b.shut_down()

    _run(main)


@pytest.mark.parametrize("cut", ["hang", "down"])
def test_cut_off_leader_stops_writing_before_the_lease_can_be_taken(cut, caplog):
    """The leader loses the API server (no answer, or refused) but keeps running: its fence
    closes `renew deadline` after its last renewal started, it logs so, and the standby
    takes the Lease no earlier than `lease duration` after that renewal: 5 s later."""

    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(0.5)
        b = Replica(server, "b").start()
        await asyncio.sleep(7)
        renewals = [t for t, who, verb in server.calls if who == "a" and verb == "get"]
        setattr(a.leases, cut, True)
        seen = await _sample([a, b], 40, step=0.01)
        assert all(len(s) <= 1 for s in seen)
        (fence, reason), *_ = a.stopped
        last_start = max(t for t in renewals if t < fence) - LATENCY / 2
        assert fence == pytest.approx(last_start + 10, abs=0.02)
        assert "renew deadline (10 s)" in reason
        (took_over,) = b.started
        assert took_over - fence >= 5 - 0.02
        assert not a.elector.leading() and server.record.holder == "b"
        await a.shut_down()
        await b.shut_down()

    with caplog.at_level(logging.INFO, logger="sluice_operator.election"):
        _run(main)
    assert any("a stopped writing: could not renew" in r.getMessage() for r in caplog.records)


def test_leader_that_sees_another_holder_stops_at_once():
    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(1)
        # Someone (a hand edit, a replica with a slow clock) took the Lease.
        server.store(dataclasses.replace(server.record, holder="intruder"))
        await asyncio.sleep(2.5)
        assert not a.elector.leading()
        ((_, reason),) = a.stopped
        assert "held by intruder" in reason
        await a.shut_down()

    _run(main)


def test_shut_down_leader_releases_and_the_standby_takes_over_within_a_retry():
    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(0.5)
        b = Replica(server, "b").start()
        await asyncio.sleep(5)
        stopped_at = asyncio.get_running_loop().time()
        await a.shut_down()
        assert not a.elector.leading()
        assert server.record.holder is None and server.record.duration_seconds == 1
        await asyncio.sleep(5)
        (took_over,) = b.started
        assert took_over - stopped_at <= 2 + 3 * LATENCY
        await b.shut_down()

    _run(main)


def test_a_leader_that_lost_becomes_a_standby_and_can_lead_again():
    async def main():
        server = LeaseServer()
        a = Replica(server, "a").start()
        await asyncio.sleep(1)
        a.leases.down = True
        await asyncio.sleep(12)
        assert not a.elector.leading() and len(a.stopped) == 1
        a.leases.down = False  # nobody else took it meanwhile: a renews its own Lease
        await asyncio.sleep(3)
        assert a.elector.leading() and a.elector.terms == 2
        await a.shut_down()

    _run(main)


def test_simultaneous_candidates_on_a_free_lease_one_wins():
    async def main():
        server = LeaseServer()
        server.store(LeaseRecord(holder=None, duration_seconds=1, transitions=3))
        replicas = [Replica(server, n).start() for n in "abc"]
        await asyncio.sleep(0.5)
        assert [r.name for r in replicas if r.elector.leading()] == [server.record.holder]
        assert server.record.transitions == 4
        for r in replicas:
            await r.shut_down()

    _run(main)


def test_nobody_leads_before_running_or_with_a_held_lease():
    async def main():
        server = LeaseServer()
        server.store(LeaseRecord("other", 15, "t", "t"))
        b = Replica(server, "b")
        assert not b.elector.leading()  # not started
        b.start()
        await asyncio.sleep(14)  # the record never changes: 15 s from b's first look
        assert not b.elector.leading()
        await asyncio.sleep(3)
        assert b.elector.leading() and server.record.transitions == 1
        await b.shut_down()

    _run(main)


@pytest.mark.parametrize(
    "timing",
    [
        {"lease_duration": 10, "renew_deadline": 10},
        {"renew_deadline": 2, "retry_period": 2},
        {"retry_period": 0},
    ],
)
def test_settings_that_cannot_be_safe_are_refused(timing):
    with pytest.raises(ValueError, match="lease duration > renew deadline"):
        ElectionSettings("n", "ns", "me", **timing)


def test_lease_times_are_micro_times():
    from datetime import UTC, datetime

    assert micro_time(datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)) == "2026-01-02T03:04:05.000006Z"
