"""A bounded closed-loop load generator: `concurrency` SSE streams in flight over a Service.

Load model (what makes one replica miss the TTFT target): the simulator's time to first
token is `ttft_ms + ttft_per_stream_ms * in_flight`, `in_flight` being the streams that pod
is already serving (server/sluice_server/engine/simulator.py), the way a real engine's
prefill queues behind running decodes. A closed loop keeps `concurrency` streams open in
total, spread round-robin over R ready pods, so each pod sees about concurrency/R streams:

    TTFT ~= ttft_ms + ttft_per_stream_ms * concurrency / R

More replicas bring TTFT down, which is what the HPA is meant to achieve.

The Service is resolved to its ready pods (its selector, Ready condition), as kube-proxy
would route: the Service's EndpointSlices stay empty here because Kubernetes refuses
loopback addresses in them (serving_node.py).

Bounded: at most `max_streams` streams in all, `timeout` seconds per stream, and every
worker stops when `stop()` is called or `concurrency` drops below its index.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass

import httpx
from kubernetes import client

PORT = 8000


@dataclass(frozen=True)
class Sample:
    start: float  # time.time() when the request was sent
    ttft: float | None  # seconds to the first token event; None: failed
    endpoint: str
    error: str = ""


def ready_pod_ips(core: client.CoreV1Api, namespace: str, service: str) -> list[str]:
    svc = core.read_namespaced_service(service, namespace)
    selector = ",".join(f"{k}={v}" for k, v in sorted((svc.spec.selector or {}).items()))
    ips = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        if pod.metadata.deletion_timestamp or not (pod.status and pod.status.pod_ip):
            continue
        if any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
            ips.append(pod.status.pod_ip)
    return sorted(ips)


class LoadGenerator:
    def __init__(self, api: client.ApiClient, namespace: str, service: str, *,
                 max_tokens: int = 4, max_streams: int = 50_000, timeout: float = 30.0) -> None:  # fmt: skip
        self.core = client.CoreV1Api(api)
        self.namespace, self.service = namespace, service
        self.max_tokens = max_tokens
        self.max_streams = max_streams
        self.timeout = timeout
        self.concurrency = 0
        self.endpoints: list[str] = []
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = 0
        self._rr = itertools.count()
        self._threads: list[threading.Thread] = []

    # --- control ------------------------------------------------------------------------
    def start(self) -> LoadGenerator:
        for target in (self._resolve_loop, self._run_loop):
            t = threading.Thread(target=target, name=f"loadgen-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def set_concurrency(self, n: int) -> None:
        self.concurrency = n

    def stop(self) -> None:
        self.concurrency = 0
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout + 5)

    # --- results ------------------------------------------------------------------------
    def window(self, since: float, until: float | None = None) -> list[Sample]:
        until = until or time.time()
        with self._lock:
            return [s for s in self.samples if since <= s.start < until]

    def ttft_quantile(self, q: float, since: float, until: float | None = None) -> float | None:
        values = sorted(s.ttft for s in self.window(since, until) if s.ttft is not None)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]

    # --- internals ----------------------------------------------------------------------
    def _resolve_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.endpoints = ready_pod_ips(self.core, self.namespace, self.service)
            except Exception as e:  # keep the last list; the API server may be busy
                self.errors.append(f"resolve: {e}")

    def _run_loop(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as http:
            workers: dict[int, asyncio.Task] = {}
            while not self._stop.is_set():
                for i in range(self.concurrency):
                    if i not in workers or workers[i].done():
                        workers[i] = asyncio.create_task(self._worker(i, http))
                await asyncio.sleep(0.2)
            await asyncio.gather(*workers.values(), return_exceptions=True)

    async def _worker(self, index: int, http: httpx.AsyncClient) -> None:
        while not self._stop.is_set() and index < self.concurrency:
            endpoints = self.endpoints
            if not endpoints:
                await asyncio.sleep(0.2)
                continue
            with self._lock:
                if self._started >= self.max_streams:
                    return
                self._started += 1
            ip = endpoints[next(self._rr) % len(endpoints)]
            sample = await self._one(http, ip)
            with self._lock:
                self.samples.append(sample)
            if sample.ttft is None:
                await asyncio.sleep(0.2)  # a pod going away: do not spin

    async def _one(self, http: httpx.AsyncClient, ip: str) -> Sample:
        start = time.time()
        t0 = time.monotonic()
        ttft = None
        try:
            body = {"prompt": "autoscale me", "max_tokens": self.max_tokens, "ignore_eos": True}
            async with http.stream("POST", f"http://{ip}:{PORT}/v1/stream", json=body) as r:
                if r.status_code != 200:
                    return Sample(start, None, ip, f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data:") and '"token"' in line:
                        ttft = time.monotonic() - t0
            return Sample(start, ttft, ip, "" if ttft is not None else "no token")
        except Exception as e:
            return Sample(start, ttft, ip, f"{type(e).__name__}: {e}")
