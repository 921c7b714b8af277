"""Tokens arrive incrementally through a real nginx configured like our Ingress.

Each test records the arrival timeline of one long generation (client clock) and checks
the first token arrives well before the last. The negative control runs the same check
through an nginx that buffers (gzip on event streams, see nginx_proxy.py for why plain
`proxy_buffering on` is not enough) and ignores `X-Accel-Buffering`: the check must fail
there, so it cannot pass by accident. The same nginx honouring the header must stream.
(WebSocket has no such control: nginx tunnels an upgraded connection byte for byte and
has no buffering to switch on.)

The engine's processes run on a core of their own, the servers, nginx and the client on
the others (`engine_apart`, conftest.py): on a shared core vLLM's busy-polling engine core
starves the server, which then writes a whole stream at once, and the check would judge
the machine, not the proxy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import pytest
from httpx_sse import aconnect_sse
from testkit.nginx_proxy import NginxProxy, find_nginx

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("engine_apart"),
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(
        find_nginx() is None, reason="nginx not installed (tests/scripts/install-tools.sh)"
    ),
]

N_TOKENS = 300
BODY = {"prompt": "The server streams", "max_tokens": N_TOKENS, "ignore_eos": True, "seed": 1}


@dataclass
class Timeline:
    """Arrival times (seconds since the request was sent) of each token-bearing message."""

    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0  # from the final usage
    text: str = ""

    @property
    def first(self) -> float:
        return self.arrivals[0]

    @property
    def last(self) -> float:
        return self.arrivals[-1]

    def summary(self) -> str:
        return (f"messages={len(self.arrivals)} tokens={self.tokens} first={self.first * 1e3:.1f}ms "
                f"last={self.last * 1e3:.1f}ms")  # fmt: skip


def assert_incremental(tl: Timeline) -> None:
    """The first token well before the last, and tokens spread over the generation.

    Measured on the client clock from when the request was sent. The thresholds leave room
    for a starved CPU (a TTFT of ~1 s was seen on a shared 2-core machine), while a buffered
    answer lands within a few milliseconds: 300 tokens take >= 0.5 s to generate here."""
    assert tl.arrivals, "no tokens arrived"
    spread = tl.last - tl.first
    assert spread >= max(0.15, 0.2 * tl.last), (
        f"first token not well before the last: {tl.summary()}"
    )
    # Distinct arrival moments (a buffered response lands in one or two reads).
    bursts = 1 + sum(1 for a, b in zip(tl.arrivals, tl.arrivals[1:], strict=False) if b - a > 0.002)
    assert bursts >= 3, f"tokens arrived in only {bursts} bursts: {tl.summary()}"


async def sse_timeline(base_url: str, direct: bool = False) -> Timeline:
    tl = Timeline()
    async with httpx.AsyncClient(timeout=60) as client:
        t0 = time.perf_counter()
        async with aconnect_sse(client, "POST", base_url + "/v1/stream", json=BODY) as es:
            assert es.response.status_code == 200
            if direct:  # nginx consumes X-Accel-* headers; it never reaches the client
                assert es.response.headers["x-accel-buffering"] == "no"
            assert es.response.headers["cache-control"] == "no-cache"
            async for ev in es.aiter_sse():
                now = time.perf_counter() - t0
                assert ev.event != "error", ev.data
                if ev.data == "[DONE]":
                    break
                msg = json.loads(ev.data)
                if msg["finished"]:
                    tl.tokens = msg["usage"]["completion_tokens"]
                    assert msg["finish_reason"] == "length"
                else:
                    tl.arrivals.append(now)
                    tl.text += msg["token"]
    return tl


async def ws_timeline(ws_base: str) -> Timeline:
    import websockets

    tl = Timeline()
    async with websockets.connect(ws_base + "/ws/stream", open_timeout=10) as ws:
        t0 = time.perf_counter()
        await ws.send(json.dumps({"id": "t", "prompt": BODY["prompt"], "params": {
            k: v for k, v in BODY.items() if k != "prompt"}}))  # fmt: skip
        while True:
            msg = json.loads(await ws.recv())
            now = time.perf_counter() - t0
            assert msg.get("type") != "error", msg
            if msg["finished"]:
                tl.tokens = msg["usage"]["completion_tokens"]
                break
            tl.arrivals.append(now)
            tl.text += msg["token"]
    return tl


async def openai_timeline(base_url: str) -> Timeline:
    """OpenAI chat streaming, read with httpx (the SDK itself is tested in
    test_stream_openai.py; its per-chunk parsing would blur the arrival times here)."""
    tl = Timeline()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "seed": 1,
            "max_tokens": N_TOKENS, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as client:
        t0 = time.perf_counter()
        async with aconnect_sse(client, "POST", base_url + "/v1/chat/completions", json=body) as es:
            assert es.response.status_code == 200
            async for ev in es.aiter_sse():
                now = time.perf_counter() - t0
                if ev.data == "[DONE]":
                    break
                chunk = json.loads(ev.data)
                if chunk.get("usage"):
                    tl.tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    tl.arrivals.append(now)
                    tl.text += chunk["choices"][0]["delta"]["content"]
    return tl


@pytest.fixture(scope="module")
def ingress(server_url, engine_apart):  # nginx starts on the front's cores
    with NginxProxy(server_url, "ingress") as proxy:
        yield proxy


async def test_sse_direct_and_through_ingress_nginx(server_url, ingress):
    direct = await sse_timeline(server_url, direct=True)
    proxied = await sse_timeline(ingress.url)
    print(
        f"\nTIMING sse direct: {direct.summary()}\nTIMING sse via ingress nginx: {proxied.summary()}"
    )
    for tl in (direct, proxied):
        assert tl.tokens == N_TOKENS
        assert_incremental(tl)
    assert proxied.text == direct.text  # same seed: nginx passed every byte through


async def test_websocket_through_ingress_nginx(server_url, ingress):
    tl = await ws_timeline(ingress.ws_url)
    print(f"\nTIMING websocket via ingress nginx: {tl.summary()}")
    assert tl.tokens == N_TOKENS
    assert_incremental(tl)


async def test_openai_stream_through_ingress_nginx(ingress):
    tl = await openai_timeline(ingress.url)
    print(f"\nTIMING openai chat via ingress nginx: {tl.summary()}")
    assert tl.tokens == N_TOKENS
    assert_incremental(tl)


async def test_stock_nginx_streams_because_of_x_accel_buffering(server_url):
    """nginx buffering + gzip on event streams: our `X-Accel-Buffering: no` turns the
    buffering off for this response, so gzip flushes every event."""
    with NginxProxy(server_url, "nginx-default") as proxy:
        tl = await sse_timeline(proxy.url)
    print(f"\nTIMING sse via stock nginx: {tl.summary()}")
    assert_incremental(tl)


async def test_negative_control_buffering_nginx_fails_the_check(server_url):
    """The same nginx with the header ignored: everything lands at the end, and the same
    check that passes above must fail here."""
    with NginxProxy(server_url, "buffered") as proxy:
        sse = await sse_timeline(proxy.url)
        oai = await openai_timeline(proxy.url)
    print(f"\nTIMING sse via buffering nginx: {sse.summary()}")
    print(f"TIMING openai via buffering nginx: {oai.summary()}")
    for tl in (sse, oai):
        assert tl.tokens == N_TOKENS  # the answer is complete, just not streamed
        with pytest.raises(AssertionError):
            assert_incremental(tl)
