"""A disaggregated model through the router (router/prefill.py, docs/disaggregation.md): the
prompt first on a prefill pod (`POST /internal/prefill` with the model's key), then the
request on a decode pod with the parameters the prefill returned (`X-Sluice-KV-Transfer`).

The prefill pods here are small real HTTP servers that answer as the contract's pods do
(NIXL-shaped parameters: the pod's engine id, a block id per 16 prompt words) and note what
they were sent; the decode pod is a simulator model server, with a layer that notes the
headers of each request it gets. Found through a Pod watch (a fake API server), as the
router finds any model's pods. Negative controls: a model without `disaggregation` asks no
prefill pod; a client's own `X-Sluice-KV-Transfer` never reaches a pod."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import httpx
import pytest
import uvicorn
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
)
from sluice_server.core.auth.routerkey import model_key
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
    `fail` (500), `refuse` (400, the OpenAI error shape) or `slow` (it prefills until its
    caller leaves, one step every 10 ms: `steps`, and `aborted` once it saw the caller go)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.bodies: list[dict] = []
        self.keys: list[str | None] = []
        self.steps = 0
        self.aborted = 0
        self.app = Starlette(routes=[Route("/internal/prefill", self.prefill, methods=["POST"])])

    def params(self, body: dict) -> dict:
        words = sum(len(str(m.get("content", "")).split()) for m in body["body"]["messages"])
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
        return JSONResponse({"kv_transfer_params": self.params(body), "prompt_tokens": 2})

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
            if scope["type"] == "http" and scope["path"].startswith("/v1/"):
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
                model_server(port, host=ip, wrap=noted.wrap, continuation_key_file=pod_key)
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
    return json.loads(base64.urlsafe_b64decode(headers["x-sluice-kv-transfer"]))


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
        assert error["code"] == "prefill_failed" and "pre-a" in error["message"]
        assert "answered 500" in error["message"]
        assert msg.status_code == 502 and msg.json()["type"] == "error"  # Anthropic's shape
        assert noted.seen == []
        assert prefills(act, "failed") == 4  # two requests, each on both pods


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
            (seen,) = noted.seen
            if disaggregated:  # only the router's own
                assert handed_over(seen)["remote_engine_id"] == "engine-pre-a"
                assert seen["x-sluice-continuation-key"] == KEY
            else:  # no prefill, and neither header of the client's
                assert fakes["pre-a"].bodies == [] and prefills(act, "ok") == 0
                assert "x-sluice-kv-transfer" not in seen
                assert "x-sluice-continuation-key" not in seen
