"""The router in front of a model without `pods` whose server comes up late: every kind of held
request gets its whole answer, held streams hear keep-alives while they wait, and the
give-up paths (client gone, hold timeout, too many held, unknown model) answer as
documented (router/proxy.py, router/relay.py). The model servers are the simulator
engine on the server's own app and uvicorn configuration, started on the port the models
file names only after the router holds the requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
import pytest
import websockets
from router_helpers import (
    CHAT,
    HEADERS,
    MODEL,
    NAME,
    NS,
    RawSSE,
    direct_answers,
    entry,
    model_server,
    router,
    scrape,
    tee,
)
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port
from testkit.nginx_proxy import NginxProxy, find_nginx
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")


class _Collect(logging.Handler):
    """Keeps the messages of the records that start with `prefix` (a client's frame log)."""

    def __init__(self, into: list[str], prefix: str) -> None:
        super().__init__(logging.DEBUG)
        self.into, self.prefix = into, prefix

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix):
            self.into.append(message)


async def test_held_requests_of_every_kind_get_their_whole_answer(tmp_path):
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}, heartbeat_seconds=0.2) as act:
        import httpx2

        oa_tee, re_tee, an_tee = tee(), tee(), tee(httpx2)
        oa = AsyncOpenAI(base_url=act.url + "/v1", api_key="x", max_retries=0,
                         default_headers=HEADERS, http_client=oa_tee)  # fmt: skip
        ore = AsyncOpenAI(base_url=act.url + "/v1", api_key="x", max_retries=0,
                          default_headers=HEADERS, http_client=re_tee)  # fmt: skip
        an = AsyncAnthropic(base_url=act.url, api_key="x", max_retries=0,
                            default_headers=HEADERS, http_client=an_tee)  # fmt: skip
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)

        async def openai_stream() -> str:
            stream = await oa.chat.completions.create(**CHAT, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])  # fmt: skip

        async def responses_stream() -> str:
            async with ore.responses.stream(model="sim", input="hello river",
                                           max_output_tokens=8) as s:  # fmt: skip
                return (await s.get_final_response()).output_text

        async def anthropic_stream() -> str:
            async with an.messages.stream(model="sim", max_tokens=8,
                                          messages=CHAT["messages"]) as s:  # fmt: skip
                return "".join([t async for t in s.text_stream])

        pings: list[str] = []
        frames_log = logging.getLogger("test.activator.ws")
        frames_log.setLevel(logging.DEBUG)
        frames_log.addHandler(_Collect(pings, "< PING"))

        async def websocket() -> list[dict]:
            url = act.url.replace("http://", "ws://") + "/ws/stream"
            async with websockets.connect(url, additional_headers=HEADERS,
                                          logger=frames_log) as ws:  # fmt: skip
                await ws.send(json.dumps({"id": 1, "prompt": "hello river",
                                          "params": {"max_tokens": 8}}))  # fmt: skip
                while not ws_seen or not ws_seen[-1].get("finished"):
                    ws_seen.append(json.loads(await ws.recv()))
                return ws_seen

        ws_seen: list[dict] = []
        tokens = RawSSE(client, "POST", "/v1/stream",
                        json={"prompt": "hello river", "max_tokens": 8},
                        headers={"X-Sluice-Status": "1"})  # fmt: skip
        whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        tasks = [asyncio.ensure_future(c) for c in (openai_stream(), anthropic_stream(),
                 websocket(), tokens.run(), responses_stream())]  # fmt: skip
        # All six are held; each held stream heard at least two keep-alives, the WebSocket
        # at least two pings (uvicorn's, every --heartbeat-seconds) and two `queued` frames.
        await eventually_async(lambda: act.held() == 6, timeout=15, message="six held requests")
        await eventually_async(
            lambda: (
                tokens.count(": ") >= 2
                and tokens.count("event: status") >= 2
                and oa_tee.received.count(b": queued") >= 2
                and re_tee.received.count(b": queued") >= 2
                and len(pings) >= 2
                and sum(f.get("type") == "queued" for f in ws_seen) >= 2
                and an_tee.received.count(b": queued") >= 2
            ),
            timeout=15,
            message="keep-alives on every held stream",
        )
        assert not tokens.count('data: {"id"')  # nothing but keep-alives yet
        async with model_server(port) as url:
            chat, text, ws_frames, _, output = await asyncio.gather(*tasks)
            plain = await whole
            expected = await direct_answers(url)
        for c in (oa, ore, an):
            await c.close()
        await client.aclose()
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["message"]["content"] == expected["chat"]
    assert chat == expected["chat"] and text == expected["anthropic"]
    assert output == expected["responses"]
    assert "".join(f.get("token", "") for f in ws_frames) == expected["tokens"]
    queued = [f for f in ws_frames if f.get("type") == "queued"]  # the admission queue's form
    assert {f["id"] for f in queued} == {1} and ws_frames[: len(queued)] == queued
    assert [f["waited_ms"] for f in queued] == sorted(f["waited_ms"] for f in queued)
    assert ws_frames[-1]["finish_reason"] == "length"
    assert "".join(d.get("token", "") for d in tokens.data()) == expected["tokens"]
    # The keep-alives came before the first event, the status events say why and how long.
    first_data = next(i for i, line in enumerate(tokens.lines) if line.startswith('data: {"id"'))
    statuses = [json.loads(line[6:]) for line in tokens.lines[:first_data]
                if line.startswith("data: ")]  # fmt: skip
    assert statuses and all(s["phase"] == "starting" for s in statuses)
    assert statuses == sorted(statuses, key=lambda s: s["waited_seconds"])
    assert act.outcome("forwarded") == 6 and act.held() == 0


async def test_a_held_client_that_leaves_is_dropped_and_never_forwarded(tmp_path):
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        # A committed stream (it heard a keep-alive) and a plain request, both held.
        stream = RawSSE(client, "POST", "/v1/stream", json={"prompt": "a", "max_tokens": 4})
        leaving = [
            asyncio.ensure_future(stream.run()),
            asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT)),
        ]
        staying = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        await eventually_async(
            lambda: act.held() == 3 and stream.count(": queued") >= 1,
            timeout=15,
            message="three held, the stream committed",
        )
        assert not stream.count("event: status")  # only when asked for (X-Sluice-Status)
        for task in leaving:
            task.cancel()
        await asyncio.gather(*leaving, return_exceptions=True)
        await eventually_async(
            lambda: act.held() == 1 and act.outcome("disconnected") == 2,
            timeout=15,
            message="the two that left dropped",
        )
        async with model_server(port) as url:
            assert (await staying).status_code == 200
            # The server saw one request: the one that stayed (negative control: it counts).
            assert await scrape(url, "sluice_requests_total", protocol="openai") == 1
            assert await scrape(url, "sluice_requests_total", protocol="sse") == 0
        await client.aclose()
    assert act.outcome("forwarded") == 1 and act.held() == 0


async def test_past_the_hold_timeout_each_protocol_gives_up_in_its_own_shape(tmp_path):
    port = free_port()  # nothing ever listens here
    models = {
        MODEL: entry(port, holdTimeoutSeconds=0.8, keepaliveSeconds=0.2),
        "team-a/slow-commit": entry(port, holdTimeoutSeconds=0.5, keepaliveSeconds=5),
    }
    async with router(tmp_path, models) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        streams = {
            "openai": RawSSE(client, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}),
            "anthropic": RawSSE(client, "POST", "/v1/messages", json={**CHAT, "stream": True}),
            "responses": RawSSE(client, "POST", "/v1/responses",
                                json={"model": "sim", "input": "hi", "stream": True}),
            "sse": RawSSE(client, "GET", "/v1/stream", params={"prompt": "a"}),
        }  # fmt: skip
        # A stream that would commit only after 5 s: nothing was sent, so a real 503.
        uncommitted = asyncio.ensure_future(client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True},
            headers={"X-Sluice-Model": "team-a/slow-commit"}))  # fmt: skip
        url = act.url.replace("http://", "ws://") + "/ws/stream"
        async with websockets.connect(url, additional_headers=HEADERS) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "a"}))
            frame = json.loads(await ws.recv())
            assert frame["type"] == "queued" and frame["id"] == 1
            while frame["type"] == "queued":
                frame = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        await asyncio.gather(*(s.run() for s in streams.values()))
        r, early = await plain, await uncommitted
        await client.aclose()
    for refused in (r, early):
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "model_starting"
        assert "is starting" in refused.json()["error"]["message"]
    assert frame["type"] == "error" and frame["error"]["code"] == "model_starting"
    assert closed.value.rcvd.code == 1013
    for name, s in streams.items():
        assert s.status == 200 and s.count(": queued") >= 1, name  # committed by keep-alives
        events = [json.loads(line[6:]) for line in s.lines
                  if line.startswith("data: {")]  # fmt: skip
        error = events[-1]
        if name == "anthropic":
            assert error["error"]["type"] == "overloaded_error"
            assert "model_starting" in error["error"]["message"]
        elif name == "responses":
            assert error["type"] == "error" and error["code"] == "model_starting"
        else:
            assert error["error"]["code"] == "model_starting", name
        assert "event: error" in s.lines
        assert (s.lines[-2] == "data: [DONE]") == (name in ("openai", "sse")), name
    assert act.outcome("timeout") == 6 and act.held() == 0
    assert act.app.metrics.requests.labels("team-a", "slow-commit", "timeout")._value.get() == 1


async def test_past_max_held_is_429_with_retry_after_at_once(tmp_path):
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port, maxHeld=2)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        held = [asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
                for _ in range(2)]  # fmt: skip
        await eventually_async(lambda: act.held() == 2, timeout=15, message="two held")
        over = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "too_many_held"
        assert "2 requests waiting" in over.json()["error"]["message"]
        ws_url = act.url.replace("http://", "ws://") + "/ws/stream"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url, additional_headers=HEADERS):
                pass
        assert refused.value.response.status_code == 429
        async with model_server(port):
            assert [(await t).status_code for t in held] == [200, 200]
        await client.aclose()
    assert act.outcome("rejected") == 2 and act.outcome("forwarded") == 2


async def test_only_the_models_in_the_file_are_forwarded(tmp_path):
    port = free_port()
    # The route sets Host to the model Service's name; here its address (the FQDN look-up
    # itself: tests/server/unit/test_router_models.py).
    models = {MODEL: entry(port)}
    async with model_server(port), router(tmp_path, models, max_body_bytes=2048) as act:
        async with httpx.AsyncClient(base_url=act.url, timeout=30) as c:
            by_host = await c.post("/v1/chat/completions", json=CHAT,
                                   headers={"Host": "127.0.0.1:8000"})  # fmt: skip
            assert by_host.status_code == 200  # the port is ignored
            # A replica is ready: streamed straight through, the server's own headers, and
            # no keep-alive of the router's (negative control for the held streams').
            up = RawSSE(c, "POST", "/v1/stream", json={"prompt": "a", "max_tokens": 4},
                        headers=HEADERS)  # fmt: skip
            await up.run()
            assert up.status == 200 and len(up.headers["x-request-id"]) == 32  # the server's
            assert not up.count(": queued") and up.lines[-2] == "data: [DONE]"
            for headers in ({"Host": "other.team-a.svc.cluster.local"},
                            {"X-Sluice-Model": "team-a/other"},
                            {"X-Sluice-Model": MODEL, "Host": "x"}):  # fmt: skip
                r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
                if headers.get("X-Sluice-Model") == MODEL:
                    assert r.status_code == 200  # negative control: the header wins over Host
                    continue
                assert r.status_code == 404, headers
                err = r.json()["error"]
                assert err["code"] == "model_not_found" and "models file" in err["message"]
            # Its own routes answer only requests that name no model.
            page = (await c.get("/metrics")).text
            assert f'sluice_activator_models_known{{model="{NAME}",namespace="{NS}"}} 1.0' in page
            assert (await c.get("/ready")).status_code == 200
            big = await c.post("/v1/chat/completions", content=b"x" * 4096, headers=HEADERS)
            assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
        ws_url = act.url.replace("http://", "ws://") + "/ws/stream"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url, additional_headers={"X-Sluice-Model": "a/b"}):
                pass
        assert refused.value.response.status_code == 404
    assert act.app.metrics.unknown._value.get() == 3


async def test_refusals_of_the_model_server_pass_through_or_become_error_events(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-right\n")
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        wrong = {"Authorization": "Bearer sk-wrong"}
        plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT,
                                                  headers=wrong))  # fmt: skip
        stream = RawSSE(client, "POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                        headers=wrong)  # fmt: skip
        running = asyncio.ensure_future(stream.run())

        async def websocket() -> tuple[dict, int | None]:
            url = act.url.replace("http://", "ws://") + "/ws/stream"
            async with websockets.connect(url, additional_headers={**HEADERS, **wrong}) as ws:
                frame = json.loads(await ws.recv())
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await ws.recv()
                return frame, closed.value.rcvd.code if closed.value.rcvd else None

        ws_task = asyncio.ensure_future(websocket())
        await eventually_async(
            lambda: act.held() == 3 and stream.count(": queued") >= 1,
            timeout=15,
            message="all three held, the stream committed",
        )
        async with model_server(port, api_key_file=keys) as url:
            r = await plain
            await running
            ws_frame, ws_close = await ws_task
            async with httpx.AsyncClient(base_url=url) as direct:
                d = await direct.post("/v1/chat/completions", json=CHAT, headers=wrong)
            ok = await client.post("/v1/chat/completions", json=CHAT,
                                   headers={"Authorization": "Bearer sk-right"})  # fmt: skip
        await client.aclose()
    # Nothing was sent yet: the server's 401, byte for byte, with its headers.
    assert (r.status_code, r.content) == (d.status_code, d.content) == (401, d.content)
    assert r.headers.get("www-authenticate") == d.headers.get("www-authenticate")
    assert len(r.headers.get_list("date")) == len(r.headers.get_list("server")) == 1
    assert ok.status_code == 200  # negative control: the right key goes through
    # Committed: the protocol's error event with the server's status and message.
    error = json.loads(next(line for line in stream.lines if line.startswith("data: {"))[6:])
    assert error["error"]["type"] == "authentication_error"
    assert error["error"]["message"] == d.json()["error"]["message"]
    assert stream.lines[-2] == "data: [DONE]"
    # The WebSocket, accepted while held: the refused upstream handshake as an error frame.
    assert ws_frame["type"] == "error" and ws_frame["error"]["code"] == "http_401"
    assert ws_close == 1008


async def test_a_client_leaving_after_forwarding_aborts_the_server_request(tmp_path):
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        long = {"prompt": "a", "max_tokens": 2000}
        # Held (committed) first, then forwarded: leave after the first token.
        got_token = asyncio.Event()

        async def read_until_a_token() -> None:
            async with client.stream("POST", "/v1/stream", json=long) as r:
                async for line in r.aiter_lines():
                    if line.startswith('data: {"id"'):
                        got_token.set()
                        await asyncio.Event().wait()  # stays until cancelled

        reader = asyncio.ensure_future(read_until_a_token())
        await eventually_async(lambda: act.held() == 1, timeout=15, message="held")
        engine = SimulatorEngine("sim", ttft_ms=5, itl_ms=20)
        async with model_server(port, engine) as url:
            await asyncio.wait_for(got_token.wait(), 30)
            assert await scrape(url, "sluice_aborts_total", protocol="sse") == 0  # control
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await eventually_async(
                lambda: scrape(url, "sluice_aborts_total", protocol="sse"),
                timeout=15,
                message="the server aborted the engine request",
            )
            assert await scrape(url, "sluice_client_disconnects_total", protocol="sse") == 1
            # Forwarded without a hold (a replica is ready): a plain request left mid-way.
            plain = asyncio.ensure_future(
                client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2000})
            )
            await eventually_async(
                lambda: engine.num_unfinished_requests() == 1,
                timeout=15,
                message="the plain request generating on the server",
            )
            plain.cancel()
            await asyncio.gather(plain, return_exceptions=True)
            await eventually_async(
                lambda: engine.num_unfinished_requests() == 0,
                timeout=15,
                message="the server aborted the plain request",
            )
        await client.aclose()


async def test_the_models_file_is_reloaded_and_a_bad_one_refused(tmp_path):
    port = free_port()
    async with model_server(port), router(tmp_path, {MODEL: entry(port)}) as act:
        async with httpx.AsyncClient(base_url=act.url) as c:

            async def known() -> str:
                return (await c.get("/metrics")).text

            act.write({"team-b/code": entry(port)})
            await eventually_async(
                lambda: _has(known, "team-b"), timeout=15, message="the new file loaded"
            )
            page = await known()
            assert 'namespace="team-a"' not in page.split("sluice_activator_held")[0]
            act.path.write_text("{not json")
            await eventually_async(
                lambda: act.app.metrics.reloads.labels("error")._value.get(),
                timeout=15,
                message="the bad file refused",
            )
            r = await c.get("/v1/models", headers={"X-Sluice-Model": "team-b/code"})
            assert r.status_code == 200  # the models loaded before stay
            r = await c.get("/v1/models", headers=HEADERS)
            assert r.status_code == 404  # and the one the good file removed stays removed
        assert act.app.models.by_key.keys() == {"team-b/code"}


async def _has(page, text: str) -> bool:
    return f'namespace="{text}"' in await page()


@pytest.mark.skipif(find_nginx() is None, reason="nginx not installed")
@pytest.mark.external
async def test_keep_alives_carry_a_held_stream_through_a_proxy_that_cuts_silent_ones(tmp_path):
    """nginx in front (as the Ingress is; Host passed through names the model), its read
    timeout 1 s: the held stream hears a keep-alive every 0.3 s and outlives it; a held
    non-streamed request, which hears nothing, is cut by nginx (the negative control)."""
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port, keepaliveSeconds=0.3)}) as act:
        with NginxProxy(act.url.replace("localhost", "127.0.0.1"), timeout_seconds=1) as proxy:
            client = httpx.AsyncClient(base_url=proxy.url, timeout=30)
            stream = RawSSE(client, "POST", "/v1/stream", json={"prompt": "a", "max_tokens": 8})
            running = asyncio.ensure_future(stream.run())
            silent = await client.post("/v1/chat/completions", json=CHAT)
            assert silent.status_code == 504  # nginx gave up on a silent upstream
            await eventually_async(
                lambda: act.outcome("disconnected") == 1,
                timeout=15,
                message="the cut request dropped from the held count",
            )
            assert act.held() == 1 and not running.done()  # the stream is still held
            async with model_server(port):
                await running
            await client.aclose()
    assert stream.status == 200 and stream.count(": queued") >= 3
    final = [d for d in stream.data() if "token" in d][-1]  # tokens may come coalesced
    assert final["finished"] and final["usage"]["completion_tokens"] == 8
    assert stream.lines[-2] == "data: [DONE]"
    assert act.outcome("forwarded") == 1


async def test_a_replica_that_went_away_again_means_holding_again(tmp_path, monkeypatch, caplog):
    """A ready answer stands for new requests a while (`FRESH`, here stretched so that the
    second request surely trusts it): one that then cannot connect never reached a server,
    so it is held again, not failed, and forwarded once a server is back."""
    from sluice_server.router import upstream

    monkeypatch.setattr(upstream, "FRESH", 3600.0)
    caplog.set_level(logging.INFO, "sluice_server.router")
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        async with model_server(port):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        again = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        await eventually_async(
            lambda: "failed (ConnectError); holding again" in caplog.text,
            timeout=15,
            message="the stale ready answer found out",
        )
        assert act.held() == 1 and not again.done()
        async with model_server(port):
            assert (await again).status_code == 200
        await client.aclose()
    assert act.outcome("forwarded") == 2 and act.outcome("timeout") == 0


@contextlib.asynccontextmanager
async def breaking_server(port: int, content_type: str):
    """A model server that dies mid-answer: `/ready` is 200; anything else gets a 200 head
    of `content_type`, half an event, and a dropped connection (a pod killed midway)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /ready "):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type.encode()
                         + b"\r\ntransfer-encoding: chunked\r\n\r\n"
                         + b'13\r\ndata: {"choices": [\r\n')  # fmt: skip
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


async def test_an_upstream_stream_that_breaks_off_ends_with_the_protocols_error_event(tmp_path):
    port = free_port()
    async with router(tmp_path, {MODEL: entry(port)}) as act:
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        body = {**CHAT, "stream": True}
        committed = RawSSE(client, "POST", "/v1/chat/completions", json=body)
        held = asyncio.ensure_future(committed.run())
        await eventually_async(lambda: committed.count(": queued") >= 1, timeout=15,
                               message="the held stream committed")  # fmt: skip
        async with breaking_server(port, "text/event-stream"):
            await held  # committed first: keep-alives, then the cut
            passed = RawSSE(client, "POST", "/v1/chat/completions", json=body)
            await passed.run()  # forwarded at once: the server's head, then the cut
        async with breaking_server(port, "application/json"):
            with pytest.raises(httpx.RemoteProtocolError):  # negative control: not a stream
                await client.post("/v1/chat/completions", json=CHAT)
        await client.aclose()
    for stream in (committed, passed):
        assert stream.status == 200 and 'data: {"choices": [' in stream.lines
        error = json.loads(stream.lines[stream.lines.index("event: error") + 1][6:])
        assert (
            error["error"]["code"] == "upstream_error" and "broke off" in error["error"]["message"]
        )
        assert stream.lines[-2] == "data: [DONE]"
