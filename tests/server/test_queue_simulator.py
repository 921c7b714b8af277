"""The admission queue through the real server (uvicorn, the server's own configuration) on
the simulator engine, one process: when a queued stream commits to 200 and what each
protocol then says, WebSocket keep-alive frames, a client that leaves while queued, priority
order into the engine, metrics, the access log, and a drain with a queue.

Every verdict is taken from what the server recorded (its access log, its metrics, the
engine's own list of started requests), never from how fast this process got somewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
import pytest
import websockets
from app_helpers import serving, ws_url
from pod_helpers import metric
from sluice_server.app import build_app
from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.serve import uvicorn_config
from sluice_server.settings import Settings
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEYS = "sk-hold tenant=a priority=batch\nsk-high tenant=a priority=interactive\n" \
       "sk-low tenant=b priority=batch\n"  # fmt: skip
AUTH = {k: {"Authorization": f"Bearer sk-{k}"} for k in ("hold", "high", "low")}


class Recording(SimulatorEngine):
    """The simulator, noting each engine request's priority when it starts (its generator
    is first iterated): a request that never reaches here never started."""

    def __init__(self) -> None:
        super().__init__(model_name="sim", ttft_ms=5, itl_ms=20)
        self.started: list[int] = []

    def generate(self, request):
        inner = super().generate(request)

        async def started():
            self.started.append(request.priority)
            async for delta in inner:
                yield delta

        return started()


class Access(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))

    def of(self, rid: str) -> dict | None:
        return next((x for x in self.lines if x["request_id"] == rid), None)


@pytest.fixture
def access():
    logger = logging.getLogger(ACCESS_LOGGER)
    handler, level = Access(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@contextlib.asynccontextmanager
async def pod(tmp_path, **overrides):
    """The app on a recording simulator: cap 1, a queue of 4, priority classes, keys."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    port = free_port()
    flags = dict(max_concurrent_streams=1, queue_size=4, queue_timeout_seconds=30,
                 priority_classes=["interactive", "batch"], api_key_file=keys,
                 access_log_format="json", heartbeat_seconds=30, log_level="warning")  # fmt: skip
    settings = Settings(model="sim", engine="simulator", host="127.0.0.1", port=port,
                        **{**flags, **overrides})  # fmt: skip
    engine = Recording()
    app = build_app(settings, engine)
    try:
        async with serving(uvicorn_config(settings, app)):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                yield c, app, engine
    finally:
        await engine.shutdown()


async def scrape(c: httpx.AsyncClient) -> str:
    return (await c.get("/metrics")).text


async def depth(c: httpx.AsyncClient) -> float:
    return metric(await scrape(c), "sluice_queue_depth")


@contextlib.asynccontextmanager
async def holding(c: httpx.AsyncClient, tokens: int = 2000, key: str = "hold"):
    """A stream that holds the pod's one slot until the block ends (its first token seen)."""
    started = asyncio.get_running_loop().create_future()
    body = {"prompt": "hold", "max_tokens": tokens, "ignore_eos": True}

    async def read():
        async with c.stream("POST", "/v1/stream", json=body, headers=AUTH[key]) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and not started.done():
                    started.set_result(r.headers["x-request-id"])
        return r.headers["x-request-id"]

    task = asyncio.create_task(read())
    await asyncio.wait_for(asyncio.shield(started), 30)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# One streamed request per HTTP protocol, with where its error event names the code.
PROTOCOLS = {
    "sse": ("/v1/stream", {"prompt": "q", "max_tokens": 4}, lambda e: e["error"]["code"]),
    "openai": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                        "max_tokens": 4, "stream": True},
               lambda e: e["error"]["code"]),
    "anthropic": ("/v1/messages", {"model": "sim", "max_tokens": 4, "stream": True,
                                   "messages": [{"role": "user", "content": "q"}]},
                  lambda e: e["error"]["type"]),
    "responses": ("/v1/responses", {"input": "q", "max_output_tokens": 4, "stream": True},
                  lambda e: e["code"]),
}  # fmt: skip
EXPECTED_CODE = {"sse": "queue_timeout", "openai": "queue_timeout",
                 "anthropic": "rate_limit_error", "responses": "queue_timeout"}  # fmt: skip


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_a_short_wait_gets_a_real_429_with_retry_after(tmp_path, access, protocol):
    """Refused before a heartbeat of waiting: nothing was sent, so a real status."""
    path, body, _ = PROTOCOLS[protocol]
    async with pod(tmp_path, queue_timeout_seconds=0.5, heartbeat_seconds=10) as (c, _, eng):
        async with holding(c):
            r = await c.post(path, json=body, headers=AUTH["low"])
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        err = r.json()["error"]
        assert err.get("code", err.get("type")) in ("queue_timeout", "rate_limit_error"), err
        line = await eventually_async(
            lambda: access.of(r.headers["x-request-id"]), message="log line", timeout=15
        )
        assert (line["status"], line["outcome"], line["priority"]) == (429, "rejected", "batch")
        assert line["queue_ms"] >= 500
        assert eng.started == [1]  # only the holding stream ever reached the engine


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_a_long_wait_commits_to_200_then_ends_with_the_protocols_error(tmp_path, access,
                                                                             protocol):  # fmt: skip
    """Still waiting after a heartbeat: 200 and `: queued` keep-alives, then the protocol's
    own error event with the queue's code when the timeout passes."""
    path, body, code_of = PROTOCOLS[protocol]
    async with pod(tmp_path, queue_timeout_seconds=1.2, heartbeat_seconds=0.3) as (c, _, eng):
        async with holding(c):
            lines = []
            async with c.stream("POST", path, json=body, headers=AUTH["low"]) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
                lines = [line async for line in r.aiter_lines() if line]
        keepalives = [x for x in lines if x == ": queued"]
        assert keepalives and lines[0] == ": queued", lines
        error = next(
            json.loads(x[5:]) for x in lines if x.startswith("data:") and "[DONE]" not in x
        )
        assert code_of(error) == EXPECTED_CODE[protocol], error
        line = await eventually_async(lambda: access.of(rid), message="log line", timeout=15)
        assert line["outcome"] == "failed" and line["queue_ms"] >= 1200
        assert line["completion_tokens"] == 0 and eng.started == [1]


async def test_websocket_generation_waits_with_queued_frames(tmp_path, access):
    async with pod(tmp_path, heartbeat_seconds=0.3) as (c, _, eng):
        url = ws_url(str(c.base_url)) + "?api_key=sk-high"
        async with websockets.connect(url) as ws:
            async with holding(c, tokens=40):  # about a second of tokens
                await ws.send(json.dumps({"id": "w", "prompt": "q", "params": {"max_tokens": 3}}))
                first = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert first["type"] == "queued" and first["id"] == "w"
                frames = [first]
                while not frames[-1].get("finished"):
                    frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        assert frames[-1]["usage"]["completion_tokens"] == 3
        assert eng.started == [1, 0]  # its generation started only once it had the slot
        line = await eventually_async(lambda: next((x for x in access.lines if x.get("stream") == "w"),
                                             None), message="ws log line", timeout=15)  # fmt: skip
        assert line["outcome"] == "finished" and line["queue_ms"] > 0


@pytest.mark.parametrize("heartbeat", [30.0, 0.2], ids=["before-200", "after-200"])
async def test_a_client_that_leaves_the_queue_frees_its_place_at_once(tmp_path, access,
                                                                      heartbeat):  # fmt: skip
    async with pod(tmp_path, queue_size=1, queue_timeout_seconds=60,
                   heartbeat_seconds=heartbeat) as (c, _, eng):  # fmt: skip
        async with holding(c):
            body = {"prompt": "leave", "max_tokens": 4}
            answered = asyncio.get_running_loop().create_future()

            async def leaver():
                async with c.stream("POST", "/v1/stream", json=body, headers=AUTH["low"]) as r:
                    answered.set_result(r.status_code)
                    async for _ in r.aiter_lines():
                        pass

            task = asyncio.create_task(leaver())
            await eventually_async(lambda: depth(c), message="queued", timeout=15)
            if heartbeat < 1:  # committed to 200 first
                assert await asyncio.wait_for(asyncio.shield(answered), 30) == 200
            task.cancel()  # the connection closes: the server sees the client go
            await asyncio.gather(task, return_exceptions=True)
            # Well inside the 60 s timeout: the place is free, nothing reached the engine.
            await eventually_async(
                lambda: _is(depth(c), 0), timeout=10, message="queue place freed"
            )
            line = await eventually_async(lambda: next((x for x in access.lines
                                                  if x["outcome"] == "disconnected"), None), timeout=15)  # fmt: skip
            assert line["queue_ms"] < 60_000 and line["completion_tokens"] == 0
            again = asyncio.create_task(c.post("/v1/stream", json=body, headers=AUTH["low"]))
            await eventually_async(
                lambda: depth(c), message="queued again, not refused", timeout=15
            )
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)
        assert eng.started == [1]


async def test_the_higher_class_goes_first_and_the_engine_sees_each_class(tmp_path, access):
    async with pod(tmp_path) as (c, _, eng):
        body = {"prompt": "q", "max_tokens": 2}
        async with holding(c) as hold:
            low = asyncio.create_task(c.post("/v1/stream", json=body, headers=AUTH["low"]))
            await eventually_async(lambda: depth(c), message="low queued", timeout=15)
            chat = {
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 2,
                "stream": True,
                "priority": -100,
            }  # a body's priority is not the caller's
            high = asyncio.create_task(c.post("/v1/chat/completions", json=chat,
                                              headers=AUTH["high"]))  # fmt: skip
            await eventually_async(lambda: _is(depth(c), 2), message="high queued", timeout=15)
            hold.cancel()  # the slot frees: the interactive request is admitted first
            await asyncio.gather(low, high)
        assert eng.started == [1, 0, 1]
        text = await scrape(c)
        waits = {(t, p): metric(text, "sluice_queue_wait_seconds_count", tenant=t, priority=p)
                 for t, p in (("a", "batch"), ("a", "interactive"), ("b", "batch"))}  # fmt: skip
        assert waits == {("a", "batch"): 1, ("a", "interactive"): 1, ("b", "batch"): 1}
        assert metric(text, "sluice_queue_wait_seconds_bucket", tenant="a", priority="batch",
                      le="0.0") == 1  # the holder found a free slot  # fmt: skip
        assert metric(text, "sluice_queue_depth") == 0


@pytest.mark.parametrize("protocol", ["sse", "openai", "websocket"])
async def test_active_streams_are_those_holding_a_slot_the_rest_wait(tmp_path, access,
                                                                     protocol):  # fmt: skip
    """N slots, M > N streams all answered (200 after a heartbeat of waiting, or a WebSocket
    generation that waits in its stream): `sluice_active_streams` is N, the queue's depth
    M - N, and every one of the M counts as accepted (`sluice_requests_total`, which the
    alerts divide the disconnects and stream errors of queued streams by). As streams end,
    the waiting ones take their slots and count as active; at the end nothing does."""
    slots, streams = 2, 5
    async with pod(tmp_path, max_concurrent_streams=slots, queue_size=8,
                   heartbeat_seconds=0.1) as (c, _, eng):  # fmt: skip
        answered: list[int] = []

        async def sse(path: str, body: dict) -> None:
            async with c.stream("POST", path, json=body, headers=AUTH["low"]) as r:
                answered.append(r.status_code)
                async for _ in r.aiter_lines():
                    pass

        async def ws(i: int) -> None:
            url = ws_url(str(c.base_url)) + "?api_key=sk-low"
            async with websockets.connect(url) as sock:
                await sock.send(json.dumps({"id": i, "prompt": "q",
                                            "params": {"max_tokens": 2000, "ignore_eos": True}}))  # fmt: skip
                await sock.recv()
                answered.append(200)
                async for _ in sock:
                    pass

        long = {"max_tokens": 2000, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": "q"}], "stream": True, **long}
        start = {"sse": lambda i: sse("/v1/stream", {"prompt": "q", **long}),
                 "openai": lambda i: sse("/v1/chat/completions", chat),
                 "websocket": ws}[protocol]  # fmt: skip
        tasks = [asyncio.create_task(start(i)) for i in range(streams)]
        try:
            await eventually_async(lambda: len(answered) == streams, timeout=30,
                                   message="every stream answered")  # fmt: skip
            text = await scrape(c)
            assert metric(text, "sluice_active_streams", protocol=protocol) == slots
            assert metric(text, "sluice_queue_depth") == streams - slots
            assert metric(text, "sluice_requests_total", protocol=protocol) == streams
            assert eng.started == [1] * slots  # only the slot holders reached the engine
            tasks.pop(0).cancel()  # one stream ends: a waiting one takes its slot
            await eventually_async(lambda: _is(depth(c), streams - slots - 1), timeout=15,
                                   message="a waiting stream admitted")  # fmt: skip
            assert metric(await scrape(c), "sluice_active_streams", protocol=protocol) == slots
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await eventually_async(lambda: _is(active(c, protocol), 0), timeout=15,
                               message="no stream active")  # fmt: skip
        assert metric(await scrape(c), "sluice_queue_depth") == 0


async def active(c: httpx.AsyncClient, protocol: str) -> float:
    return metric(await scrape(c), "sluice_active_streams", protocol=protocol)


async def _is(value, n: int) -> bool:
    return (await value) == n


async def test_a_full_queue_sheds_the_lower_class_and_counts_why(tmp_path, access):
    async with pod(tmp_path, queue_size=1) as (c, _, eng):
        body = {"prompt": "q", "max_tokens": 2}
        async with holding(c) as hold:
            low = asyncio.create_task(c.post("/v1/stream", json=body, headers=AUTH["low"]))
            await eventually_async(lambda: depth(c), message="low queued", timeout=15)
            high = asyncio.create_task(c.post("/v1/stream", json=body, headers=AUTH["high"]))
            shed = await low  # displaced at once by the higher class
            assert shed.status_code == 429 and shed.json()["error"]["code"] == "queue_full"
            refused = await c.post("/v1/stream", json=body, headers=AUTH["low"])
            assert refused.status_code == 429 and "retry-after" in refused.headers
            hold.cancel()
            assert (await high).status_code == 200
        text = await scrape(c)
        assert metric(text, "sluice_queue_sheds_total", priority="batch", reason="displaced") == 1
        assert metric(text, "sluice_queue_sheds_total", priority="batch", reason="queue_full") == 1
        assert metric(text, "sluice_rejections_total", reason="capacity") == 2
        assert eng.started == [1, 0]


async def test_drain_refuses_the_queue_at_once_and_lets_streams_finish(tmp_path, access):
    async with pod(tmp_path, heartbeat_seconds=0.3) as (c, app, eng):
        body = {"prompt": "q", "max_tokens": 2}
        svc = app.state.services
        async with c.stream("POST", "/v1/stream", json={"prompt": "run", "max_tokens": 60,
                                                        "ignore_eos": True},
                            headers=AUTH["hold"]) as running:  # fmt: skip
            lines = running.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break
            before = asyncio.create_task(c.post("/v1/stream", json=body, headers=AUTH["low"]))
            await eventually_async(lambda: depth(c), message="queued", timeout=15)
            drained = asyncio.create_task(svc.gate.drain(30))
            refused = await before
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            rest = [line async for line in lines if line.startswith("data:")]
        assert json.loads(rest[-2][5:])["finish_reason"] == "length"  # finished whole
        assert await drained == 0
        line = access.of(refused.headers["x-request-id"])
        running_line = access.of(running.headers["x-request-id"])
        # The server's own clock: the queued request was answered before the stream ended.
        assert line["duration_ms"] < running_line["duration_ms"]
        assert eng.started == [1]


async def test_a_key_file_reload_changes_a_callers_class_never_the_classes(tmp_path, access):
    async with pod(tmp_path, credentials_reload_seconds=0.1) as (c, _, eng):
        keys = tmp_path / "keys"

        async def reloads(result: str) -> float:
            return metric(await scrape(c), "sluice_credential_reloads_total", result=result)

        async def class_of_a_request() -> str:
            r = await c.post("/v1/stream", json={"prompt": "q", "max_tokens": 1},
                             headers=AUTH["low"])  # fmt: skip
            line = await eventually_async(lambda: access.of(r.headers["x-request-id"]), timeout=15)
            return line["priority"]

        assert await class_of_a_request() == "batch"
        keys.write_text(KEYS.replace("sk-low tenant=b priority=batch",
                                     "sk-low tenant=b priority=interactive"))  # fmt: skip
        await eventually_async(lambda: _is(reloads("ok"), 1), message="reloaded", timeout=15)
        assert await class_of_a_request() == "interactive"
        keys.write_text(KEYS.replace("sk-low tenant=b priority=batch", "sk-low priority=urgent"))
        await eventually_async(lambda: _is(reloads("error"), 1), message="refused", timeout=15)
        assert await class_of_a_request() == "interactive"  # the keys before it stay
        assert eng.started == [1, 0, 0]
