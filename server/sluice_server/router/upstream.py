"""One model's side of the router: how many of its requests are held (bounded), whether a
replica is ready, and where a request goes (`pick`).

A model with `pods` is ready while its `PodSet` (pods.py) has a candidate: a Ready pod with
an IP and no deletion. `pick` sends a request to the pod its pin cookie names while that is
a candidate, else to the pod its model's `PodView` places it on (podview.py, placement.py:
the prefix of the request's prompt blocks each pod holds, its scraped queue and KV use, the
requests this router has in flight there; ties broken by a stable hash every router
replica computes alike). The prompt's block hashes come from the model's `PromptHashes`
provider (hashes.py); without one, or when it does not know a request's blocks, the
request is placed by load alone. A pod a request could not connect to is left out for
`FRESH` seconds. A disaggregated model's Upstream has its prefill pool's as `prefill`, the
same machinery over the prefill pods (`Model.prefill_pool`): the prompt is placed there by
prefix locality and load, the request itself on the decode pods (`pods`) by load; it is
ready while both pools have a candidate. A model without `pods` is ready as `GET /ready` through its Service says,
and every request goes to the Service.

For a model without `pods`, readiness is checked by one poll per model, shared by every request held for it, and only
while one is held: the first check at once, then with backoff from a tenth of
`--ready-poll-seconds` up to it. A 200 counts for a second (`FRESH`): requests arriving
just after it are forwarded without a check of their own; past that, or when a forwarded
request could not even connect (`down`: the replica went away again), the next request
checks again. Holding ends when the last held request is gone: the poll stops with it.

`Closing` is the router's shutdown as held requests see it: after SIGTERM each waits at
most `--drain-timeout-seconds` more (its model may still come up), then gives up as at its
hold timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Executor

import httpx

from .hashes import PromptHashes
from .metrics import RouterMetrics
from .models import Model
from .placement import tie_hash
from .pods import Pod, PodSet
from .podview import PodView
from .prefixindex import BlockHash
from .tenants import UNKNOWN, Tenants

log = logging.getLogger(__name__)
FRESH = 1.0  # seconds a ready answer stands for new requests
# Bodies hashed on the event loop itself, not on the hashing thread: the hop to the thread
# costs each request a wake-up of two threads on its path (0.4-1.6 ms of TTFT p50 on a busy
# 2-core machine, `python -m sluice_bench.router_hop`), while a body this short costs at most
# about the GIL's switch interval (5 ms) to hash cold with the tiny model's tokenizer on
# that machine (a longer one stalls every relayed stream for longer).
INLINE_BYTES = 2 * 1024


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


class Target:
    """Where one request goes: a URL, and the pod it names (None: the Service). Counted in
    its pod's in-flight requests until released (once)."""

    __slots__ = ("url", "pod", "_counts", "_released")

    def __init__(self, url: str, pod: str | None, counts: dict[str, int]) -> None:
        self.url, self.pod, self._counts, self._released = url, pod, counts, False
        if pod is not None:
            counts[pod] = counts.get(pod, 0) + 1

    def release(self) -> None:
        if self._released or self.pod is None:
            return
        self._released = True
        left = self._counts[self.pod] - 1
        if left:
            self._counts[self.pod] = left
        else:
            del self._counts[self.pod]


class Upstream:
    def __init__(
        self,
        model: Model,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        poll: float,
        timeout: float,
        closing: Closing,
        pods: PodSet | None = None,
        view: PodView | None = None,
        hashes: PromptHashes | None = None,
        hashing: Executor | None = None,
        *,
        before: Upstream | None = None,
        prefill: Upstream | None = None,
    ) -> None:
        """`before`: the model's Upstream under its previous entry, whose learned tenants and
        in-flight counts this one takes over (the same objects: a stream forwarded under the
        old entry releases its pod here). `prefill`: a disaggregated model's prefill pool
        (its callers' tenants are this one's)."""
        self.model, self.client, self.poll, self.timeout = model, client, poll, timeout
        self.closing, self.pods = closing, pods
        # The router's running view of the pods, or one of our own (load and sends only).
        if view is None and pods is not None:
            view = PodView(model, pods, metrics)
        self.view, self.hashes = view, hashes
        self.hashing = hashing  # where the provider runs (None: the loop's default executor)
        # The tenant each caller's prompts are salted with.
        self.tenants: Tenants = Tenants() if before is None else before.tenants
        self._hashes_failed = False
        self.held = 0
        # Pod name -> this router's requests there.
        self.in_flight: dict[str, int] = {} if before is None else before.in_flight
        self._gauge = metrics.held.labels(model.namespace, model.name)
        self._ready_at: float | None = None
        self._round: asyncio.Task[None] | None = None
        self._down: dict[str, float] = {}  # pod name -> loop time it may be picked again
        self.prefill = prefill
        if prefill is not None:
            prefill.tenants = self.tenants

    def candidates(self) -> list[Pod]:
        """The pods a request may go to now (a model with `pods`)."""
        if self.pods is None:
            return []
        now = asyncio.get_running_loop().time()
        return [p for p in self.pods.candidates() if self._down.get(p.name, 0) <= now]

    async def prompt_hashes(
        self, path: str, body: bytes, cred: bytes | None
    ) -> Sequence[BlockHash] | None:
        """The request's prompt block hashes from the model's provider, computed on the
        `hashing` executor (tokenizing and hashing a body is CPU work: 0.8 ms for 1,442
        simulator words, 83 ms for a 1 MiB body, which on the event loop would stall every
        stream the router relays), or on the loop for a body up to `INLINE_BYTES`; None:
        unknown (no provider, or one without its hasher yet, no pods to place among, a
        round-robin model, which never reads them, a caller whose tenant is not learned
        yet, or the provider failed). `cred`: the caller's hashed
        credential (tenants.py)."""
        hashes = self.hashes
        if hashes is None or self.view is None or self.model.balance == "round-robin":
            return None  # nothing to hash with, or a placement that never reads them
        tenant = self.tenants.of(cred)
        if tenant is UNKNOWN:
            return None
        if not getattr(hashes, "ready", True):  # a ModelHasher still fetching: no hop
            return None
        assert tenant is None or isinstance(tenant, str)
        try:
            if len(body) <= INLINE_BYTES:  # short: cheaper here than a thread's wake-up
                return hashes(path, body, tenant)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.hashing, hashes, path, body, tenant)
        except Exception as e:
            if not self._hashes_failed:  # once: it is the same fault for every request
                log.warning("%s: prompt hashes failed (%s: %s); placing by load",
                            self.model.key, type(e).__name__, e)  # fmt: skip
                self._hashes_failed = True
            return None

    def pick(
        self,
        key: bytes,
        pin: str | None = None,
        hashes: Sequence[BlockHash] | None = None,
        exclude: Collection[str] = (),
        follow: bytes | None = None,
    ) -> Target | None:
        """Where a request goes now; None when no pod is a candidate any more. `pin`: a pod
        name the request asks for (a verified cookie), honoured while it is a candidate.
        `hashes`: its prompt's block hashes (None: unknown); `key`: its tie-break;
        `exclude`: pod names it must not go to (a continued stream's broken pods);
        `follow`: a token stream's id, for its continuation and for a resume whose pinned
        pod is no longer a candidate: the candidate that ranks highest for that id
        (`placement.tie_hash`, as every router replica ranks it), so the resume reaches
        the pod the stream was continued on while the candidates are the same."""
        if self.pods is None or self.view is None:
            return Target(self.model.url, None, self.in_flight)
        pods = self.candidates()
        if exclude:
            pods = [p for p in pods if p.name not in exclude]
        if not pods:
            return None
        pod = next((p for p in pods if p.name == pin), None) if pin else None
        if pod is not None:
            self.view.count("pin")
        elif follow is not None:
            pod = max(pods, key=lambda p: tie_hash(follow, p.name))
            self.view.count("follow")
        else:
            name = self.view.place(pods, self.in_flight, hashes, key)
            pod = next(p for p in pods if p.name == name)
        port = self.model.pods.port if self.model.pods is not None else self.model.port
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        return Target(f"http://{host}:{port}", pod.name, self.in_flight)

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

    def down(self, target: Target | None = None) -> None:
        """A forwarded request could not connect: the next waiters check again (a pod: it is
        left out for `FRESH` seconds)."""
        self._ready_at = None
        if target is not None and target.pod is not None:
            self._down[target.pod] = asyncio.get_running_loop().time() + FRESH

    async def pods_change(self, seconds: float) -> None:
        """Until the model's pods change (a model with `pods`) or `seconds` pass."""
        if self.pods is None:
            await asyncio.sleep(seconds)
        else:
            await asyncio.wait((self.pods.changed(),), timeout=seconds)

    async def wait_ready(self) -> None:
        """Return once a replica is ready: a pod is a candidate, or (without `pods`) the
        Service answered `/ready` with 200 (within `FRESH`)."""
        loop = asyncio.get_running_loop()
        if self.pods is not None:
            while not self.candidates():
                now = loop.time()
                self._down = {k: v for k, v in self._down.items() if v > now}
                back = min(self._down.values(), default=None)
                changed = self.pods.changed()
                await asyncio.wait((changed,), timeout=None if back is None else back - now)
            if self.prefill is not None:
                await self.prefill.wait_ready()
            return
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
                log.debug("%s: not ready yet (%s answered %d)", self.model.key, url, r.status_code)
            except httpx.HTTPError as e:
                log.debug("%s: not ready yet (%s: %s)", self.model.key, url, type(e).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll)
