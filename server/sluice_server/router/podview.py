"""One model's Ready pods as placement sees them: which prompt blocks each holds, how
loaded each is, and the pick among them (placement.py's scores over this view).

- The prefix index (prefixindex.py) is fed by each candidate pod's KV events when the
  models file gives the model `kvEvents` (one `KvFeed` per pod, kvfeed.py), and by what
  this router sent (every pick with block hashes). A pod that leaves the candidates is
  forgotten (its feed stopped); a pod whose container restarted is forgotten and its feed
  started afresh (it catches up from the new publisher's replay buffer).
- Loads: every `scrape_interval` seconds each candidate's `/metrics` is read (loads.py:
  requests waiting, KV-cache use), each read bounded by `scrape_timeout` (the router reads
  them through the relay's own transport, hop.py: a page is some 100 KB of histograms,
  which httpx's pure-Python HTTP/1.1 reader took a tenth of a busy router's CPU to parse
  every second); a pod that does
  not answer keeps its last reading, which ages until placement no longer believes it.
  This router's own in-flight count per pod is added at the pick, fresh on every request.
- A disaggregated model's decode pool (its `pods`, beside `disaggregation.prefill`) is
  placed by load: its view follows no KV events (`sluice_router_kv_feeds_live` is its
  prefill pool's view's).
- A model whose entry says `balance: round-robin` is placed on each candidate pod in turn
  (by name, one turn counter per view): no score, no index, no load (the ingress's round
  robin, behind the same router; what the router's scores are measured against).
- `place` counts each pick by what decided it: `prefix` (the chosen pod holds some of the
  request's leading blocks), `load` or `round-robin`; a pin cookie's pick is counted `pin`
  (upstream.py).

`start` runs the feeds and the scrape loop (the router starts one view per model with
`pods`, from its start-up or the reload that adds the model, and stops it with the model);
a view that is never started still places by its index and in-flight counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from . import kvfeed
from .kvfeed import KvFeed, SubscriberFactory
from .loads import Load, parse_load
from .metrics import RouterMetrics
from .models import Model
from .placement import Placement, PodLoad, Scoring, default_key
from .pods import Pod, PodSet
from .prefixindex import BlockHash

log = logging.getLogger(__name__)
PickedBy = Literal["prefix", "load", "pin", "round-robin", "follow"]


@dataclass(frozen=True)
class Scraped:
    load: Load | None  # None: the page had no load metric
    at: float  # time.monotonic() of the reading


class PodView:
    def __init__(
        self,
        model: Model,
        pods: PodSet,
        metrics: RouterMetrics,
        scoring: Scoring | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        scrape_interval: float = 1.0,
        scrape_timeout: float = 1.0,
        subscriber: SubscriberFactory = kvfeed.subscriber,
    ) -> None:
        self.model, self.pods, self.metrics = model, pods, metrics
        self.placement = Placement(scoring)
        self.index = self.placement.index
        self.client = client
        self.scrape_interval, self.scrape_timeout = scrape_interval, scrape_timeout
        self.scraped: dict[str, Scraped] = {}
        self.feeds: dict[str, KvFeed] = {}
        self._subscriber = subscriber
        labels = (model.namespace, model.name)
        self._picks = {
            by: metrics.picks.labels(*labels, by)
            for by in ("prefix", "load", "pin", "round-robin", "follow")
        }
        self._turn = 0  # round-robin's next turn
        self._scrapes = {r: metrics.scrapes.labels(*labels, r) for r in ("ok", "missing", "error")}
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: list[Callable[[], None]] = []
        self.running = False

    # -- the pick ------------------------------------------------------------------------
    def loads(self, pods: Sequence[Pod], in_flight: Mapping[str, int]) -> list[PodLoad]:
        now = time.monotonic()
        rows = []
        for p in pods:
            n = in_flight.get(p.name, 0)
            seen = self.scraped.get(p.name)
            if seen is None or seen.load is None:
                rows.append(PodLoad(p.name, n, scrape_age_s=math.inf))
            else:
                rows.append(PodLoad(p.name, n, seen.load.waiting, seen.load.kv_use, now - seen.at))
        return rows

    def place(
        self,
        pods: Sequence[Pod],
        in_flight: Mapping[str, int],
        hashes: Sequence[BlockHash] | None,
        key: bytes,
    ) -> str:
        """The pod (of `pods`, not empty) for a request with these block hashes (None:
        unknown, placed by load); its blocks are then remembered there. A round-robin
        model: the next pod in turn, whatever the hashes."""
        if self.model.balance == "round-robin":
            turn = sorted(p.name for p in pods)
            name = turn[self._turn % len(turn)]
            self._turn += 1
            self.count("round-robin")
            return name
        blocks: Sequence[BlockHash] = hashes or ()
        tie = default_key(blocks, "") if blocks else key
        best = self.placement.rank(blocks, self.loads(pods, in_flight), tie)[0]
        if blocks and self.placement.scoring.prefix_weight != 0.0:
            self.index.sent(best.pod, blocks)
        self.count("prefix" if best.prefix_blocks else "load")
        log.debug(
            "%s: %s (prefix %d/%d blocks, total %.3f%s)",
            self.model.key,
            best.pod,
            best.prefix_blocks,
            len(blocks),
            best.total,
            ", saturated" if best.saturated else "",
        )
        return best.pod

    def count(self, by: PickedBy) -> None:
        self._picks[by].inc()

    def live_feeds(self) -> int:
        return sum(1 for name in self.feeds if self.index.is_live(name))

    # -- following the pods ----------------------------------------------------------
    def sync(self) -> None:
        """Forget the pods that left the candidates; follow the events of those that came
        (or came back at another IP)."""
        now = {p.name: p for p in self.pods.candidates()}
        known = set(self.index.pods()) | set(self.feeds) | set(self.scraped)
        for name in known - set(now):
            self._forget(name)
        kv = self.model.pods.kv_events if self.model.pods is not None else None
        if not self.running or kv is None or self.model.prefill is not None:
            return
        for name, pod in now.items():
            feed = self.feeds.get(name)
            if feed is not None and feed.ip != pod.ip:
                self._forget(name)
                feed = None
            if feed is None:
                feed = self.feeds[name] = KvFeed(
                    name, pod.ip, kv.port, kv.replay_port, self.index, self._subscriber
                )
                feed.start()

    def _forget(self, name: str) -> None:
        feed = self.feeds.pop(name, None)
        if feed is not None:
            feed.stop()
        self.index.forget(name)
        self.scraped.pop(name, None)

    def restarted(self, pod: Pod) -> None:
        """Its cache is gone: nothing of it is kept, and its events are followed afresh."""
        feed = self.feeds.pop(pod.name, None)
        if feed is not None:
            feed.stop()
        self.index.forget(pod.name)
        self.sync()

    async def _follow(self) -> None:
        while True:
            self.sync()
            await self.pods.changed()

    # -- loads -----------------------------------------------------------------------
    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(p) for p in self.pods.candidates()))
            await asyncio.sleep(self.scrape_interval)

    async def scrape(self, pod: Pod) -> None:
        assert self.client is not None
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        port = self.model.pods.port if self.model.pods is not None else self.model.port
        try:
            async with asyncio.timeout(self.scrape_timeout):  # the whole read, body included
                r = await self.client.get(f"http://{host}:{port}/metrics")
            r.raise_for_status()
            load = parse_load(r.content.decode("utf-8", "replace"))
        except (httpx.HTTPError, ValueError, TimeoutError) as e:
            self._scrapes["error"].inc()
            log.debug("%s: /metrics of %s: %s: %s", self.model.key, pod.name, type(e).__name__, e)
            return
        if self.pods.candidate(pod.name) is None:
            return  # it left meanwhile
        self._scrapes["ok" if load is not None else "missing"].inc()
        self.scraped[pod.name] = Scraped(load, time.monotonic())

    # -- lifetime --------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.running = True
        self._unsubscribe.append(self.pods.on_restart(self.restarted))
        if self.model.prefill is None:  # a disaggregated model's: its prefill pool's view
            self.metrics.kv_feeds.labels(self.model.namespace, self.model.name).set_function(
                self.live_feeds
            )
        self._tasks.append(loop.create_task(self._follow()))
        if self.client is not None:
            self._tasks.append(loop.create_task(self._scrape_loop()))

    def stop(self) -> None:
        self.running = False
        for unsubscribe in self._unsubscribe:
            with contextlib.suppress(ValueError):
                unsubscribe()
        self._unsubscribe.clear()
        for task in self._tasks:
            task.cancel()
        for name in list(self.feeds):
            self._forget(name)

    async def aclose(self) -> None:
        tasks, feeds = list(self._tasks), list(self.feeds.values())
        self.stop()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for feed in feeds:
            await feed.aclose()
