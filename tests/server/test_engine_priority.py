"""Priority classes reach vLLM's own scheduler: the real engine (tiny model) started the way
`--priority-classes` starts it (`--scheduling-policy priority`), one sequence at a time
(`--max-num-seqs 1`), so requests run strictly one after another and the access log's order
of lines is the engine's order. Behind a running batch request and two batch requests
waiting in the engine, an interactive request runs next; a batch one (the control) runs
after the two, as first come, first served. Requests go through every route that carries
the caller's class: token SSE, OpenAI chat (whose body and `X-Vllm-Priority` header ask
for more than the key gives) and the WebSocket.

The running request holds its place until the engine itself counts every later request
(not for a time): then its client leaves, the engine aborts it, and the scheduler picks the
next one from the queue it has."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import another_engine, engine_settings, serving, ws_url
from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

KEYS = "sk-batch tenant=t priority=batch\nsk-inter tenant=t priority=interactive\n"
LONG = 1500  # tokens of the running request: cut once the others are all in the engine


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(tiny_model_path, tmp_path_factory):
    """A server with priority classes on its own engine (policy and batch size are fixed
    when an engine starts); its URL, app and access log."""
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    port = free_port()
    settings = engine_settings(
        tiny_model_path, port=port, max_num_seqs=1, max_model_len=2048, api_key_file=keys,
        priority_classes=["interactive", "batch"], access_log_format="json",
    )  # fmt: skip
    logger = logging.getLogger(ACCESS_LOGGER)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        async with another_engine(settings) as engine:  # --scheduling-policy priority
            app = build_app(settings, engine)
            async with serving(uvicorn_config(settings, app)):
                yield f"http://127.0.0.1:{port}", app, handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer sk-{key}"}


async def stream(c: httpx.AsyncClient, key: str, tokens: int, started=None, release=None) -> str:
    """One token-SSE request read to its end, or until `release` is set (leaving the block
    drops the connection: the server aborts the request)."""
    body = {"prompt": f"{key} asks", "max_tokens": tokens, "ignore_eos": True}
    async with c.stream("POST", "/v1/stream", json=body, headers=auth(key)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if started is not None and line.startswith("data:") and not started.done():
                started.set_result(None)
            if release is not None and release.is_set():
                break
        return r.headers["x-request-id"]


async def chat(c: httpx.AsyncClient, key: str, tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "priority": -1000}  # fmt: skip
    headers = {**auth(key), "X-Vllm-Priority": "-1000"}
    async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        await r.aread()
        return r.headers["x-request-id"]


async def generation(url: str, key: str, tokens: int) -> str:
    async with websockets.connect(ws_url(url) + f"?api_key=sk-{key}") as ws:
        await ws.send(json.dumps({"id": key, "prompt": "ws", "params": {"max_tokens": tokens,
                                                                      "ignore_eos": True}}))  # fmt: skip
        while not (frame := json.loads(await ws.recv())).get("finished"):
            assert frame.get("type") != "error", frame
        return key


def finished(log: Lines) -> list[str]:
    """Ids in the order their access-log lines were written: the engine's order here."""
    return [x.get("stream") or x["request_id"] for x in log.lines]


async def behind_a_backlog(url, app, late) -> tuple[list[str], str]:
    """A long batch stream running, two batch ones waiting in the engine behind it, then
    `late(c)`; once the engine holds all four, the running one is cut: (the two waiting
    ones' ids, the late one's)."""
    engine = app.state.services.engine

    def holding(n: int):
        return lambda: engine.num_unfinished_requests() == n

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        started, release = asyncio.get_running_loop().create_future(), asyncio.Event()
        first = asyncio.create_task(stream(c, "batch", LONG, started, release))
        await asyncio.wait_for(started, 120)
        waiting = [asyncio.create_task(stream(c, "batch", 8)) for _ in range(2)]
        await eventually_async(holding(3), message="two waiting", timeout=15)
        last = asyncio.create_task(late(c))
        await eventually_async(holding(4), message="the late one waiting", timeout=15)
        release.set()
        _, *waited, last = await asyncio.gather(first, *waiting, last)
    return waited, last


@pytest.mark.parametrize("route", ["token-sse", "openai", "websocket"])
async def test_an_interactive_request_runs_before_batch_ones_waiting_longer(served, route):
    url, app, log = served
    late = {"token-sse": lambda c: stream(c, "inter", 8), "openai": lambda c: chat(c, "inter", 8),
            "websocket": lambda c: generation(url, "inter", 8)}[route]  # fmt: skip
    log.lines.clear()
    waited, interactive = await behind_a_backlog(url, app, late)
    done = finished(log)
    assert done.index(interactive) < min(done.index(w) for w in waited), log.lines


async def test_control_a_batch_request_waits_its_turn(served):
    url, app, log = served
    log.lines.clear()
    waited, batch = await behind_a_backlog(url, app, lambda c: stream(c, "batch", 8))
    done = finished(log)
    assert done.index(batch) > max(done.index(w) for w in waited), log.lines


async def test_a_batch_caller_asking_for_more_in_the_body_and_header_waits_its_turn(served):
    """The chat request says `"priority": -1000` and `X-Vllm-Priority: -1000` (which vLLM
    would put ahead of everything); its key is batch, so it runs after the waiting ones."""
    url, app, log = served
    log.lines.clear()
    waited, asking = await behind_a_backlog(url, app, lambda c: chat(c, "batch", 8))
    done = finished(log)
    assert done.index(asking) > max(done.index(w) for w in waited), log.lines
