"""The Pods of the models the router sends to, as the API server sees them: one `PodSet` per
watched (namespace, selector), kept by a list and then a watch (`PodWatch`), plain HTTP
with the router's ServiceAccount token, no Kubernetes client.

A candidate is a pod that is Ready (condition `Ready=True`), has a pod IP and has no
`deletionTimestamp`: a pod that starts terminating leaves the candidates with the event
that sets it, before its endpoints are updated. A container restart (a pod's summed
`restartCount` grows, a container ID is replaced, or the name comes back with a new UID)
is reported to the `on_restart` callbacks (the prefix index clears that pod's cache).

The watch resumes from the last resourceVersion it saw (bookmarks included); a 410 Gone
(that version is compacted away), as the status of the watch request or as an ERROR event,
re-lists at once. Any other failure (the API server restarting, a refused token) keeps the
pods known so far, logs, and re-lists after a backoff up to `MAX_BACKOFF` seconds: a router
that cannot reach the API server keeps sending to the pods it knew, and a pod that went
away meanwhile is caught by its refused connection (the request is held and placed again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .models import PodSelector

log = logging.getLogger(__name__)
WATCH_SECONDS = 290  # one watch request's server-side timeout; then it resumes
MAX_BACKOFF = 10.0


@dataclass(frozen=True)
class Pod:
    name: str
    uid: str
    ip: str
    ready: bool
    deleting: bool
    restarts: int  # summed over its containers
    containers: tuple[str, ...]  # container IDs (empty strings until started)

    @property
    def candidate(self) -> bool:
        return self.ready and bool(self.ip) and not self.deleting

    def restarted_since(self, before: Pod) -> bool:
        if before.uid != self.uid or self.restarts > before.restarts:
            return True
        pairs = zip(before.containers, self.containers, strict=False)
        return any(old and new and old != new for old, new in pairs)


def parse_pod(obj: dict[str, Any]) -> Pod:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    containers = status.get("containerStatuses") or ()
    return Pod(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        ip=str(status.get("podIP") or ""),
        ready=ready,
        deleting=meta.get("deletionTimestamp") is not None,
        restarts=sum(int(c.get("restartCount") or 0) for c in containers),
        containers=tuple(str(c.get("containerID") or "") for c in containers),
    )


class PodSet:
    """The pods one selector matches now, and who waits for them to change."""

    def __init__(self, selector: PodSelector) -> None:
        self.selector = selector
        self.pods: dict[str, Pod] = {}
        self.synced = False  # listed at least once
        self._changed: asyncio.Future[None] | None = None
        self._restart: list[Callable[[Pod], None]] = []

    def candidates(self) -> list[Pod]:
        """Ready pods with an IP and no deletion, by name."""
        return sorted((p for p in self.pods.values() if p.candidate), key=lambda p: p.name)

    def candidate(self, name: str) -> Pod | None:
        pod = self.pods.get(name)
        return pod if pod is not None and pod.candidate else None

    def changed(self) -> asyncio.Future[None]:
        """Resolved at the next change of the pods (a new future after that)."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def on_restart(self, callback: Callable[[Pod], None]) -> Callable[[], None]:
        """Call `callback(pod)` when a pod's container restarts; returns the unsubscribe."""
        self._restart.append(callback)
        return lambda: self._restart.remove(callback)

    def replace(self, pods: list[Pod]) -> None:
        """A fresh list: the pods now, whatever events were missed."""
        before, self.pods = self.pods, {p.name: p for p in pods}
        self.synced = True
        for pod in self.pods.values():
            old = before.get(pod.name)
            if old is not None and pod.restarted_since(old):
                self._restarted(pod)
        self._notify()

    def apply(self, kind: str, pod: Pod) -> None:
        """One watch event (ADDED, MODIFIED, DELETED)."""
        old = self.pods.get(pod.name)
        if kind == "DELETED":
            self.pods.pop(pod.name, None)
        else:
            self.pods[pod.name] = pod
            if old is not None and pod.restarted_since(old):
                self._restarted(pod)
        self._notify()

    def _restarted(self, pod: Pod) -> None:
        log.info("pod %s/%s restarted", self.selector.namespace, pod.name)
        for callback in list(self._restart):
            try:
                callback(pod)
            except Exception:
                log.exception("on_restart callback for %s failed", pod.name)

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)


@dataclass(frozen=True)
class ApiServer:
    """Where the API server is and how to authenticate to it."""

    url: str
    token_file: Path | None = None  # re-read per request: the kubelet rotates it
    ca_file: Path | None = None

    @classmethod
    def find(cls, url: str | None, service_account: Path) -> ApiServer | None:
        """`url`, or in-cluster from `KUBERNETES_SERVICE_HOST`/`_PORT`; None without either."""
        if url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                return None
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        token, ca = service_account / "token", service_account / "ca.crt"
        return cls(url.rstrip("/"), token if token.exists() else None, ca if ca.exists() else None)

    def client(self, connect_timeout: float) -> httpx.AsyncClient:
        verify: ssl.SSLContext | bool = True
        if self.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.AsyncClient(
            base_url=self.url,
            verify=verify,
            trust_env=False,
            timeout=httpx.Timeout(connect_timeout, read=WATCH_SECONDS + 30),
        )

    def headers(self) -> dict[str, str]:
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class PodWatch:
    """Keeps one `PodSet` current: list, then watch from the list's resourceVersion."""

    def __init__(self, podset: PodSet, api: ApiServer, client: httpx.AsyncClient) -> None:
        self.podset, self.api, self.client = podset, api, client
        s = podset.selector
        self.path = f"/api/v1/namespaces/{s.namespace}/pods"
        self.params = {"labelSelector": s.label_selector}

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._list()
                backoff = 0.5
                while True:
                    version = await self._watch(version)
            except Gone:
                log.info("%s: watch expired (410); listing again", self._what())
            except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                log.warning(
                    "%s: %s: %s; listing again in %.1f s",
                    self._what(),
                    type(e).__name__,
                    e,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _what(self) -> str:
        s = self.podset.selector
        return f"pods {s.namespace}/{s.label_selector}"

    async def _list(self) -> str:
        r = await self.client.get(self.path, params=self.params, headers=self.api.headers())
        if r.status_code == 410:
            raise Gone
        r.raise_for_status()
        body = r.json()
        self.podset.replace([parse_pod(item) for item in body.get("items") or ()])
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        """One watch request; the resourceVersion to resume from when it ends."""
        params = {
            **self.params,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        async with self.client.stream(
            "GET", self.path, params=params, headers=self.api.headers()
        ) as r:
            if r.status_code == 410:
                raise Gone
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone
                    raise ValueError(f"watch error: {obj.get('message') or obj}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.podset.apply(kind, parse_pod(obj))
        return version


class PodWatches:
    """One `PodSet` and watch per (namespace, selector) the models file names, started
    when first needed and stopped when no model names it any more."""

    def __init__(self, api: ApiServer | None, connect_timeout: float) -> None:
        self.api, self.connect_timeout = api, connect_timeout
        self.sets: dict[tuple[str, tuple[tuple[str, str], ...]], PodSet] = {}
        self._tasks: dict[tuple[str, tuple[tuple[str, str], ...]], asyncio.Task[None]] = {}
        self._client: httpx.AsyncClient | None = None
        self._warned = False

    def podset(self, selector: PodSelector) -> PodSet:
        key = (selector.namespace, selector.labels)
        podset = self.sets.get(key)
        if podset is None:
            podset = self.sets[key] = PodSet(selector)
        if key not in self._tasks:
            self._start(key, podset)
        return podset

    def _start(self, key: tuple[str, tuple[tuple[str, str], ...]], podset: PodSet) -> None:
        if self.api is None:
            if not self._warned:
                log.error(
                    "models with `pods` need the API server (in-cluster, or "
                    "--kube-api-url): their requests are held until it is given"
                )
                self._warned = True
            return
        if self._client is None:
            self._client = self.api.client(self.connect_timeout)
        watch = PodWatch(podset, self.api, self._client)
        self._tasks[key] = asyncio.get_running_loop().create_task(watch.run())

    def retain(self, selectors: set[PodSelector]) -> None:
        """Stop watching what no model names any more."""
        keep = {(s.namespace, s.labels) for s in selectors}
        for key in [k for k in self.sets if k not in keep]:
            del self.sets[key]
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.aclose()
