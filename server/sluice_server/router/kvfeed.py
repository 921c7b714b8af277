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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..kvcache import kvevents
from .prefixindex import PrefixIndex

log = logging.getLogger(__name__)

SubscriberFactory = Callable[[str, str, str | None], kvevents.Subscriber]


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
        replay = None if replay_port is None else endpoint(ip, replay_port)
        self.subscriber = make(pod, endpoint(ip, port), replay)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.subscriber.run()), loop.create_task(self._apply())]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            log.warning("kv events of %s stopped: %s: %s", self.pod, type(e).__name__, e)
            self.index.feed(self.pod, live=False)

    async def _apply(self) -> None:
        async for update in self.subscriber.updates():
            apply(self.index, update)

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        self.stop()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
