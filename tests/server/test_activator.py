"""The activator in front of a real model server that comes up late: every kind of held
request gets its whole answer, held streams hear keep-alives while they wait, and the
give-up paths (client gone, hold timeout, too many held, unknown model) answer as
documented (activator/proxy.py, activator/relay.py). The model servers are the simulator
engine on the server's own app and uvicorn configuration, started on the port the models
file names only after the activator holds the requests."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from activator_helpers import (
    HEADERS,
    MODEL,
    NAME,
    NS,
    RawSSE,
    activator,
    entry,
    model_server,
    scrape,
    tee,
)
from testkit.net import free_port
from testkit.wait import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello river"}],
        "max_tokens": 8}  # fmt: skip


async def direct_answers(url: str) -> dict:
    """What the model server answers without the activator (the simulator is deterministic)."""
    async with httpx.AsyncClient(base_url=url) as c:
        chat = (await c.post("/v1/chat/completions", json=CHAT)).json()
        message = (await c.post("/v1/messages", json=CHAT)).json()
        tokens = RawSSE(c, "POST", "/v1/stream", json={"prompt": "hello river", "max_tokens": 8})
        await tokens.run()
    return {"chat": chat["choices"][0]["message"]["content"],
            "anthropic": message["content"][0]["text"],
            "tokens": "".join(d.get("token", "") for d in tokens.data())}  # fmt: skip


async def test_held_requests_of_every_kind_get_their_whole_answer(tmp_path):
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    port = free_port()
    async with activator(tmp_path, {MODEL: entry(port)}) as act:
        import httpx2

        oa_tee, an_tee = tee(), tee(httpx2)
        oa = AsyncOpenAI(base_url=act.url + "/v1", api_key="x", max_retries=0,
                         default_headers=HEADERS, http_client=oa_tee)  # fmt: skip
        an = AsyncAnthropic(base_url=act.url, api_key="x", max_retries=0,
                            default_headers=HEADERS, http_client=an_tee)  # fmt: skip
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)

        async def openai_stream() -> str:
            stream = await oa.chat.completions.create(**CHAT, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])  # fmt: skip

        async def anthropic_stream() -> str:
            async with an.messages.stream(model="sim", max_tokens=8,
                                          messages=CHAT["messages"]) as s:  # fmt: skip
                return "".join([t async for t in s.text_stream])

        async def websocket() -> list[dict]:
            url = act.url.replace("http://", "ws://") + "/ws/stream"
            async with websockets.connect(url, additional_headers=HEADERS) as ws:
                await ws.send(json.dumps({"id": 1, "prompt": "hello river",
                                          "params": {"max_tokens": 8}}))  # fmt: skip
                frames = []
                while not frames or not frames[-1].get("finished"):
                    frames.append(json.loads(await ws.recv()))
                return frames

        tokens = RawSSE(client, "POST", "/v1/stream",
                        json={"prompt": "hello river", "max_tokens": 8},
                        headers={"X-Sluice-Status": "1"})  # fmt: skip
        whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        tasks = [asyncio.ensure_future(c) for c in
                 (openai_stream(), anthropic_stream(), websocket(), tokens.run())]  # fmt: skip
        # All five are held, and each held stream heard at least two keep-alives.
        await eventually(lambda: act.held() == 5, what="five held requests")
        await eventually(lambda: tokens.count(": ") >= 2 and tokens.count("event: status") >= 2
                         and oa_tee.received.count(b": queued") >= 2
                         and an_tee.received.count(b": queued") >= 2,
                         what="keep-alives on every held stream")  # fmt: skip
        assert not tokens.count('data: {"id"')  # nothing but keep-alives yet
        async with model_server(port) as url:
            chat, text, ws_frames, _ = await asyncio.gather(*tasks)
            plain = await whole
            expected = await direct_answers(url)
        for c in (oa, an):
            await c.close()
        await client.aclose()
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["message"]["content"] == expected["chat"]
    assert chat == expected["chat"] and text == expected["anthropic"]
    assert "".join(f.get("token", "") for f in ws_frames) == expected["tokens"]
    assert ws_frames[-1]["finish_reason"] == "length"
    assert "".join(d.get("token", "") for d in tokens.data()) == expected["tokens"]
    # The keep-alives came before the first event, the status events say why and how long.
    first_data = next(i for i, line in enumerate(tokens.lines) if line.startswith("data: {\"id\""))
    statuses = [json.loads(line[6:]) for line in tokens.lines[:first_data]
                if line.startswith("data: ")]  # fmt: skip
    assert statuses and all(s["phase"] == "starting" for s in statuses)
    assert statuses == sorted(statuses, key=lambda s: s["waited_seconds"])
    assert act.outcome("forwarded") == 5 and act.held() == 0
