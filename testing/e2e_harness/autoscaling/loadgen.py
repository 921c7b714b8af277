"""A bounded closed-loop load generator: `concurrency` SSE streams in flight over a Service.

Load model (what makes one replica miss the TTFT target): the simulator's time to first
token is `ttft_ms + ttft_per_stream_ms * in_flight`, `in_flight` being the streams that pod
is already serving (server/sluice_server/engine/simulator.py), the way a real engine's
prefill queues behind running decodes. A closed loop keeps `concurrency` streams open in
total, spread round-robin over R ready pods, so each pod sees about concurrency/R streams:

    TTFT ~= ttft_ms + ttft_per_stream_ms * concurrency / R

More replicas bring TTFT down, which is what the HPA is meant to achieve.

With `url` (the model's address on the e2e ingress) every stream goes there and the ingress
spreads them over the Ready pods (round robin); each sample's `endpoint` is the pod that
answered (the ingress's `X-E2E-Upstream` header). Without, the Service is resolved to its
ready pods (harness/endpoints.py, as kube-proxy would route; the Service's EndpointSlices
stay empty here because Kubernetes refuses loopback addresses in them) and the client
spreads the streams itself.

Bounded: at most `max_streams` streams in all, `timeout` seconds per stream, and every
worker stops when `stop()` is called or `concurrency` drops below its index. The client runs
in its own process (spawned, stopped by `stop()`), so its timing does not depend on the
test process's other threads.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass

import httpx
from kubernetes import client

from ..endpoints import ready_pod_ips

PORT = 8000


@dataclass(frozen=True)
class Sample:
    start: float  # time.time() when the request was sent
    ttft: float | None  # seconds to the first token event; None: failed
    endpoint: str
    error: str = ""


class LoadGenerator:
    """The client runs in a process of its own (its TTFT must not include waits for the GIL
    behind the test's other threads: adapter, discovery, timeline); this object steers it
    and collects its samples."""

    def __init__(self, api: client.ApiClient, namespace: str, service: str, *,
                 url: str | None = None, max_tokens: int = 4, max_streams: int = 50_000,
                 timeout: float = 30.0) -> None:  # fmt: skip
        self.core = client.CoreV1Api(api)
        self.namespace, self.service = namespace, service
        self.url = url
        self.max_tokens = max_tokens
        self.max_streams = max_streams
        self.timeout = timeout
        self.concurrency = 0
        self.endpoints: list[str] = []
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        ctx = mp.get_context("spawn")
        self._conc = ctx.Value("i", 0)
        self._child_stop = ctx.Event()
        self._endpoints_q = ctx.Queue()
        self._samples_q = ctx.Queue()
        self._proc = ctx.Process(
            target=_client_main,
            args=(self._conc, self._child_stop, self._endpoints_q, self._samples_q,
                  max_tokens, max_streams, timeout),
            name="loadgen", daemon=True,
        )  # fmt: skip

    # --- control ------------------------------------------------------------------------
    def start(self) -> LoadGenerator:
        self._proc.start()
        loops = [self._collect_loop]
        if self.url:
            self.endpoints = [self.url]
            self._endpoints_q.put(self.endpoints)
        else:
            loops.append(self._resolve_loop)
        for target in loops:
            t = threading.Thread(target=target, name=f"loadgen-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def set_concurrency(self, n: int) -> None:
        self.concurrency = n
        self._conc.value = n

    def stop(self) -> None:
        self.set_concurrency(0)
        self._child_stop.set()
        self._proc.join(self.timeout + 5)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    # --- results ------------------------------------------------------------------------
    def window(self, since: float, until: float | None = None) -> list[Sample]:
        until = until or time.time()
        with self._lock:
            samples = list(self.samples)
        return [s for s in samples if since <= s.start < until]

    def ttft_quantile(self, q: float, since: float, until: float | None = None) -> float | None:
        values = sorted(s.ttft for s in self.window(since, until) if s.ttft is not None)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]

    # --- parent side --------------------------------------------------------------------
    def _resolve_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                endpoints = ready_pod_ips(self.core, self.namespace, self.service)
            except Exception as e:  # keep the last list; the API server may be busy
                self.errors.append(f"resolve: {e}")
                continue
            if endpoints != self.endpoints:
                self.endpoints = endpoints
                self._endpoints_q.put(endpoints)

    def _collect_loop(self) -> None:
        while not (self._stop.is_set() and self._samples_q.empty()):
            try:
                batch = self._samples_q.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._lock:
                self.samples.extend(Sample(*s) for s in batch)


# --- the client process ---------------------------------------------------------------------


def _client_main(conc, stop, endpoints_q, samples_q, max_tokens, max_streams, timeout) -> None:
    asyncio.run(
        _Client(conc, stop, endpoints_q, samples_q, max_tokens, max_streams, timeout).main()
    )


class _Client:
    def __init__(self, conc, stop, endpoints_q, samples_q, max_tokens, max_streams, timeout):
        self.conc, self.stop = conc, stop
        self.endpoints_q, self.samples_q = endpoints_q, samples_q
        self.max_tokens, self.max_streams, self.timeout = max_tokens, max_streams, timeout
        self.endpoints: list[str] = []
        self.started = 0
        self.rr = itertools.count()
        self.batch: list[tuple] = []

    async def main(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as http:
            workers: dict[int, asyncio.Task] = {}
            while not self.stop.is_set():
                while True:
                    try:
                        self.endpoints = self.endpoints_q.get_nowait()
                    except queue.Empty:
                        break
                for i in range(self.conc.value):
                    if i not in workers or workers[i].done():
                        workers[i] = asyncio.create_task(self.worker(i, http))
                if self.batch:
                    self.samples_q.put(self.batch)
                    self.batch = []
                await asyncio.sleep(0.2)
            await asyncio.gather(*workers.values(), return_exceptions=True)
            if self.batch:
                self.samples_q.put(self.batch)

    async def worker(self, index: int, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set() and index < self.conc.value:
            endpoints = self.endpoints
            if not endpoints or self.started >= self.max_streams:
                await asyncio.sleep(0.2)
                continue
            self.started += 1
            target = endpoints[next(self.rr) % len(endpoints)]
            sample = await self.one(http, target)
            self.batch.append(tuple(sample.__dict__.values()))
            if sample.ttft is None:
                await asyncio.sleep(0.2)  # a pod going away: do not spin

    async def one(self, http: httpx.AsyncClient, target: str) -> Sample:
        """One stream to `target`: a pod IP, or a URL (the ingress) whose answer names the
        pod in `X-E2E-Upstream`."""
        start = time.time()
        t0 = time.monotonic()
        ttft = None
        url = f"{target}/v1/stream" if "://" in target else f"http://{target}:{PORT}/v1/stream"
        ip = target
        try:
            body = {"prompt": "autoscale me", "max_tokens": self.max_tokens, "ignore_eos": True}
            async with http.stream("POST", url, json=body) as r:
                if "x-e2e-upstream" in r.headers:
                    ip = r.headers["x-e2e-upstream"].rsplit(":", 1)[0]
                if r.status_code != 200:
                    return Sample(start, None, ip, f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data:") and '"token"' in line:
                        ttft = time.monotonic() - t0
            return Sample(start, ttft, ip, "" if ttft is not None else "no token")
        except Exception as e:
            return Sample(start, ttft, ip, f"{type(e).__name__}: {e}")
