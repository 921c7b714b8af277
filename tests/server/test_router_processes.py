"""The router as it runs in its pod (`python -m sluice_server router`, a process of
its own) in front of model servers that come up late: a real server process on the
simulator, and the real vLLM engine on the tiny model. The held requests get the whole
answer the server gives without the router."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
import websockets
from router_helpers import (
    HEADERS,
    MODEL,
    NAME,
    NS,
    RawSSE,
    entry,
    metric,
    model_server,
    router,
    tee,
)
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

CHAT = {"messages": [{"role": "user", "content": "hello river"}], "max_tokens": 8}


async def test_the_activator_process_holds_until_a_server_process_is_up(tmp_path):
    from openai import AsyncOpenAI

    port, aport = free_port(), free_port()
    models = tmp_path / "models.json"
    models.write_text(json.dumps({MODEL: entry(port, keepaliveSeconds=0.3)}))
    act = ManagedProcess("activator", [sys.executable, "-m", "sluice_server", "activator",
                                       "--models-file", str(models), "--host", "127.0.0.1",
                                       "--port", str(aport), "--ready-poll-seconds", "0.2"],
                         tmp_path).start()  # fmt: skip
    server = None
    try:
        url = f"http://localhost:{aport}"
        await asyncio.to_thread(wait_http, url + "/ready", timeout=60, process=act)
        received = tee()
        oa = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                         default_headers=HEADERS, http_client=received)  # fmt: skip

        async def stream() -> str:
            s = await oa.chat.completions.create(model="sim", **CHAT, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

        async def held() -> float:
            async with httpx.AsyncClient() as c:
                page = (await c.get(url + "/metrics")).text
            return metric(page, "sluice_activator_held_requests", namespace=NS, model=NAME)

        answer = asyncio.ensure_future(stream())
        await eventually_async(
            lambda: received.received.count(b": queued") >= 2,
            timeout=30,
            message="keep-alives while held",
        )
        assert await held() == 1
        server = ManagedProcess("server", [sys.executable, "-m", "sluice_server", "--engine",
                                           "simulator", "--model", "sim", "--host", "127.0.0.1",
                                           "--port", str(port), "--sim-ttft-ms", "5",
                                           "--sim-itl-ms", "2"], tmp_path).start()  # fmt: skip
        text = await asyncio.wait_for(answer, 90)
        async with httpx.AsyncClient() as c:
            direct = await c.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={"model": "sim", **CHAT})  # fmt: skip
            page = (await c.get(url + "/metrics")).text
        assert text == direct.json()["choices"][0]["message"]["content"]
        assert metric(page, "sluice_activator_requests_total", namespace=NS, model=NAME,
                      outcome="forwarded") == 1  # fmt: skip
        assert await held() == 0
        await oa.close()
    finally:
        for proc in (server, act):
            if proc is not None:
                proc.stop()
    assert "team-a/chat forwarded after" in act.log_path.read_text()


@pytest.mark.engine
async def test_held_requests_reach_the_real_engine_once_its_server_is_up(tmp_path, engine):
    """The session's vLLM engine (tiny model) behind a server that starts listening only
    after the router holds the requests: streamed, WebSocket and plain answers whole."""
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=60)
        body = {"model": "tiny", **CHAT, "ignore_eos": True, "temperature": 0}
        stream = RawSSE(client, "POST", "/v1/chat/completions", json={**body, "stream": True})
        plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))

        async def websocket() -> list[dict]:
            url = act.url.replace("http://", "ws://") + "/ws/stream"
            async with websockets.connect(url, additional_headers=HEADERS) as ws:
                await ws.send(
                    json.dumps(
                        {
                            "id": 1,
                            "prompt": "hello river",
                            "params": {"max_tokens": 8, "ignore_eos": True, "temperature": 0},
                        }
                    )
                )
                frames = []
                while not frames or not frames[-1].get("finished"):
                    frames.append(json.loads(await ws.recv()))
                return frames

        tasks = [asyncio.ensure_future(stream.run()), asyncio.ensure_future(websocket())]
        await eventually_async(
            lambda: act.held() == 3 and stream.count(": queued") >= 2,
            timeout=15,
            message="three held, the stream hearing keep-alives",
        )
        async with model_server(port, engine):
            _, frames = await asyncio.gather(*tasks)
            whole = await plain
        await client.aclose()
    chunks = [d for d in stream.data() if d.get("choices")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 8
    assert streamed == whole.json()["choices"][0]["message"]["content"]  # greedy: the same
    assert stream.lines[-2] == "data: [DONE]"
    assert frames[-1]["finished"] and frames[-1]["usage"]["completion_tokens"] == 8
    assert act.outcome("forwarded") == 3


async def test_on_sigterm_held_requests_give_up_cleanly_and_the_process_exits_0(tmp_path):
    port, aport = free_port(), free_port()  # no model server ever listens on `port`
    models = tmp_path / "models.json"
    models.write_text(json.dumps({MODEL: entry(port, keepaliveSeconds=0.3)}))
    # `router` is the mode's name; the other test starts it as `activator` (what charts call).
    act = ManagedProcess("router", [sys.executable, "-m", "sluice_server", "router",
                                    "--models-file", str(models), "--host", "127.0.0.1",
                                    "--port", str(aport), "--drain-timeout-seconds", "0.5"],
                         tmp_path).start()  # fmt: skip
    try:
        url = f"http://localhost:{aport}"
        await asyncio.to_thread(wait_http, url + "/ready", timeout=60, process=act)
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=30) as c:
            stream = RawSSE(c, "POST", "/v1/chat/completions",
                            json={"model": "sim", **CHAT, "stream": True})  # fmt: skip
            running = asyncio.ensure_future(stream.run())
            plain = asyncio.ensure_future(c.post("/v1/chat/completions",
                                                 json={"model": "sim", **CHAT}))  # fmt: skip

            async def both_held() -> bool:
                async with httpx.AsyncClient() as own:
                    page = (await own.get(url + "/metrics")).text
                held = metric(page, "sluice_activator_held_requests", namespace=NS, model=NAME)
                return held == 2 and stream.count(": queued") >= 1

            await eventually_async(both_held, timeout=30, message="both held, the stream committed")
            assert act.proc is not None
            act.proc.terminate()  # SIGTERM
            r = await plain
            await running
        assert await asyncio.to_thread(act.proc.wait, 30) == 0
    finally:
        act.stop()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "model_starting"
    assert "shutting down" in r.json()["error"]["message"]
    error = json.loads(next(line for line in stream.lines if line.startswith("data: {"))[6:])
    assert error["error"]["code"] == "model_starting" and stream.lines[-2] == "data: [DONE]"
    log = act.log_path.read_text()
    assert "draining: 2 requests held" in log and log.count("team-a/chat timeout after") == 2
