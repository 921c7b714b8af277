"""Leader election on a `coordination.k8s.io/v1` Lease, and the fence every write checks.

Several operator replicas run; all of them watch and keep memory warm, only the holder of
the Lease writes. The rules are client-go's (`k8s.io/client-go/tools/leaderelection`):

- A candidate reads the Lease every `retry_period`. It takes the Lease when there is none,
  when it has no holder (a leader that shut down released it), or when the record has not
  changed for the record's `leaseDurationSeconds` *as measured on the candidate's own clock
  since it last saw the record change*: clocks of different machines are never compared.
  Every write of the Lease is a PUT with the resourceVersion it read, so of two candidates
  only one wins (the other gets 409 and stays a candidate).
- The leader renews every `retry_period`. It may write until `renew_deadline` after the
  start of its last successful renewal (`Elector.leading()`, read by every write). That
  start comes before the API server stored the renewal, which comes before any standby
  saw it, so a standby can take over no earlier than `lease_duration` after it:
  the fence closes `lease_duration - renew_deadline` (5 s by default) before the Lease can
  be taken, whatever happens to the leader's requests. The leader logs when it closes.
- Seeing another holder in the Lease closes the fence at once. A leader that lost the
  Lease becomes a candidate again (its watches never stopped); one that is shut down
  closes the fence first, then releases the Lease (no holder), so a standby takes over
  within one `retry_period` instead of a whole lease duration.

Why not `kubernetes.leaderelection` (the Python client's port): it sleeps with
`time.sleep` and reads `time.time` (no virtual time in tests; no stop other than killing
the thread), runs its callback once and returns after a loss (no way back to standby),
builds its `LeaseLock` on the client's global default configuration, exits the process
(`sys.exit`) on a bad setting, and has no fence: it calls `onstopped_leading` only after
its own renew loop gave up, which a hung request can delay past the point where another
replica holds the Lease, and nothing stops writes in between. This module keeps the same
Lease format and timing rules, on kopf's asyncio loop, with the store passed in.

Pure: no kopf and no API client (`cluster.KubeLeases` is the store the operator uses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

log = logging.getLogger("sluice_operator.election")

# client-go's JitterFactor: the renew deadline must leave room for more than one retry.
JITTER_FACTOR = 1.2


@dataclass(frozen=True)
class ElectionSettings:
    name: str
    namespace: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not (self.lease_duration > self.renew_deadline > JITTER_FACTOR * self.retry_period > 0):
            raise ValueError(
                "leader election needs lease duration > renew deadline > "
                f"{JITTER_FACTOR} x retry period > 0 (got {self.lease_duration:g} s, "
                f"{self.renew_deadline:g} s, {self.retry_period:g} s)"
            )
        if not self.identity or not self.name or not self.namespace:
            raise ValueError("leader election needs a Lease name, namespace and identity")


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec as the election reads and writes it (plus its resourceVersion)."""

    holder: str | None = None
    duration_seconds: int | None = None
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str | None = None

    def same_record(self, other: LeaseRecord | None) -> bool:
        """Unchanged for an observer: everything but the resourceVersion."""
        if other is None:
            return False
        mine = dataclasses.replace(self, resource_version=None)
        return mine == dataclasses.replace(other, resource_version=None)


class LeaseConflict(Exception):
    """Someone else created or changed the Lease first (HTTP 409): this write lost."""


class LeaseStore(Protocol):
    """One Lease object. Errors other than LeaseConflict (API down, 403) are exceptions."""

    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        """PUT with `record.resource_version`; LeaseConflict when it is stale."""
        ...


class AlwaysLeading:
    """Without `--leader-elect`: a single replica, always allowed to write."""

    def leading(self) -> bool:
        return True


def micro_time(at: datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """Campaigns for, holds and releases one Lease; `leading()` is the fence.

    `run()` is a coroutine for the operator's event loop: it never returns by itself
    (leader -> lost -> candidate -> leader...) and releases the Lease when cancelled.
    `on_started` runs when this replica becomes the leader, `on_stopped(reason)` when the
    fence closed; both on the loop, both must be quick.
    """

    def __init__(
        self,
        settings: ElectionSettings,
        store: LeaseStore,
        on_started: Callable[[], None] = lambda: None,
        on_stopped: Callable[[str], None] = lambda reason: None,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.settings = settings
        self._store = store
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._wall = wall_clock
        self._clock: Callable[[], float] | None = None  # the loop's clock, once running
        self._until = -math.inf  # the fence: writes allowed while clock() < _until
        self._observed: LeaseRecord | None = None
        self._observed_at = -math.inf
        self._standby_for: str | None = None  # holder last logged as the leader
        self.terms = 0  # how many times this replica became the leader

    # --- the fence (any thread) ----------------------------------------------------------
    def leading(self) -> bool:
        clock = self._clock
        return clock is not None and clock() < self._until

    def seconds_left(self) -> float:
        clock = self._clock
        return max(0.0, self._until - clock()) if clock is not None else 0.0

    @property
    def holder(self) -> str | None:
        """The holder as last read from the Lease."""
        return self._observed.holder if self._observed else None

    # --- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        self._clock = asyncio.get_running_loop().time
        s = self.settings
        log.info(
            f"leader election: {s.identity} campaigns for Lease {s.namespace}/{s.name} "
            f"(lease {s.lease_duration:g} s, renew deadline {s.renew_deadline:g} s, "
            f"retry {s.retry_period:g} s)"
        )
        try:
            while True:
                await self._campaign()
                self.terms += 1
                log.info(f"leader election: {s.identity} is the leader: reconciling")
                self._on_started()
                reason = await self._hold()
                log.warning(
                    f"leader election: {s.identity} stopped writing: {reason}; "
                    "back to standby (watches stay warm)"
                )
                self._on_stopped(reason)
        except asyncio.CancelledError:
            await asyncio.shield(self._release())
            raise

    async def _campaign(self) -> None:
        while True:
            if await self._try(within=self.settings.renew_deadline):
                return
            holder = self.holder
            if holder and holder not in (self._standby_for, self.settings.identity):
                log.info(f"leader election: standby; the leader is {holder}")
                self._standby_for = holder
            await asyncio.sleep(self.settings.retry_period)

    async def _hold(self) -> str:
        """Renew until the fence closes; returns why it closed."""
        s = self.settings
        while True:
            await asyncio.sleep(min(s.retry_period, self.seconds_left()))
            while True:
                if not self.leading():
                    return (
                        f"could not renew Lease {s.namespace}/{s.name} within the renew "
                        f"deadline ({s.renew_deadline:g} s); it can be taken "
                        f"{s.lease_duration - s.renew_deadline:g} s from now at the earliest"
                    )
                if await self._try(within=self.seconds_left()):
                    break
                holder = self.holder
                if holder and holder != s.identity:
                    self._until = -math.inf
                    return f"Lease {s.namespace}/{s.name} is held by {holder}"
                await asyncio.sleep(min(s.retry_period, self.seconds_left()))

    async def _try(self, within: float) -> bool:
        """One acquire-or-renew attempt (client-go's tryAcquireOrRenew)."""
        assert self._clock is not None
        s = self.settings
        started = self._clock()
        try:
            async with asyncio.timeout(within):
                current = await self._store.get()
                now = micro_time(self._wall())
                if current is None:
                    wanted = LeaseRecord(s.identity, int(s.lease_duration), now, now, 0)
                    stored = await self._store.create(wanted)
                else:
                    self._observe(current)
                    ours = current.holder == s.identity
                    if current.holder and not ours and not self._expired(current):
                        return False
                    wanted = dataclasses.replace(
                        current,
                        holder=s.identity,
                        duration_seconds=int(s.lease_duration),
                        acquire_time=current.acquire_time if ours else now,
                        renew_time=now,
                        transitions=current.transitions + (0 if ours else 1),
                    )
                    stored = await self._store.update(wanted)
        except LeaseConflict:
            return False
        except TimeoutError:
            log.info(f"leader election: Lease {s.namespace}/{s.name}: no answer in {within:.1f} s")
            return False
        except Exception as exc:  # API down, 403: the next attempt retries
            log.info(f"leader election: Lease {s.namespace}/{s.name}: {type(exc).__name__}: {exc}")
            return False
        self._observe(stored)
        self._until = started + s.renew_deadline
        return True

    def _observe(self, record: LeaseRecord) -> None:
        assert self._clock is not None
        if not record.same_record(self._observed):
            self._observed_at = self._clock()
        self._observed = record

    def _expired(self, record: LeaseRecord) -> bool:
        assert self._clock is not None
        duration = record.duration_seconds or self.settings.lease_duration
        return self._observed_at + duration <= self._clock()

    async def _release(self) -> None:
        """Shutting down: close the fence, then give the Lease up if we still hold it."""
        was_leading = self.leading()
        self._until = -math.inf
        if not was_leading:
            return
        s = self.settings
        try:
            async with asyncio.timeout(s.retry_period):
                current = await self._store.get()
                if current is None or current.holder != s.identity:
                    return
                now = micro_time(self._wall())
                await self._store.update(
                    dataclasses.replace(current, holder=None, duration_seconds=1, renew_time=now)
                )
            log.info(f"leader election: {s.identity} released Lease {s.namespace}/{s.name}")
        except (Exception, TimeoutError) as exc:  # the Lease then expires on its own
            log.info(f"leader election: could not release Lease {s.namespace}/{s.name}: {exc}")
