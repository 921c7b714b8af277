"""Per-principal token buckets: requests per minute and tokens per minute, in this process
(`memory`: with several worker processes, in the pod's shared memory) or shared by every
replica (`redis`).

One request takes one token from the rpm bucket; prompt + completion tokens are charged to
the tpm bucket when known (the end of a stream), so that bucket may go into debt, and a
principal in debt is refused until it refills. Retry-After is the time until the bucket can
admit again. Both backends implement exactly these semantics; the Redis one runs them in one
server-side Lua script (atomic, no locks across processes, Redis's own clock so replicas'
clocks need not agree).

When Redis cannot be reached the limiter follows `failure_mode`: `open` admits (counted in
`sluice_rate_limit_backend_errors_total`, one log line per `LOG_EVERY_SECONDS`), `closed`
refuses with 503 and Retry-After. After a failure Redis is left alone for `BACKOFF_SECONDS`
(those requests take the failure path at once), then tried again: recovery needs nobody.
No call waits on Redis longer than the client's socket timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..auth.identity import Plan
from ..errors import ApiError
from ..telemetry.metrics import Metrics
from .shared_memory import PodState

log = logging.getLogger(__name__)

FailureMode = Literal["open", "closed"]
BACKOFF_SECONDS = 1.0
LOG_EVERY_SECONDS = 30.0


def refused(what: str, wait: float) -> ApiError:
    retry = max(1, math.ceil(wait))
    return ApiError(
        429,
        f"Rate limit exceeded ({what} per minute for this credential); retry after {retry} s.",
        reason="rate_limit",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry)},
    )


def _verdict(wait_requests: float, wait_tokens: float) -> None:
    """Raise 429 for the longer wait, if any."""
    if wait_requests <= 0 and wait_tokens <= 0:
        return
    if wait_requests >= wait_tokens:
        raise refused("requests", wait_requests)
    raise refused("tokens", wait_tokens)


class Limiter(Protocol):
    async def admit(self, principal: str, plan: Plan) -> None:
        """Take one request, or raise 429 (or 503 when the shared store fails closed)."""

    async def charge(self, principal: str, plan: Plan, tokens: int) -> None:
        """Charge tokens used (never raises)."""

    async def close(self) -> None: ...


class TokenBucket:
    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float, per_minute: int) -> None:
        # A plan may change (key file reloaded): the new size applies from now on.
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if now)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate


class MemoryLimiter:
    """The buckets in this pod: each replica limits on its own. With several worker
    processes the buckets live in the pod's shared memory (`pod`), so the workers limit
    together; without, in this process."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, pod: PodState | None = None
    ) -> None:
        self.clock = clock
        self.pod = pod
        self._local: dict[str, TokenBucket] = {}

    def _bucket(self, key: str, per_minute: int, now: float) -> TokenBucket:
        if self.pod is None:
            b = self._local.get(key)
            if b is None:
                b = self._local[key] = TokenBucket(per_minute, now)
            else:
                b.refill(now, per_minute)
            return b
        b = TokenBucket(per_minute, now)
        stored = self.pod.buckets.get(key, now)
        if stored is not None:
            b.level, b.stamp = stored
            b.refill(now, per_minute)
        return b

    def _store(self, key: str, b: TokenBucket) -> None:
        if self.pod is not None:
            self.pod.buckets.put(key, b.level, b.stamp, b.stamp + b.wait_for(b.capacity))

    def _locked(self) -> contextlib.AbstractContextManager[Any]:
        return self.pod.lock if self.pod is not None else contextlib.nullcontext()

    async def admit(self, principal: str, plan: Plan) -> None:
        with self._locked():
            now = self.clock()
            req = self._bucket(principal + ":r", plan.rpm, now) if plan.rpm else None
            tok = self._bucket(principal + ":t", plan.tpm, now) if plan.tpm else None
            # Admit while the principal has any token budget left; usage is charged later.
            _verdict(req.wait_for(1.0) if req else 0.0, tok.wait_for(1.0) if tok else 0.0)
            if req is not None:
                req.level -= 1.0
                self._store(principal + ":r", req)
            if tok is not None:
                self._store(principal + ":t", tok)

    async def charge(self, principal: str, plan: Plan, tokens: int) -> None:
        if plan.tpm and tokens > 0:
            with self._locked():
                b = self._bucket(principal + ":t", plan.tpm, self.clock())
                b.level -= tokens
                self._store(principal + ":t", b)

    async def close(self) -> None:
        pass


# KEYS: the rpm bucket, the tpm bucket. ARGV: rpm, tpm, requests to take (0 or 1), tokens
# to charge. Each bucket is a hash {level, stamp} that expires once it would be full again.
# Returns {admitted (0/1), milliseconds until a request fits, until a token fits}.
BUCKET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function load(key, per_minute)
  local rate = per_minute / 60.0
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local level, stamp = tonumber(v[1]), tonumber(v[2])
  if level == nil then level, stamp = per_minute, now end
  level = math.min(per_minute, level + math.max(0, now - stamp) * rate)
  return level, rate
end
local function store(key, per_minute, level, rate)
  redis.call('HSET', key, 'level', tostring(level), 'stamp', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((per_minute - level) / rate * 1000) + 1000)
end
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local take, charge = tonumber(ARGV[3]), tonumber(ARGV[4])
local rl, rr, tl, tr
local wait_r, wait_t = 0, 0
if rpm > 0 then
  rl, rr = load(KEYS[1], rpm)
  if take > 0 and rl < 1 then wait_r = (1 - rl) / rr end
end
if tpm > 0 then
  tl, tr = load(KEYS[2], tpm)
  if take > 0 and tl < 1 then wait_t = (1 - tl) / tr end
end
local admitted = (wait_r == 0 and wait_t == 0) and 1 or 0
if rpm > 0 and admitted == 1 and take > 0 then store(KEYS[1], rpm, rl - 1, rr) end
if tpm > 0 and charge > 0 then store(KEYS[2], tpm, tl - charge, tr) end
return {admitted, math.ceil(wait_r * 1000), math.ceil(wait_t * 1000)}
"""


class RedisLimiter:
    """The buckets in Redis, shared by every replica that names the same Redis and model."""

    def __init__(
        self,
        url: str,
        model: str,
        metrics: Metrics,
        failure_mode: FailureMode,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisError

        # No retries inside the client: a request must not wait on Redis more than once;
        # the backoff below decides when to try again.
        self.client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self.script = self.client.register_script(BUCKET_SCRIPT)
        self.prefix = f"sluice:rl:{model}:"
        self.metrics, self.failure_mode = metrics, failure_mode
        self.timeout, self.clock = timeout, clock
        self.down_until = 0.0
        self._errors = (OSError, TimeoutError, RedisError)
        self._last_log = -math.inf
        self._unlogged = 0

    async def _run(self, principal: str, plan: Plan, take: int, charge: int) -> Any:
        keys = (self.prefix + principal + ":r", self.prefix + principal + ":t")
        # The socket timeout bounds each read; this bounds connect + script load too.
        async with asyncio.timeout(self.timeout * 3):
            return await self.script(keys=keys, args=(plan.rpm, plan.tpm, take, charge))

    async def _call(
        self, op: str, principal: str, plan: Plan, take: int, charge: int
    ) -> list[int] | None:
        """The script's answer, or None when Redis is down (counted and logged)."""
        if self.clock() < self.down_until:
            self._failed(op, None)
            return None
        try:
            answer: list[int] = await self._run(principal, plan, take, charge)
        except self._errors as e:
            self.down_until = self.clock() + BACKOFF_SECONDS
            self._failed(op, e)
            return None
        if self.down_until:
            self.down_until = 0.0
            log.warning("rate limit store reachable again; limiting resumes")
        return answer

    def _failed(self, op: str, e: BaseException | None) -> None:
        self.metrics.limiter_errors.labels(self.metrics.model, op).inc()
        now = self.clock()
        if now - self._last_log < LOG_EVERY_SECONDS:
            self._unlogged += 1
            return
        what = f"{type(e).__name__}: {e}" if e is not None else "still backing off"
        log.warning(
            "rate limit store unreachable (%s); failing %s for %s%s",
            what,
            self.failure_mode,
            op,
            f" ({self._unlogged} more since the last line)" if self._unlogged else "",
        )
        self._last_log, self._unlogged = now, 0

    async def admit(self, principal: str, plan: Plan) -> None:
        answer = await self._call("admit", principal, plan, 1, 0)
        if answer is None:
            if self.failure_mode == "closed":
                retry = max(1, math.ceil(self.down_until - self.clock()))
                raise ApiError(
                    503,
                    "Rate limits cannot be checked right now; retry shortly.",
                    reason="limiter_unavailable",
                    code="rate_limit_unavailable",
                    headers={"Retry-After": str(retry)},
                )
            return
        admitted, wait_r, wait_t = (int(x) for x in answer)
        if not admitted:
            _verdict(wait_r / 1000, wait_t / 1000)

    async def charge(self, principal: str, plan: Plan, tokens: int) -> None:
        if plan.tpm and tokens > 0:
            await self._call("charge", principal, plan, 0, tokens)

    async def close(self) -> None:
        await self.client.aclose()
