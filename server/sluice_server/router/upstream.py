"""One model's side of the activator: how many of its requests are held (bounded), and
whether a replica is ready, as `GET /ready` through its Service says.

Readiness is checked by one poll per model, shared by every request held for it, and only
while one is held: the first check at once, then with backoff from a tenth of
`--ready-poll-seconds` up to it. A 200 counts for a second (`FRESH`): requests arriving
just after it are forwarded without a check of their own; past that, or when a forwarded
request could not even connect (`down`: the replica went away again), the next request
checks again. Holding ends when the last held request is gone: the poll stops with it.

`Closing` is the activator's shutdown as held requests see it: after SIGTERM each waits at
most `--drain-timeout-seconds` more (its model may still come up), then gives up as at its
hold timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx

from .metrics import RouterMetrics
from .models import Model

log = logging.getLogger(__name__)
FRESH = 1.0  # seconds a ready answer stands for new requests


class Closing:
    def __init__(self) -> None:
        self.at = math.inf  # time.monotonic() when held requests give up; inf: not closing
        self._changed: asyncio.Future[None] | None = None

    @property
    def changed(self) -> asyncio.Future[None]:
        """Resolved when the shutdown begins: waiters then recompute their deadline."""
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def begin(self, seconds: float) -> None:
        if self.at == math.inf:
            self.at = time.monotonic() + seconds
            if not self.changed.done():
                self.changed.set_result(None)


class Upstream:
    def __init__(self, model: Model, client: httpx.AsyncClient, metrics: RouterMetrics,
                 poll: float, timeout: float, closing: Closing) -> None:  # fmt: skip
        self.model, self.client, self.poll, self.timeout = model, client, poll, timeout
        self.closing = closing
        self.held = 0
        self._gauge = metrics.held.labels(model.namespace, model.name)
        self._ready_at: float | None = None
        self._round: asyncio.Task[None] | None = None

    def hold(self) -> bool:
        """Count one more held request; False (and nothing counted) past `maxHeld`."""
        if self.held >= self.model.max_held:
            return False
        self.held += 1
        self._gauge.inc()
        return True

    def release(self) -> None:
        self.held -= 1
        self._gauge.dec()
        if self.held == 0 and self._round is not None and not self._round.done():
            self._round.cancel()  # nobody waits: no more checks

    def down(self) -> None:
        """A forwarded request could not connect: the next waiters check again."""
        self._ready_at = None

    async def wait_ready(self) -> None:
        """Return once a replica answered `/ready` with 200 (within `FRESH`)."""
        loop = asyncio.get_running_loop()
        if self._ready_at is not None and loop.time() - self._ready_at < FRESH:
            return
        if self._round is None or self._round.done():
            self._round = loop.create_task(self._check_until_ready())
        await asyncio.shield(self._round)

    async def _check_until_ready(self) -> None:
        delay = self.poll / 10
        loop = asyncio.get_running_loop()
        while True:
            url = f"{self.model.url}/ready"
            try:
                r = await self.client.get(url, timeout=self.timeout)
                if r.status_code == 200:
                    self._ready_at = loop.time()
                    log.info("%s: ready (%s)", self.model.key, url)
                    return
                log.debug("%s: not ready yet (%s answered %d)", self.model.key, url,
                          r.status_code)  # fmt: skip
            except httpx.HTTPError as e:
                log.debug("%s: not ready yet (%s: %s)", self.model.key, url, type(e).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll)
