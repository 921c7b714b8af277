"""The engine's node group on `/metrics`: `sluice_engine_nodes` (`--nnodes`),
`sluice_engine_node_rank` (the leader's 0: only the leader serves HTTP) and
`sluice_engine_group_up`, the same verdict `/ready` gives (on several nodes vLLM opens its
engine only once every node's workers joined). Over an engine whose health check the test
turns off and on: the gauge follows it, as `/ready` does (the negative control: it reads 0
while the engine is down, so a constant 1 would fail)."""

from __future__ import annotations

import httpx
import pytest
from app_helpers import serving
from prometheus_client.parser import text_string_to_metric_families
from sluice_server.app import build_app
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.serve import uvicorn_config
from sluice_server.settings import Settings
from testkit.net import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")


class LosableEngine(SimulatorEngine):
    """The simulator, with a health check that fails while `lost` is set (a worker gone)."""

    lost = False

    async def check_health(self) -> None:
        if self.lost:
            raise RuntimeError("a worker node left the engine")
        await super().check_health()


def _gauges(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("sluice_engine_")
    }


async def _scrape(c: httpx.AsyncClient) -> dict[str, float]:
    r = await c.get("/metrics")
    assert r.status_code == 200
    return _gauges(r.text)


def _settings(port: int, **extra) -> Settings:
    return Settings(model="sim", host="127.0.0.1", port=port, log_level="warning", **extra)


@pytest.mark.parametrize(
    "extra, nodes",
    [
        ({"engine": "simulator"}, 1),
        # The leader's settings of a two-node group (the engine itself is the test's).
        (
            {"engine": "vllm", "nnodes": 2, "pipeline_parallel_size": 2,
             "master_addr": "127.0.0.1"},
            2,
        ),
    ],
)  # fmt: skip
async def test_group_gauges_follow_the_engine_and_ready(extra, nodes):
    engine = LosableEngine(model_name="sim", ttft_ms=1, itl_ms=1, ttft_per_stream_ms=0, jitter=0)
    port = free_port()
    settings = _settings(port, **extra)
    try:
        async with serving(uvicorn_config(settings, build_app(settings, engine))):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                up = await _scrape(c)
                assert up == {
                    "sluice_engine_nodes": nodes,
                    "sluice_engine_node_rank": 0,
                    "sluice_engine_group_up": 1,
                }
                assert (await c.get("/ready")).status_code == 200
                engine.lost = True
                ready = await c.get("/ready")
                assert ready.status_code == 503 and "worker node left" in ready.text
                assert (await _scrape(c))["sluice_engine_group_up"] == 0
                engine.lost = False
                assert (await _scrape(c))["sluice_engine_group_up"] == 1
                assert (await c.get("/ready")).status_code == 200
    finally:
        await engine.shutdown()


async def test_group_is_down_before_the_engine_is_loaded():
    """No engine yet (vLLM still waiting for the group): the gauge says 0, /ready 503."""
    settings = _settings(free_port(), engine="simulator")
    app = build_app(settings, None)  # no lifespan: the engine never opens
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.get("/ready")).status_code == 503
        assert (await _scrape(c))["sluice_engine_group_up"] == 0
