"""A fake Kubernetes API server for Pods only: what the router's Pod watch reads
(sluice_server/router/pods.py), over the same HTTP interface, with no Kubernetes binaries.

`GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...` lists (items and the list's
`metadata.resourceVersion`); with `watch=1&resourceVersion=N` it streams the events after N
as JSON lines (`{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": ...}`) until
`timeoutSeconds`. `expire()` compacts the history: open watches get an ERROR event with
code 410 and a watch from an older version is answered the same way, so the client lists
again, as against a real API server. The test changes pods with `put`, `ready`,
`terminating`, `restart` and `delete`; every request's Authorization is kept in `tokens`.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class FakePodsApi:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> Pod
        self.version = 100
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, Pod)
        self.compacted = 0  # watches from a version below this get 410
        self.tokens: list[str | None] = []
        self.lists = 0  # list requests served (a re-list after 410 adds one)
        self._watchers: set[asyncio.Event] = set()
        self.app = Starlette(routes=[Route("/api/v1/namespaces/{ns}/pods", self._pods)])

    # -- the test's side ----------------------------------------------------------------

    def put(self, name: str, ip: str, labels: dict[str, str], *, namespace: str = "team-a",
            ready: bool = True) -> None:  # fmt: skip
        """Add (or replace) a pod with one container, Ready or not."""
        pod = {
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "labels": dict(labels)},
            "status": {"podIP": ip, "conditions": [],
                       "containerStatuses": [{"name": "server", "restartCount": 0,
                                              "containerID": f"containerd://{name}-0"}]},
        }  # fmt: skip
        kind = "MODIFIED" if (namespace, name) in self.pods else "ADDED"
        self.pods[(namespace, name)] = pod
        self._set_ready(pod, ready)
        self._event(kind, pod)

    def ready(self, name: str, ready: bool, namespace: str = "team-a") -> None:
        pod = self.pods[(namespace, name)]
        self._set_ready(pod, ready)
        self._event("MODIFIED", pod)

    def terminating(self, name: str, namespace: str = "team-a") -> None:
        """The pod got a deletionTimestamp (still Ready, as in its grace period)."""
        pod = self.pods[(namespace, name)]
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self._event("MODIFIED", pod)

    def restart(self, name: str, namespace: str = "team-a") -> None:
        pod = self.pods[(namespace, name)]
        status = pod["status"]["containerStatuses"][0]
        status["restartCount"] += 1
        status["containerID"] = f"containerd://{name}-{status['restartCount']}"
        self._event("MODIFIED", pod)

    def delete(self, name: str, namespace: str = "team-a") -> None:
        self._event("DELETED", self.pods.pop((namespace, name)))

    def expire(self) -> None:
        """Compact the history: every open watch and any watch from before now gets 410."""
        self.version += 1  # as if other objects were written: a list from now is newer
        self.compacted = self.version
        self._wake()

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _set_ready(pod: dict, ready: bool) -> None:
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    def _event(self, kind: str, pod: dict) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, copy.deepcopy(pod)))
        self._wake()

    def _wake(self) -> None:
        for wake in self._watchers:
            wake.set()

    @staticmethod
    def _matches(pod: dict, ns: str, selector: str) -> bool:
        if pod["metadata"]["namespace"] != ns:
            return False
        labels = pod["metadata"].get("labels") or {}
        wanted = [term.split("=", 1) for term in selector.split(",") if term]
        return all(labels.get(k) == v for k, v in wanted)

    async def _pods(self, request: Request) -> Response:
        self.tokens.append(request.headers.get("authorization"))
        ns, q = request.path_params["ns"], request.query_params
        selector = q.get("labelSelector", "")
        if q.get("watch") not in ("1", "true"):
            self.lists += 1
            items = [copy.deepcopy(p) for (pns, _), p in sorted(self.pods.items())
                     if self._matches(p, ns, selector)]  # fmt: skip
            return JSONResponse({"kind": "PodList", "apiVersion": "v1", "items": items,
                                 "metadata": {"resourceVersion": str(self.version)}})  # fmt: skip
        since = int(q.get("resourceVersion") or 0)
        timeout = float(q.get("timeoutSeconds") or 300)
        return StreamingResponse(self._watch(ns, selector, since, timeout),
                                 media_type="application/json")  # fmt: skip

    async def _watch(self, ns: str, selector: str, since: int,
                     seconds: float) -> AsyncIterator[bytes]:  # fmt: skip
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        wake = asyncio.Event()
        self._watchers.add(wake)
        try:
            while True:
                if since < self.compacted:
                    gone = {"kind": "Status", "status": "Failure", "reason": "Expired",
                            "code": 410, "message": f"too old resource version: {since}"}  # fmt: skip
                    yield (json.dumps({"type": "ERROR", "object": gone}) + "\n").encode()
                    return
                wake.clear()
                for version, kind, pod in [e for e in self.events if e[0] > since]:
                    since = version
                    if self._matches(pod, ns, selector):
                        yield (json.dumps({"type": kind, "object": pod}) + "\n").encode()
                if since < self.compacted or any(e[0] > since for e in self.events[-1:]):
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), max(until - loop.time(), 0))
                except TimeoutError:
                    return
        finally:
            self._watchers.discard(wake)
