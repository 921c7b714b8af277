"""One pod's KV-event feed into its model's prefix index.

A `KvFeed` runs a `kvcache.kvevents.Subscriber` on the pod's PUB endpoint (with its replay
endpoint) and applies what it hands over to the `PrefixIndex`, in order:

- a batch: the pod's feed is live (`feed(live=True)`: precise scoring from now), then
  `BlockStored` -> `stored`, `BlockRemoved` -> `removed`, `AllBlocksCleared` -> `cleared`;
- a `Reset` (events were lost, or the publisher restarted): `feed(live=False)`, which
  empties the precise set; the pod is scored from what the router sent it until the next
  batch makes the feed live again.

The feed is not live until the pod's first batch arrives (the subscriber then catches up
from the replay buffer): until then, the approximate index places its requests.

A subscriber that fails (an error in its socket loop, a message it cannot decode past what
`Subscriber` already absorbs) takes the feed down, not the router: the pod is scored from
the approximate index, one WARNING is logged, and a fresh subscriber follows the pod after
`RETRY_FIRST` seconds, doubling up to `RETRY_MAX` while failures repeat (a batch applied
resets the wait).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..kvcache import kvevents
from .prefixindex import PrefixIndex

log = logging.getLogger(__name__)

SubscriberFactory = Callable[[str, str, str | None], kvevents.Subscriber]
RETRY_FIRST, RETRY_MAX = 1.0, 30.0


def subscriber(pod: str, endpoint: str, replay: str | None) -> kvevents.Subscriber:
    return kvevents.Subscriber(pod, endpoint, replay_endpoint=replay)


def apply(index: PrefixIndex, update: kvevents.Update) -> None:
    """One update of a pod's feed, into the index (see the module docstring)."""
    pod = update.pod
    if isinstance(update, kvevents.Reset):
        index.feed(pod, live=False)
        return
    if not index.is_live(pod):
        index.feed(pod, live=True)
    for event in update.batch.events:
        if isinstance(event, kvevents.BlockStored):
            index.stored(pod, event.block_hashes, event.parent_block_hash)
        elif isinstance(event, kvevents.BlockRemoved):
            index.removed(pod, event.block_hashes)
        elif isinstance(event, kvevents.AllBlocksCleared):
            index.cleared(pod)


def endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class KvFeed:
    """The subscriber of one pod and the task that applies its updates; `stop` ends both."""

    def __init__(
        self,
        pod: str,
        ip: str,
        port: int,
        replay_port: int | None,
        index: PrefixIndex,
        make: SubscriberFactory = subscriber,
    ) -> None:
        self.pod, self.ip, self.index = pod, ip, index
        self._endpoint = endpoint(ip, port)
        self._replay = None if replay_port is None else endpoint(ip, replay_port)
        self._make = make
        self.subscriber = make(pod, self._endpoint, self._replay)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._retry = RETRY_FIRST
        self._retry_at: asyncio.TimerHandle | None = None
        self.restarts = 0  # fresh subscribers after a failure

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.subscriber.run()), loop.create_task(self._apply())]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None or self._stopped:
            return
        e = task.exception()
        log.warning("kv events of %s stopped: %s: %s; following it again in %g s",
                    self.pod, type(e).__name__, e, self._retry)  # fmt: skip
        self.index.feed(self.pod, live=False)
        for other in self._tasks:
            other.cancel()
        self._retry_at = asyncio.get_running_loop().call_later(self._retry, self._restart)
        self._retry = min(self._retry * 2, RETRY_MAX)

    def _restart(self) -> None:
        self._retry_at = None
        if self._stopped:
            return
        self.restarts += 1
        self.subscriber = self._make(self.pod, self._endpoint, self._replay)
        self.start()

    async def _apply(self) -> None:
        async for update in self.subscriber.updates():
            apply(self.index, update)
            self._retry = RETRY_FIRST

    def stop(self) -> None:
        self._stopped = True
        if self._retry_at is not None:
            self._retry_at.cancel()
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        self.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # a failed one's too
