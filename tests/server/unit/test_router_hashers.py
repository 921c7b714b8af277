"""A model's prompt hasher as the router keeps it (router/hashers.py): None until a pod's
description has been read, a failing read logged once and retried, a new or restarted pod
read at once and the hasher rebuilt only when its description differs, and the first
pod read again every refresh interval; its readiness and failed reads are metrics."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from sluice_server.router import hashers
from sluice_server.router.hashers import ModelHasher, failure_reason
from sluice_server.router.metrics import RouterMetrics
from sluice_server.router.models import Model, Models, PodSelector
from sluice_server.router.pods import Pod, PodSet
from testkit.wait import eventually_async

BODY = b'{"prompt": "one two three four five six seven eight nine"}'
PATH = "/v1/completions"


def description(block_size: int = 4) -> dict:
    return {"enabled": True, "block_size": block_size, "hash_algo": "sha256",
            "none_hash_seed": "0", "loras": {}, "tokenizer": {"kind": "words"}}  # fmt: skip


class Pods:
    """The pods' `GET /internal/prefix-cache` behind an httpx MockTransport: by IP, a
    description, or 503 for an IP in `failing`; every request noted in `asked`."""

    def __init__(self) -> None:
        self.descs: dict[str, dict] = {}
        self.failing: set[str] = set()
        self.asked: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        ip = request.url.host
        self.asked.append(ip)
        if ip in self.failing or ip not in self.descs:
            return httpx.Response(503, json={"error": "the engine is not loaded"})
        return httpx.Response(200, json=self.descs[ip])


def pod(name: str, ip: str, restarts: int = 0) -> Pod:
    return Pod(name, f"uid-{name}", ip, True, False, restarts, ("c1",))


def model() -> Model:
    selector = PodSelector("team-a", (("app", "chat"),), 8000, None)
    return Model("team-a", "chat", "chat.invalid", 8000, 30.0, 100, 1.0, selector)


def ready(metrics: RouterMetrics) -> float | None:
    labels = {"namespace": "team-a", "model": "chat"}
    return metrics.registry.get_sample_value("sluice_router_prefix_hasher_ready", labels)


def failures(metrics: RouterMetrics, reason: str) -> float | None:
    labels = {"namespace": "team-a", "model": "chat", "reason": reason}
    return metrics.registry.get_sample_value(
        "sluice_router_prefix_hasher_fetch_failures_total", labels
    )


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(hashers, "RETRY_MIN", 0.01)
    monkeypatch.setattr(hashers, "RETRY_MAX", 0.05)


async def test_fetched_in_the_background_retried_and_rebuilt_when_the_description_changes(
    tmp_path, caplog, fast_retries
):
    caplog.set_level(logging.INFO, logger="sluice_server.router.hashers")
    pods, served = PodSet(model().pods), Pods()  # type: ignore[arg-type]
    client = httpx.AsyncClient(transport=httpx.MockTransport(served.handle))
    metrics = RouterMetrics()
    hasher = ModelHasher(model(), pods, client, tmp_path, refresh=3600, metrics=metrics)
    hasher.start()
    try:
        assert hasher(PATH, BODY, None) is None and not hasher.ready  # no candidate yet
        assert ready(metrics) == 0.0 and failures(metrics, "status") is None
        served.descs["10.0.0.1"] = description()
        served.failing.add("10.0.0.1")
        pods.replace([pod("pod-a", "10.0.0.1")])
        # The first candidate's description cannot be read: retried, logged once.
        await eventually_async(lambda: len(served.asked) >= 3, timeout=5)
        assert hasher(PATH, BODY, None) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "pod-a" in warnings[0].getMessage()
        # Logged once, counted every time (a 503: `status`), and still not ready.
        assert (failures(metrics, "status") or 0) >= 3 and ready(metrics) == 0.0
        served.failing.clear()
        await eventually_async(lambda: hasher.ready, timeout=5, message="the hasher")
        assert ready(metrics) == 1.0
        counted = failures(metrics, "status")
        assert hasher.source == "pod-a"
        first, digest = hasher.hasher, hasher.digest
        assert hasher(PATH, BODY, None) is not None and len(hasher(PATH, BODY, None)) == 2
        # A new pod with the same description is read, and nothing is rebuilt.
        served.descs["10.0.0.2"] = description()
        pods.replace([pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")])
        await eventually_async(lambda: "10.0.0.2" in served.asked, timeout=5)
        assert hasher.hasher is first and hasher.source == "pod-a"
        # pod-b restarts with another block size: rebuilt from it.
        served.descs["10.0.0.2"] = description(block_size=2)
        pods.replace([pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2", restarts=1)])
        await eventually_async(lambda: hasher.source == "pod-b", timeout=5)
        assert hasher.digest != digest and len(hasher(PATH, BODY, None) or []) == 4
        # Control: with no change, no pod is read again (the refresh is an hour away).
        asked = len(served.asked)
        pods.replace([pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2", restarts=1)])
        await asyncio.sleep(0.3)  # what is awaited: that nothing happens
        assert len(served.asked) == asked
        # Reads that succeed count no failure.
        assert failures(metrics, "status") == counted
    finally:
        await hasher.aclose()
        await client.aclose()


async def test_the_first_pod_is_read_again_every_refresh_interval(tmp_path):
    pods, served = PodSet(model().pods), Pods()  # type: ignore[arg-type]
    served.descs["10.0.0.1"] = description()
    client = httpx.AsyncClient(transport=httpx.MockTransport(served.handle))
    hasher = ModelHasher(model(), pods, client, tmp_path, refresh=0.05)
    pods.replace([pod("pod-a", "10.0.0.1")])
    hasher.start()
    try:
        await eventually_async(lambda: hasher.ready, timeout=5)
        assert len(hasher(PATH, BODY, None) or []) == 2
        # An adapter loaded at run time: no pod restarts, the refresh finds it.
        served.descs["10.0.0.1"] = {**description(), "loras": {"sql": "/adapters/sql"}}
        before = hasher.digest
        await eventually_async(lambda: hasher.digest != before, timeout=5)
        assert hasher.hasher is not None and hasher.hasher.loras == {"sql": "/adapters/sql"}
        # Prefix caching turned off: no hasher, placement by load.
        served.descs["10.0.0.1"] = {**description(), "enabled": False}
        await eventually_async(lambda: not hasher.ready, timeout=5)
        assert hasher(PATH, BODY, None) is None
    finally:
        await hasher.aclose()
        await client.aclose()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (httpx.ConnectError("refused"), "unreachable"),
        (httpx.ReadTimeout("slow"), "unreachable"),
        (TimeoutError(), "unreachable"),  # the read's own deadline (an OSError too)
        (
            httpx.HTTPStatusError(
                "503",
                request=httpx.Request("GET", "http://10.0.0.1"),
                response=httpx.Response(503),
            ),
            "status",
        ),
        (ValueError("the tokenizer files do not match their content hash"), "invalid"),
        (KeyError("sha256"), "invalid"),
        (PermissionError("read-only"), "storage"),
    ],
)
def test_failed_reads_are_counted_by_reason(error, reason):
    assert failure_reason(error) == reason


async def test_a_model_that_leaves_the_file_loses_its_ready_series(tmp_path):
    metrics = RouterMetrics()
    metrics.loaded(Models([model()]))
    async with httpx.AsyncClient() as client:
        pods = PodSet(model().pods)  # type: ignore[arg-type]
        ModelHasher(model(), pods, client, tmp_path, 1, metrics=metrics)
    assert ready(metrics) == 0.0  # from the start, before any read
    metrics.loaded(Models([]))
    assert ready(metrics) is None
