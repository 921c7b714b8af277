"""Helpers for the router tests: a router served in the test loop over a models file,
model servers (the simulator engine, or the session's real engine) that come up late on a
port the models file already names, metrics read over HTTP, and an httpx transport that
keeps every byte an SDK received (SDKs hide SSE comments; the tests assert on them)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from app_helpers import serving
from prometheus_client.parser import text_string_to_metric_families
from testkit.fake_pods_api import FakePodsApi
from testkit.net import free_port
from testkit.wait import eventually_async

MODEL = "team-a/chat"  # the models file key every test uses (namespace/name)
NS, NAME = MODEL.split("/")
HEADERS = {"X-Sluice-Model": MODEL}
LABELS = {"app.kubernetes.io/name": "chat", "sluice.dev/role": "leader"}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello river"}],
        "max_tokens": 8}  # fmt: skip


def entry(port: int, **fields) -> dict:
    return {"host": "127.0.0.1", "port": port, "holdTimeoutSeconds": 30, "maxHeld": 100,
            "keepaliveSeconds": 0.2, **fields}  # fmt: skip


class Running:
    """A served router: its URL, its app (metrics, upstreams) and its models file."""

    def __init__(self, url: str, app, path: Path) -> None:
        self.url, self.app, self.path = url, app, path

    def write(self, models: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(models))
        tmp.replace(self.path)  # one rename, as a ConfigMap update swaps its link

    def held(self) -> float:
        return self.app.metrics.held.labels(NS, NAME)._value.get()

    def outcome(self, outcome: str) -> float:
        return self.app.metrics.requests.labels(NS, NAME, outcome)._value.get()


def pods_entry(port: int, **fields) -> dict:
    """An entry for a model whose pods the router watches (its Service `host` unreachable:
    nothing may go there)."""
    return entry(8000, host="chat.team-a.invalid", **fields,
                 pods={"namespace": NS, "selector": LABELS, "port": port})  # fmt: skip


@contextlib.asynccontextmanager
async def pods_api() -> AsyncIterator[tuple[FakePodsApi, str]]:
    """The fake API server (Pods only) on a free loopback port: it and its URL."""
    import uvicorn

    api = FakePodsApi()
    port = free_port()
    config = uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")  # fmt: skip
    async with serving(config):
        yield api, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def router(tmp_path: Path, models: dict, **overrides) -> AsyncIterator[Running]:
    from sluice_server.router.app import build_router
    from sluice_server.serve import router_config
    from sluice_server.settings import RouterSettings

    path = tmp_path / "models.json"
    path.write_text(json.dumps(models))
    port = free_port()
    fast = {"ready_poll_seconds": 0.1, "models_reload_seconds": 0.05, "log_level": "warning"}
    settings = RouterSettings(models_file=path, host="127.0.0.1", port=port,
                                 **{**fast, **overrides})  # fmt: skip
    app = build_router(settings)
    async with serving(router_config(settings, app)):
        # Reached as `localhost`: the models' host is 127.0.0.1, and a Host naming a model
        # is that model's request, never the router's own (its /metrics, /ready).
        yield Running(f"http://localhost:{port}", app, path)


@contextlib.asynccontextmanager
async def model_server(port: int, engine=None, host: str = "127.0.0.1", wrap=None,
                       **overrides) -> AsyncIterator[str]:  # fmt: skip
    """A model server on `host:port`, from now on: on `engine` (a simulator by default, or
    the session's real vLLM engine); `wrap`: an ASGI app around the server's (it sees each
    request first)."""
    from sluice_server.app import build_app
    from sluice_server.engine.simulator import SimulatorEngine
    from sluice_server.serve import uvicorn_config
    from sluice_server.settings import Settings

    if engine is None:
        engine = SimulatorEngine("sim", ttft_ms=5, itl_ms=2)
    if isinstance(engine, SimulatorEngine):
        base = {"model": "sim", "engine": "simulator"}
    else:
        base = {"model": "tiny", "served_model_name": "tiny"}
    settings = Settings(**{**base, "host": host, "port": port, "log_level": "warning",
                           "heartbeat_seconds": 0.5, **overrides})  # fmt: skip
    app = build_app(settings, engine)
    async with serving(uvicorn_config(settings, app if wrap is None else wrap(app))):
        yield ServerUrl(f"http://{host}:{port}", app)


class ServerUrl(str):
    """A served model server's URL, with its app (`.app`: its services, gate, metrics)."""

    app: Any

    def __new__(cls, url: str, app: Any) -> ServerUrl:
        self = super().__new__(cls, url)
        self.app = app
        return self


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def scrape(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as c:
        return metric((await c.get(url + "/metrics")).text, name, **labels)


def tee(http=httpx):
    """An AsyncClient (of `http`: httpx, or the httpx2 fork the anthropic SDK takes) whose
    transport keeps every response byte it passed on, in `client.received`."""

    class Tee(http.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = http.AsyncHTTPTransport()
            self.received = bytearray()

        async def handle_async_request(self, request):
            response = await self.inner.handle_async_request(request)
            keeper, inner = self, response.stream

            class Stream(http.AsyncByteStream):
                async def __aiter__(self):
                    async for chunk in inner:
                        keeper.received += chunk
                        yield chunk

                async def aclose(self) -> None:
                    await inner.aclose()

            return http.Response(response.status_code, headers=response.headers,
                                 stream=Stream(), extensions=response.extensions)  # fmt: skip

        async def aclose(self) -> None:
            await self.inner.aclose()

    transport = Tee()
    client = http.AsyncClient(transport=transport)
    client.received = transport.received
    return client


class RawSSE:
    """A streamed request read as raw lines, kept as they arrive (`lines`), so a test sees
    the keep-alive comments and events a held stream got, in order."""

    def __init__(self, client: httpx.AsyncClient, method: str, url: str, **kw) -> None:
        self.client, self.method, self.url, self.kw = client, method, url, kw
        self.lines: list[str] = []
        self.status: int | None = None
        self.headers: httpx.Headers | None = None

    def count(self, prefix: str) -> int:
        return sum(1 for line in self.lines if line.startswith(prefix))

    async def run(self) -> RawSSE:
        async with self.client.stream(self.method, self.url, **self.kw) as r:
            self.status, self.headers = r.status_code, r.headers
            async for line in r.aiter_lines():
                self.lines.append(line)
        return self

    def data(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.lines
                if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


async def direct_answers(url: str) -> dict:
    """What a model server answers without the router (the simulator is deterministic)."""
    async with httpx.AsyncClient(base_url=url) as c:
        chat = (await c.post("/v1/chat/completions", json=CHAT)).json()
        message = (await c.post("/v1/messages", json=CHAT)).json()
        response = await c.post("/v1/responses", json={"model": "sim", "input": "hello river",
                                                       "max_output_tokens": 8})  # fmt: skip
        tokens = RawSSE(c, "POST", "/v1/stream", json={"prompt": "hello river", "max_tokens": 8})
        await tokens.run()
    return {"chat": chat["choices"][0]["message"]["content"],
            "anthropic": message["content"][0]["text"],
            "responses": response.json()["output"][0]["content"][0]["text"],
            "tokens": "".join(d.get("token", "") for d in tokens.data())}  # fmt: skip


def sa_dir(tmp_path):
    folder = tmp_path / "serviceaccount"
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text("router-token\n")
    return folder


def candidates(act) -> list[str]:
    (podset,) = act.app.pods.sets.values()
    return [p.name for p in podset.candidates()]


async def wait_candidates(act, names: list[str]) -> None:
    await eventually_async(lambda: candidates(act) == names, timeout=15,
                           message=f"candidates {names}")  # fmt: skip
