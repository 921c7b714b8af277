"""The router's prompt-hash provider for a model with `pods`: a `PromptHasher` (prompts.py)
fetched from one of the model's pods in the background, never on a request's path.

A `ModelHasher` is the model's `PromptHashes` (hashes.py). Until its hasher is there it
answers None (the model's requests are placed by load alone); once a pod's description has
been fetched it hashes as that pod's engine does. Its task follows the model's candidates:

- a pod that becomes a candidate (the first one, one that came back, or one whose
  container restarted or that came back at another IP) has its description read
  (`GET /internal/prefix-cache`, a few KB); when its digest differs from the one the
  hasher was built from, the hasher is rebuilt from that pod (the tokenizer files come
  from the pod unless `cache_dir` holds them under their content hash already). The newest
  pod wins: in a rollout that changes the tokenizer, the new pods' hashing is the one that
  will last, and the old pods' blocks simply stop matching.
- every `refresh` seconds the first candidate's description is read again, for a change
  that restarts no pod (an adapter loaded at run time changes `loras`).
- a failed read (the pod not answering, a 503 while it loads, files that do not match
  their hash) is logged once per run of failures, counted every time
  (`sluice_router_prefix_hasher_fetch_failures_total{reason}`, `failure_reason`), and
  retried with backoff from `RETRY_MIN` to `RETRY_MAX` seconds; the hasher built before
  stays meanwhile. A pod whose hashes cannot be reproduced (prefix caching off, a random
  seed) gives no hasher: None. `sluice_router_prefix_hasher_ready` is 1 while the model has
  a hasher, 0 otherwise.

The hashing itself runs wherever the caller runs it: the router runs it on one thread of its
own (upstream.py), as it is pure CPU work on the request body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import httpx

from .metrics import RouterMetrics
from .models import Model
from .pods import Pod, PodSet
from .prefixindex import BlockHash
from .prompts import PromptHasher, description_digest, fetch_description, hasher_from

log = logging.getLogger(__name__)
RETRY_MIN, RETRY_MAX = 1.0, 60.0


def failure_reason(e: BaseException) -> str:
    """The `reason` label of a failed read: `unreachable` (no connection or answer in time),
    `status` (an HTTP error status: 503 while the engine loads, 404 from a pod that does not
    describe its cache), `invalid` (a description or tokenizer the router cannot use, files
    that do not match their hash), `storage` (the tokenizer cache directory)."""
    if isinstance(e, httpx.HTTPStatusError):
        return "status"
    if isinstance(e, (httpx.HTTPError, TimeoutError)):  # before OSError: TimeoutError is one
        return "unreachable"
    if isinstance(e, OSError):
        return "storage"
    return "invalid"


def _identity(pod: Pod) -> tuple[str, str, int, tuple[str, ...]]:
    """What changes when a pod is replaced, restarted or moved."""
    return pod.uid, pod.ip, pod.restarts, pod.containers


class ModelHasher:
    """One model's `PromptHashes`, fed by a task that fetches its hasher from its pods."""

    def __init__(
        self,
        model: Model,
        pods: PodSet,
        client: httpx.AsyncClient,
        cache_dir: Path,
        refresh: float,
        *,
        timeout: float = 10.0,
        metrics: RouterMetrics | None = None,
    ) -> None:
        assert model.pods is not None
        self.model, self.pods, self.client = model, pods, client
        self.cache_dir, self.refresh, self.timeout = cache_dir, refresh, timeout
        self.hasher: PromptHasher | None = None
        self.digest: str | None = None  # of the description the hasher was built from
        self.source: str | None = None  # the pod it was built from
        self.fetches = 0  # descriptions read (each a GET)
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.metrics = metrics
        self._ready_gauge = None
        if metrics is not None:  # a 0 series from the start: "not ready" reads as 0
            self._ready_gauge = metrics.hasher_ready.labels(model.namespace, model.name)
            self._ready_gauge.set(0)

    def __call__(self, path: str, body: bytes, tenant: str | None) -> Sequence[BlockHash] | None:
        hasher = self.hasher  # one read: the task may swap it meanwhile
        return None if hasher is None else hasher.hashes(path, body, tenant)

    @property
    def ready(self) -> bool:
        return self.hasher is not None

    def _url(self, pod: Pod) -> str:
        assert self.model.pods is not None
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        return f"http://{host}:{self.model.pods.port}"

    async def check(self, pod: Pod) -> bool:
        """Read `pod`'s description and rebuild the hasher when it changed; False (logged
        once per run of failures) when it could not be read or built."""
        try:
            url = self._url(pod)
            async with asyncio.timeout(self.timeout):
                desc = await fetch_description(self.client, url)
                self.fetches += 1
                digest = description_digest(desc)
                if digest == self.digest:
                    return self._ok()
                hasher = await hasher_from(self.client, url, desc, self.cache_dir)
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError, OSError) as e:
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "%s: the prefix-cache description of %s: %s: %s; placing by load "
                    "until it can be read (retrying)", self.model.key, pod.name,
                    type(e).__name__, e)  # fmt: skip
            self._failing = True
            if self.metrics is not None:
                self.metrics.hasher_failures.labels(
                    self.model.namespace, self.model.name, failure_reason(e)
                ).inc()
            return False
        self.hasher, self.digest, self.source = hasher, digest, pod.name
        if self._ready_gauge is not None:
            self._ready_gauge.set(0 if hasher is None else 1)
        if hasher is None:
            log.info("%s: %s's prefix-cache hashes cannot be reproduced (caching off or a "
                     "random seed); placing by load", self.model.key, pod.name)  # fmt: skip
        else:
            log.info("%s: prompt hashes as %s's engine computes them (description %s)",
                     self.model.key, pod.name, digest[:12])  # fmt: skip
        return self._ok()

    def _ok(self) -> bool:
        if self._failing:
            log.info("%s: the prefix-cache description can be read again", self.model.key)
        self._failing = False
        return True

    async def run(self) -> None:
        """Follow the candidates (see the module docstring) until cancelled."""
        loop = asyncio.get_running_loop()
        checked: dict[str, tuple[str, str, int, tuple[str, ...]]] = {}
        due = loop.time() + self.refresh
        backoff = RETRY_MIN
        while True:
            changed = self.pods.changed()
            candidates = self.pods.candidates()
            names = {p.name for p in candidates}
            checked = {k: v for k, v in checked.items() if k in names}
            todo = [p for p in candidates if checked.get(p.name) != _identity(p)]
            periodic = not todo and bool(candidates) and loop.time() >= due
            if periodic:
                todo = candidates[:1]
            wait: float | None = None
            for pod in todo:
                if not await self.check(pod):
                    wait, backoff = backoff, min(backoff * 2, RETRY_MAX)
                    break
                checked[pod.name] = _identity(pod)
                backoff = RETRY_MIN
            else:
                if periodic:
                    due = loop.time() + self.refresh
            if wait is None and candidates:
                wait = max(due - loop.time(), 0.0)
            await asyncio.wait((changed,), timeout=wait)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        self.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
