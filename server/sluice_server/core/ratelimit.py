"""Per-key token buckets: requests per minute and tokens per minute.

Tokens are charged when known (prompt + completion, at the end of a stream), so the
token bucket may go into debt; a key in debt is refused until it refills. Retry-After is
the time until the bucket can admit again.
"""

from __future__ import annotations

import math
import time

from .errors import ApiError


class TokenBucket:
    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if now)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate


class RateLimiter:
    def __init__(self, rpm: int, tpm: int, clock=time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self._req: dict[str, TokenBucket] = {}
        self._tok: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def _bucket(self, table: dict[str, TokenBucket], key: str, per_minute: int, now: float):
        b = table.get(key)
        if b is None:
            b = table[key] = TokenBucket(per_minute, now)
        else:
            b.refill(now)
        return b

    def admit(self, key: str) -> None:
        """Take one request; raise 429 with Retry-After when a bucket is empty."""
        now = self.clock()
        waits = []
        req = self._bucket(self._req, key, self.rpm, now) if self.rpm else None
        tok = self._bucket(self._tok, key, self.tpm, now) if self.tpm else None
        if req is not None:
            waits.append(("requests", req.wait_for(1.0)))
        if tok is not None:
            # Admit while the key has any token budget left; usage is charged later.
            waits.append(("tokens", tok.wait_for(1.0)))
        blocked = [(what, w) for what, w in waits if w > 0]
        if blocked:
            what, wait = max(blocked, key=lambda x: x[1])
            retry = max(1, math.ceil(wait))
            raise ApiError(
                429,
                f"Rate limit exceeded ({what} per minute for this API key); retry after {retry} s.",
                reason="rate_limit",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry)},
            )
        if req is not None:
            req.level -= 1.0

    def charge_tokens(self, key: str, tokens: int) -> None:
        if self.tpm and tokens > 0:
            b = self._bucket(self._tok, key, self.tpm, self.clock())
            b.level -= tokens
