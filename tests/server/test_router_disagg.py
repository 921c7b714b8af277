"""A disaggregated model through the router (router/prefill.py, docs/disaggregation.md): the
prompt first on a prefill pod (`POST /internal/prefill` with the model's key), then the
request on a decode pod with the parameters the prefill returned (`X-Sluice-KV-Transfer`).

The prefill pods here are small real HTTP servers that answer as the contract's pods do
(NIXL-shaped parameters: the pod's engine id, a block id per 16 prompt words) and note what
they were sent; the decode pod is a simulator model server, with a layer that notes the
headers of each request it gets. Then the same on simulator servers only, the pods' own
entries (the prefill pods' `/internal/prefill`, a decode pod that counts the received
blocks as cached): the hand-over shows in the decode pod's usage, a client leaving aborts
the prefill pod's engine request before its token, a killed prefill pod is retried on the
other. Found through a Pod watch (a fake API server), as the router finds any model's pods.
Negative controls: a model without `disaggregation` asks no prefill pod and its answer
reports 0 cached tokens; a client's own `X-Sluice-KV-Transfer` never reaches a pod."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import httpx
import pytest
import uvicorn
import websockets
from app_helpers import serving
from router_helpers import (
    HEADERS,
    LABELS,
    MODEL,
    NAME,
    NS,
    entry,
    model_server,
    pods_api,
    router,
    sa_dir,
    scrape,
)
from sluice_server.core import kvtransfer
from sluice_server.core.auth.routerkey import model_key
from sluice_server.engine.simulator import SimulatorEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
MASTER = b"a-master-key-for-the-tests-0123456789"
KEY = model_key(MASTER, NS, NAME).decode()
PREFILL_LABELS = {**LABELS, "serving.sluice.dev/role": "prefill"}
DECODE_LABELS = {**LABELS, "serving.sluice.dev/role": "decode"}
DECODE = {"dec-a": "127.0.0.3"}
STREAM = {"model": "sim", "messages": [{"role": "user", "content": "hello river"}],
          "max_tokens": 6, "stream": True}  # fmt: skip


class FakePrefill:
    """A prefill pod: `/internal/prefill` as the contract's pods answer it. `mode`: `ok`,
    `null` (no parameters, as vLLM's shared-storage connectors return), `fail` (500), `refuse` (400, the OpenAI error shape) or `slow` (it prefills until its
    caller leaves, one step every 10 ms: `steps`, and `aborted` once it saw the caller go)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.bodies: list[dict] = []
        self.keys: list[str | None] = []
        self.steps = 0
        self.aborted = 0
        self.app = Starlette(routes=[Route("/internal/prefill", self.prefill, methods=["POST"])])

    def params(self, body: dict) -> dict:
        messages = body["body"].get("messages", [])
        words = sum(len(str(m.get("content", "")).split()) for m in messages)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": list(range(max(1, words // 16))),
                "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip

    async def prefill(self, request: Request) -> Response:
        self.keys.append(request.headers.get("x-sluice-continuation-key"))
        if request.headers.get("x-sluice-continuation-key") != KEY:
            return JSONResponse({"error": {"message": "wrong key"}}, 403)
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "fail":
            return JSONResponse({"error": {"message": "engine died"}}, 500)
        if self.mode == "refuse":
            err = {"message": "max_tokens must be at least 1", "type": "invalid_request_error",
                   "code": "invalid_value"}  # fmt: skip
            return JSONResponse({"error": err}, 400)
        if self.mode == "slow":
            await self._until_gone(request)
            return Response(status_code=499)
        params = None if self.mode == "null" else self.params(body)
        return JSONResponse({"kv_transfer_params": params, "prompt_tokens": 2})

    async def _until_gone(self, request: Request) -> None:
        async def work() -> None:
            while True:
                await asyncio.sleep(0.01)
                self.steps += 1

        task = asyncio.ensure_future(work())
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # the body was read: the next message is the caller leaving
            self.aborted += 1
        finally:
            task.cancel()


class Headers:
    """An ASGI layer that notes the headers of each HTTP request before the app sees it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def wrap(self, app):
        async def noted(scope, receive, send):
            if scope.get("path", "").startswith(("/v1/", "/ws/")):
                self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        return noted


@contextlib.asynccontextmanager
async def fleet(tmp_path, prefills: dict[str, str], ips: dict[str, str] | None = None,
                disaggregated: bool = True):  # fmt: skip
    """Prefill pods (name -> mode; `ips`: a pod's address, where nothing may listen: a pod
    that is gone), one decode pod and the router over them: (router, {name: FakePrefill},
    the decode pod's Headers)."""
    master = tmp_path / "master-key"
    master.write_bytes(MASTER + b"\n")
    pod_key = tmp_path / "pod-key"
    pod_key.write_bytes(KEY.encode() + b"\n")
    port = free_port()
    fakes = {name: FakePrefill(name, mode) for name, mode in prefills.items()}
    addresses = {name: f"127.0.0.{10 + i}" for i, name in enumerate(prefills)}
    addresses.update(ips or {})
    noted = Headers()
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        for name, fake in fakes.items():
            api.put(name, addresses[name], PREFILL_LABELS)
            if name not in (ips or {}):
                config = uvicorn.Config(fake.app, host=addresses[name], port=port,
                                        log_level="warning", lifespan="off")  # fmt: skip
                await stack.enter_async_context(serving(config))
        for name, ip in DECODE.items():
            api.put(name, ip, DECODE_LABELS)
            await stack.enter_async_context(
                model_server(
                    port,
                    host=ip,
                    wrap=noted.wrap,
                    continuation_key_file=pod_key,
                    disaggregation_role="decode",
                )
            )
        extra: dict = {"pods": {"namespace": NS, "selector": DECODE_LABELS, "port": port}}
        if disaggregated:
            prefill = {"namespace": NS, "selector": PREFILL_LABELS, "port": port}
            extra["disaggregation"] = {"prefill": prefill}
        act = await stack.enter_async_context(
            router(tmp_path, {MODEL: entry(8000, host="chat.team-a.invalid", **extra)}, kube_api_url=api_url,
                   service_account_dir=sa_dir(tmp_path), continuation_key_file=master)
        )  # fmt: skip
        want = len(fakes) + len(DECODE) if disaggregated else len(DECODE)

        def all_candidates() -> bool:
            return sum(len(s.candidates()) for s in act.app.pods.sets.values()) == want

        await eventually_async(all_candidates, timeout=15, message="every pod a candidate")
        yield act, fakes, noted


def prefills(act, result: str) -> float:
    return act.app.metrics.prefills.labels(NS, NAME, result)._value.get()


def handed_over(headers: dict[str, str]) -> dict:
    return kvtransfer.decode(headers["x-sluice-kv-transfer"])


async def test_the_prompt_is_prefilled_then_the_decode_pod_gets_its_parameters(tmp_path):
    async with fleet(tmp_path, {"pre-a": "ok"}) as (act, fakes, noted):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions?x=1", json=STREAM)
            text = r.text
        assert r.status_code == 200 and "data: [DONE]" in text
        fake = fakes["pre-a"]
        # the prefill got the original request, with the model's key ...
        (body,) = fake.bodies
        assert body == {"method": "POST", "path": "/v1/chat/completions?x=1", "body": STREAM}
        assert fake.keys == [KEY]
        # ... and then the decode pod got it with the parameters that prefill returned
        (seen,) = noted.seen
        assert handed_over(seen) == fake.params(body)
        assert seen["x-sluice-continuation-key"] == KEY
        assert prefills(act, "ok") == 1
        assert act.app.metrics.prefill_seconds.labels(NS, NAME)._sum.get() > 0


async def test_a_client_leaving_during_the_prefill_cancels_it(tmp_path):
    async with fleet(tmp_path, {"pre-a": "slow"}) as (act, fakes, noted):
        fake = fakes["pre-a"]
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            sent = asyncio.ensure_future(c.post("/v1/chat/completions", json=STREAM))
            await eventually_async(lambda: fake.steps > 3, timeout=15,
                                   message="the prefill running")  # fmt: skip
            sent.cancel()  # the client leaves
            await asyncio.gather(sent, return_exceptions=True)
        await eventually_async(lambda: fake.aborted == 1, timeout=15,
                               message="the prefill pod saw its caller go")  # fmt: skip
        steps = fake.steps
        await asyncio.sleep(0.1)
        assert fake.steps == steps  # nothing ran on after the abort
        assert noted.seen == []  # and nothing went to a decode pod
        await eventually_async(lambda: prefills(act, "cancelled") == 1, timeout=15,
                               message="the cancelled prefill counted")  # fmt: skip
        assert act.outcome("disconnected") == 1


async def test_a_failing_or_gone_prefill_pod_is_retried_on_another(tmp_path):
    # pre-a answers 500, pre-gone is a Pod whose address nothing listens on, pre-b works
    pods = {"pre-a": "fail", "pre-gone": "ok", "pre-b": "ok"}
    async with fleet(tmp_path, pods, ips={"pre-gone": "127.0.0.99"}) as (act, fakes, noted):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            for i in range(6):  # different prompts: different first picks
                body = {**STREAM, "messages": [{"role": "user", "content": f"prompt {i}"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and "data: [DONE]" in r.text, r.text
        good = fakes["pre-b"]
        assert len(good.bodies) == 6  # every prompt ran there in the end
        assert [handed_over(h)["remote_engine_id"] for h in noted.seen] == ["engine-pre-b"] * 6
        assert prefills(act, "ok") == 6
        assert prefills(act, "failed") >= 1  # at least one went to a broken pod first


async def test_no_prefill_pod_that_runs_it_ends_in_the_protocols_error(tmp_path):
    async with fleet(tmp_path, {"pre-a": "fail", "pre-b": "fail"}) as (act, fakes, noted):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json={**STREAM, "stream": False})
            msg = await c.post("/v1/messages", json={**STREAM, "stream": False})
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "prefill_failed" and "answered 500" in error["message"]
        assert "asked 2 (pre-" in error["message"]  # both pods, each once
        assert "pre-a" in error["message"] and "pre-b" in error["message"]
        assert msg.status_code == 502 and msg.json()["type"] == "error"  # Anthropic's shape
        # the second found one pod or both back from being left out for a second
        asked = int(msg.json()["error"]["message"].split("asked ")[1].split(" ")[0])
        assert noted.seen == []
        assert prefills(act, "failed") == 2 + asked


async def test_a_prefill_pods_4xx_is_relayed_as_it_is(tmp_path):
    async with fleet(tmp_path, {"pre-a": "refuse"}) as (act, fakes, noted):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=STREAM)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_value"
        assert noted.seen == [] and prefills(act, "refused") == 1
        assert act.app.upstreams[MODEL].held == 0


async def test_without_disaggregation_no_prefill_and_a_clients_kv_header_never_reaches_a_pod(
    tmp_path,
):
    forged = base64.urlsafe_b64encode(b'{"remote_engine_id": "mine"}').decode()
    spoof = {**HEADERS, "X-Sluice-KV-Transfer": forged, "X-Sluice-Continuation-Key": "guess"}
    for disaggregated in (False, True):
        async with fleet(tmp_path, {"pre-a": "ok"}, disaggregated=disaggregated) as (
            act,
            fakes,
            noted,
        ):
            async with httpx.AsyncClient(base_url=act.url, headers=spoof, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json=STREAM)
            assert r.status_code == 200 and "data: [DONE]" in r.text
            ws_url = act.url.replace("http://", "ws://") + "/ws/stream"
            async with websockets.connect(ws_url, additional_headers=spoof) as ws:
                await ws.send(json.dumps({"id": 1, "prompt": "hi", "params": {"max_tokens": 2}}))
                await ws.recv()
            seen, socket = noted.seen
            if disaggregated:  # only the router's own
                assert handed_over(seen)["remote_engine_id"] == "engine-pre-a"
                assert seen["x-sluice-continuation-key"] == KEY
            else:  # no prefill
                assert fakes["pre-a"].bodies == [] and prefills(act, "ok") == 0
                assert "x-sluice-kv-transfer" not in seen
                assert "x-sluice-continuation-key" not in seen
            # a WebSocket: neither header of the client's; a disaggregated model's socket
            # carries the router's key (its frames bring the parameters)
            assert "x-sluice-kv-transfer" not in socket
            assert socket.get("x-sluice-continuation-key") == (KEY if disaggregated else None)


# -- on real simulator servers: the pods' own /internal/prefill and decode ----------------

BLOCK = 16
PROMPT = " ".join(f"w{i}" for i in range(45))  # 2 full blocks before the last token
CHAT = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


class Counting(SimulatorEngine):
    """The simulator with a NIXL-shaped connector, counting its engine requests (`started`),
    the tokens it produced, and how each ended (`ended`: its finish reason, or `cut` when
    the server closed it first)."""

    def __init__(self, engine_id: str, ttft_ms: float = 2) -> None:
        transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                    "engine_id": engine_id, "kv_ip": "127.0.0.1", "kv_port": 5600}  # fmt: skip
        super().__init__("sim", ttft_ms=ttft_ms, itl_ms=1, block_size=BLOCK,
                         kv_transfer=transfer)  # fmt: skip
        self.started = 0
        self.tokens = 0
        self.ended: list[str] = []

    def generate(self, request):
        inner = super().generate(request)

        async def counted():
            self.started += 1
            reason = "cut"
            try:
                async for delta in inner:
                    self.tokens += len(delta.token_ids or ())
                    if delta.finished:
                        reason = delta.finish_reason or "stop"
                    yield delta
            finally:
                self.ended.append(reason)

        return counted()


@contextlib.asynccontextmanager
async def sim_fleet(tmp_path, prefill_ttft_ms: float = 2, disaggregated: bool = True):
    """Two prefill and one decode simulator servers (the pods' own entries) and the router:
    (router, {pod: engine}, {pod: its server's exit stack}, the pods' port)."""
    master = tmp_path / "master-key"
    master.write_bytes(MASTER + b"\n")
    pod_key = tmp_path / "pod-key"
    pod_key.write_bytes(KEY.encode() + b"\n")
    port = free_port()
    pods = {"pre-a": ("127.0.0.21", "prefill"), "pre-b": ("127.0.0.22", "prefill"),
            "dec-a": ("127.0.0.23", "decode")}  # fmt: skip
    engines = {name: Counting(name, prefill_ttft_ms if role == "prefill" else 2)
               for name, (_, role) in pods.items()}  # fmt: skip
    stacks: dict[str, contextlib.AsyncExitStack] = {}
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        for name, (ip, role) in pods.items():
            api.put(name, ip, PREFILL_LABELS if role == "prefill" else DECODE_LABELS)
            stacks[name] = own = await stack.enter_async_context(contextlib.AsyncExitStack())
            await own.enter_async_context(
                model_server(port, engines[name], host=ip, continuation_key_file=pod_key,
                             disaggregation_role=role)
            )  # fmt: skip
        extra: dict = {"pods": {"namespace": NS, "selector": DECODE_LABELS, "port": port}}
        if disaggregated:
            prefill = {"namespace": NS, "selector": PREFILL_LABELS, "port": port}
            extra["disaggregation"] = {"prefill": prefill}
        act = await stack.enter_async_context(
            router(tmp_path, {MODEL: entry(8000, host="chat.team-a.invalid", **extra)},
                   kube_api_url=api_url, service_account_dir=sa_dir(tmp_path),
                   continuation_key_file=master)
        )  # fmt: skip
        want = 3 if disaggregated else 1
        await eventually_async(
            lambda: sum(len(s.candidates()) for s in act.app.pods.sets.values()) == want,
            timeout=15, message="every pod a candidate",
        )  # fmt: skip
        yield act, engines, stacks, port


def cached(raw: str) -> int | None:
    """The cached prompt tokens in a streamed chat answer's usage."""
    for line in raw.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return usage["prompt_tokens_details"]["cached_tokens"]
    return None


async def test_on_simulator_servers_the_decode_pod_gets_the_prompts_blocks(tmp_path):
    async with sim_fleet(tmp_path) as (act, engines, _, port):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        # one prefill ran (one token), then the decode pod computed none of the full blocks
        assert engines["pre-a"].started + engines["pre-b"].started == 1
        assert engines["dec-a"].started == 1
        assert cached(r.text) == 2 * BLOCK
        dec = f"http://127.0.0.23:{port}"
        assert await scrape(dec, "sluice_kv_transfer_tokens_total", direction="in") == 2 * BLOCK
        # a WebSocket: two generations on one socket, each prefilled, then decoded
        finals = await ws_finals(act.url, [
            {"id": 1, "prompt": PROMPT, "params": {"max_tokens": 4}},
            {"id": "two", "prompt": "x " + PROMPT, "params": {"max_tokens": 4}},
        ])  # fmt: skip
        assert {rid: f["usage"]["prompt_tokens_details"]["cached_tokens"]
                for rid, f in finals.items()} == {1: 2 * BLOCK, "two": 2 * BLOCK}  # fmt: skip
        assert engines["pre-a"].started + engines["pre-b"].started == 3
        assert prefills(act, "ok") == 3
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            # the token stream's GET: its query is the request
            r = await c.get("/v1/stream", params={"prompt": PROMPT, "max_tokens": 3})
            assert r.status_code == 200 and '"cached_tokens": 32' in r.text, r.text
            # a route that generates nothing is relayed without a prefill
            models = await c.get("/v1/models")
            assert models.status_code == 200, models.text
        assert prefills(act, "ok") == 4


async def ws_finals(url: str, frames: list[dict]) -> dict:
    """Each generation's final frame (or error frame) on one socket through the router."""
    finals: dict = {}
    ws_url = url.replace("http://", "ws://") + "/ws/stream"
    async with websockets.connect(ws_url, additional_headers=HEADERS) as ws:
        for frame in frames:
            await ws.send(json.dumps(frame))
        while len(finals) < len(frames):
            msg = json.loads(await ws.recv())
            if msg.get("finished") or msg.get("type") == "error":
                finals[msg["id"]] = msg
    return finals


async def test_on_simulator_servers_without_disaggregation_nothing_is_cached(tmp_path):
    async with sim_fleet(tmp_path, disaggregated=False) as (act, engines, _, port):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and cached(r.text) == 0
        (final,) = (await ws_finals(act.url, [{"id": 1, "prompt": PROMPT}])).values()
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert engines["pre-a"].started == engines["pre-b"].started == 0


async def test_on_simulator_servers_a_client_leaving_aborts_the_prefill(tmp_path):
    async with sim_fleet(tmp_path, prefill_ttft_ms=60_000) as (act, engines, _, port):
        prefill = [engines["pre-a"], engines["pre-b"]]
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            sent = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await eventually_async(lambda: sum(e.started for e in prefill) == 1, timeout=15,
                                   message="the prefill running")  # fmt: skip
            sent.cancel()  # the client leaves
            await asyncio.gather(sent, return_exceptions=True)
        await eventually_async(lambda: sum(len(e.ended) for e in prefill) == 1, timeout=15,
                               message="the prefill's engine request ended")  # fmt: skip
        (engine,) = [e for e in prefill if e.started]
        assert engine.ended == ["cut"] and engine.tokens == 0  # aborted before its token
        assert engine.num_unfinished_requests() == 0
        assert engines["dec-a"].started == 0
        await eventually_async(lambda: prefills(act, "cancelled") == 1, timeout=15,
                               message="the cancelled prefill counted")  # fmt: skip
        # a WebSocket that closes while its generation's prompt is prefilled: the same
        ws_url = act.url.replace("http://", "ws://") + "/ws/stream"
        async with websockets.connect(ws_url, additional_headers=HEADERS) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": PROMPT}))
            await eventually_async(lambda: sum(e.started for e in prefill) == 2, timeout=15,
                                   message="the socket's prefill running")  # fmt: skip
        await eventually_async(lambda: sum(len(e.ended) for e in prefill) == 2, timeout=15,
                               message="the socket's prefill ended")  # fmt: skip
        assert [r for e in prefill for r in e.ended] == ["cut", "cut"]
        assert sum(e.tokens for e in prefill) == 0 and engines["dec-a"].started == 0
        await eventually_async(lambda: prefills(act, "cancelled") == 2, timeout=15,
                               message="the socket's cancelled prefill counted")  # fmt: skip


async def test_on_simulator_servers_a_killed_prefill_pod_is_retried_on_the_other(tmp_path):
    async with sim_fleet(tmp_path) as (act, engines, stacks, port):
        await stacks["pre-a"].aclose()  # its server is gone; its Pod still reads Ready
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            for i in range(20):  # until one was placed on the killed pod first
                body = {**CHAT, "messages": [{"role": "user", "content": f"{i} {PROMPT}"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and cached(r.text) == 2 * BLOCK, r.text
                if prefills(act, "failed"):
                    break
        assert prefills(act, "failed") == 1
        assert engines["pre-b"].started == i + 1 == prefills(act, "ok")


async def test_a_prefill_without_parameters_still_marks_the_decode(tmp_path):
    """A connector that returns no parameters (`null`: the shared-storage ones find the
    prompt's KV by its hash): the decode request still carries the header, `null`, beside
    the key, so the decode pod counts the prompt tokens it was spared."""
    async with fleet(tmp_path, {"pre-a": "null"}) as (act, fakes, noted):
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=STREAM)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        (seen,) = noted.seen
        assert seen["x-sluice-kv-transfer"] == kvtransfer.encode(None)
        assert seen["x-sluice-continuation-key"] == KEY
        assert prefills(act, "ok") == 1
