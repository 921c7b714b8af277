"""The router in front of two simulator model servers it finds through a Pod watch (a fake
API server, testkit/fake_pods_api.py): every protocol relayed unchanged to a Ready pod,
concurrent streams spread over both, a pod that stops being Ready or starts terminating
gets nothing new, a 410 re-lists, a client that leaves aborts the pod's engine request, and
a model with no Ready pod is held until one turns Ready (router/pods.py, router/upstream.py).

The two pods are simulator servers on the same port of two loopback addresses (127.0.0.1
and 127.0.0.2), as the e2e node agent gives its pods loopback IPs; what each engine
recorded says where each request went."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping

import httpx
import pytest
import websockets
from router_helpers import (
    CHAT,
    HEADERS,
    LABELS,
    MODEL,
    NAME,
    NS,
    RawSSE,
    candidates,
    direct_answers,
    model_server,
    pods_api,
    pods_entry,
    router,
    sa_dir,
    wait_candidates,
)
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
IPS = {"pod-a": "127.0.0.1", "pod-b": "127.0.0.2"}


class Recording(SimulatorEngine):
    """The simulator, noting each engine request as it starts and how it ended: its
    finish reason, or `cut` when the server closed it before it finished."""

    def __init__(self, itl_ms: float = 2) -> None:
        super().__init__(model_name="sim", ttft_ms=5, itl_ms=itl_ms)
        self.started = 0
        self.ended: list[str] = []

    def generate(self, request):
        inner = super().generate(request)

        async def recorded():
            self.started += 1
            reason = "cut"
            try:
                async for delta in inner:
                    if delta.finished:
                        reason = delta.finish_reason or "stop"
                    yield delta
            finally:
                self.ended.append(reason)

        return recorded()


@contextlib.asynccontextmanager
async def two_pods(tmp_path, itl_ms: float = 2, ready: bool = True,
                   server: Mapping[str, object] | None = None, **router_settings):  # fmt: skip
    """The fake API server with pod-a and pod-b, their simulator servers (`server`: their
    settings' overrides, e.g. `api_key_file`), and the router watching them:
    (router, api, {pod: engine})."""
    port = free_port()
    engines = {name: Recording(itl_ms) for name in IPS}
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        for name, ip in IPS.items():
            api.put(name, ip, LABELS, ready=ready)
            await stack.enter_async_context(
                model_server(port, engines[name], host=ip, **(server or {}))
            )
        act = await stack.enter_async_context(
            router(
                tmp_path,
                {MODEL: pods_entry(port)},
                kube_api_url=api_url,
                service_account_dir=sa_dir(tmp_path),
                **router_settings,
            )  # fmt: skip
        )
        yield act, api, engines


async def every_protocol(url: str) -> dict:
    """One request of every protocol through the router, all at once; what each answered."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    oa = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, default_headers=HEADERS)
    an = AsyncAnthropic(base_url=url, api_key="x", max_retries=0, default_headers=HEADERS)
    client = httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=30)

    async def chat_stream() -> str:
        stream = await oa.chat.completions.create(**CHAT, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def completions() -> str:
        r = await oa.completions.create(model="sim", prompt="hello river", max_tokens=8)
        return r.choices[0].text

    async def responses_stream() -> str:
        async with oa.responses.stream(model="sim", input="hello river",
                                       max_output_tokens=8) as s:  # fmt: skip
            return (await s.get_final_response()).output_text

    async def anthropic_stream() -> str:
        async with an.messages.stream(model="sim", max_tokens=8, messages=CHAT["messages"]) as s:
            return "".join([t async for t in s.text_stream])

    async def tokens(method: str) -> str:
        if method == "GET":
            sse = RawSSE(client, "GET", "/v1/stream",
                         params={"prompt": "hello river", "max_tokens": 8})  # fmt: skip
        else:
            sse = RawSSE(client, "POST", "/v1/stream",
                         json={"prompt": "hello river", "max_tokens": 8})  # fmt: skip
        await sse.run()
        assert sse.status == 200
        return "".join(d.get("token", "") for d in sse.data())

    async def websocket() -> str:
        ws_url = url.replace("http://", "ws://") + "/ws/stream"
        frames: list[dict] = []
        async with websockets.connect(ws_url, additional_headers=HEADERS) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "hello river",
                                      "params": {"max_tokens": 8}}))  # fmt: skip
            while not frames or not frames[-1].get("finished"):
                frames.append(json.loads(await ws.recv()))
        return "".join(f.get("token", "") for f in frames)

    try:
        names = ("chat", "completions", "responses", "anthropic", "get", "post", "ws")
        answers = await asyncio.gather(chat_stream(), completions(), responses_stream(),
                                       anthropic_stream(), tokens("GET"), tokens("POST"),
                                       websocket())  # fmt: skip
        return dict(zip(names, answers, strict=True))
    finally:
        await oa.close()
        await an.close()
        await client.aclose()


async def test_every_protocol_goes_to_a_ready_pod_and_concurrent_streams_spread(tmp_path):
    async with two_pods(tmp_path, itl_ms=20) as (act, api, engines):
        await wait_candidates(act, ["pod-a", "pod-b"])
        answers = await every_protocol(act.url)  # the entry's Service host is unreachable
        port = act.app.models.by_key[MODEL].pods.port
        direct = await direct_answers(f"http://127.0.0.2:{port}")
        async with httpx.AsyncClient() as c:
            r = await c.post(f"http://127.0.0.1:{port}/v1/completions",
                             json={"model": "sim", "prompt": "hello river", "max_tokens": 8})  # fmt: skip
            completions = r.json()["choices"][0]["text"]
            # A model not in the file: 404 from the router itself, never forwarded.
            r = await c.post(act.url + "/v1/chat/completions", json=CHAT,
                             headers={"X-Sluice-Model": "team-a/other"})  # fmt: skip
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert answers == {"chat": direct["chat"], "completions": completions,
                       "responses": direct["responses"], "anthropic": direct["anthropic"],
                       "get": direct["tokens"], "post": direct["tokens"],
                       "ws": direct["tokens"]}  # fmt: skip
    # Seven streams at once, each placed on the pod with fewer in flight: 4 and 3 (the
    # direct requests above reached pod-b and pod-a outside the router: 4 and 1 more).
    through = {"pod-a": engines["pod-a"].started - 1, "pod-b": engines["pod-b"].started - 4}
    assert sorted(through.values()) == [3, 4], through
    assert act.outcome("forwarded") == 7 and act.held() == 0
    assert set(api.tokens) == {"Bearer router-token"}  # the ServiceAccount token, every call


async def test_a_pod_not_ready_or_terminating_gets_nothing_new(tmp_path):
    async with two_pods(tmp_path) as (act, api, engines):
        await wait_candidates(act, ["pod-a", "pod-b"])
        restarted: list[str] = []
        (podset,) = act.app.pods.sets.values()
        podset.on_restart(lambda pod: restarted.append(pod.name))
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:

            async def send(n: int) -> dict[str, int]:
                before = {name: e.started for name, e in engines.items()}
                answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT)
                                                 for _ in range(n)))  # fmt: skip
                assert all(r.status_code == 200 for r in answers)
                return {name: e.started - before[name] for name, e in engines.items()}

            api.ready("pod-b", False)
            await wait_candidates(act, ["pod-a"])
            assert await send(4) == {"pod-a": 4, "pod-b": 0}
            api.ready("pod-b", True)
            api.terminating("pod-a")  # still Ready: its deletionTimestamp alone takes it out
            await wait_candidates(act, ["pod-b"])
            assert await send(4) == {"pod-a": 0, "pod-b": 4}
            # A 410 Gone: the router lists again and keeps following the pods from there.
            lists = api.lists
            api.expire()
            await eventually_async(lambda: api.lists > lists, timeout=15, message="a re-list")
            api.delete("pod-a")
            api.restart("pod-b")
            await eventually_async(lambda: restarted == ["pod-b"], timeout=15,
                                   message="pod-b's restart reported")  # fmt: skip
            assert candidates(act) == ["pod-b"]
            assert await send(2) == {"pod-a": 0, "pod-b": 2}


async def test_a_client_that_leaves_aborts_the_pods_engine_request(tmp_path):
    async with two_pods(tmp_path, itl_ms=30) as (act, api, engines):
        await wait_candidates(act, ["pod-a", "pod-b"])
        api.ready("pod-b", False)  # everything on pod-a
        await wait_candidates(act, ["pod-a"])
        engine = engines["pod-a"]
        relayed = act.app.relay.transport
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            # Answers that ended: one connection to the pod, reused (hop.py's pool) ...
            for _ in range(3):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert relayed.opened == 1 and relayed.idle_count() == 1
            # ... and a stream on that reused connection still aborts when its client leaves
            for method, path, body in (
                ("POST", "/v1/stream", {"prompt": "long", "max_tokens": 500}),
                ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 500, "stream": True}),
            ):
                async with c.stream(method, path, json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 2:
                            break  # leave mid-stream
                n = len(engine.ended) + 1
                await eventually_async(lambda n=n: len(engine.ended) == n, timeout=15,
                                       message=f"the engine request of {path} ended")  # fmt: skip
                assert engine.ended[-1] in ("abort", "cut"), engine.ended
            # the aborted streams' connections were closed, never pooled: one new each
            assert relayed.opened == 2 and relayed.idle_count() == 0
        ws_url = act.url.replace("http://", "ws://") + "/ws/stream"
        n = len(engine.ended) + 1
        async with websockets.connect(ws_url, additional_headers=HEADERS) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "long", "params": {"max_tokens": 500}}))
            await ws.recv()
        await eventually_async(lambda: len(engine.ended) == n, timeout=15,
                               message="the WebSocket's engine request ended")  # fmt: skip
        assert engine.ended[-1] in ("abort", "cut") and engine.num_unfinished_requests() == 0
        assert engines["pod-b"].started == 0
        await eventually_async(lambda: not act.app.upstreams[MODEL].in_flight, timeout=15,
                               message="no request in flight at any pod")  # fmt: skip


async def test_no_ready_pod_holds_then_forwards_when_one_turns_ready(tmp_path):
    async with two_pods(tmp_path, ready=False) as (act, api, engines):
        await eventually_async(lambda: act.app.pods.sets and next(
            iter(act.app.pods.sets.values())).synced, timeout=15, message="listed")  # fmt: skip
        assert candidates(act) == []
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            stream = RawSSE(c, "POST", "/v1/stream", json={"prompt": "a", "max_tokens": 4})
            tasks = [asyncio.ensure_future(stream.run()),
                     asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))]  # fmt: skip
            await eventually_async(lambda: act.held() == 2 and stream.count(": queued") >= 1,
                                   timeout=15, message="both held, the stream committed")  # fmt: skip
            assert sum(e.started for e in engines.values()) == 0
            api.ready("pod-b", True)
            _, plain = await asyncio.gather(*tasks)
        assert plain.status_code == 200 and stream.status == 200
        assert len(stream.data()) >= 2 and stream.lines[-1] in ("", "data: [DONE]")
        assert (engines["pod-a"].started, engines["pod-b"].started) == (0, 2)
        assert act.outcome("forwarded") == 2 and act.held() == 0


async def test_the_pin_cookie_brings_a_resume_back_to_its_pod_and_a_forged_one_does_not(
    tmp_path,
):
    from sluice_server.router.pin import COOKIE, Pins
    from sluice_server.router.placement import tie_hash

    key_file = tmp_path / "pin.key"
    key_file.write_bytes(b"k" * 32)
    async with two_pods(tmp_path, itl_ms=40, server={"resume_grace_seconds": 30},
                        pin_key_file=key_file) as (act, api, engines):  # fmt: skip
        await wait_candidates(act, ["pod-a", "pod-b"])
        # The pod a resume without a pin goes to (nothing in flight: the tie-break's pick);
        # the stream starts on the other one while that one is not Ready.
        resume_key = b"/v1/stream?"
        natural = max(IPS, key=lambda n: tie_hash(resume_key, n))
        holder = next(n for n in IPS if n != natural)
        api.ready(natural, False)
        await wait_candidates(act, [holder])
        client = httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30)
        last_id = None
        async with client.stream("POST", "/v1/stream",
                                 json={"prompt": "long", "max_tokens": 200}) as r:  # fmt: skip
            assert r.status_code == 200
            cookie = r.cookies.get(COOKIE)
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    last_id = line[4:]  # `<id>:<n>;<token ids>` through the router
                if last_id and last_id.split(";")[0].endswith(":2"):
                    break  # the client drops; the pod keeps the stream for 30 s
        assert cookie and cookie.startswith(holder + ".") and last_id
        api.ready(natural, True)
        await wait_candidates(act, ["pod-a", "pod-b"])

        async def resume(pin: str | None) -> tuple[int, list[str]]:
            headers = {"Last-Event-ID": last_id}
            client.cookies.clear()  # only the cookie each case sends
            if pin is not None:
                headers["Cookie"] = f"{COOKIE}={pin}"
            seen: list[str] = []
            async with client.stream("GET", "/v1/stream", headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        seen.append(line[4:])
                        if len(seen) == 2:
                            break
                return r.status_code, seen

        pod, expiry, mac = cookie.rsplit(".", 2)
        forged = [
            f"{natural}.{expiry}.{mac}",  # another pod under the holder's MAC
            f"{pod}.{int(expiry) + 10}.{mac}",  # a later expiry
            Pins(b"x" * 32, 60).sign(MODEL, holder),  # another key
            Pins(b"k" * 32, 60).sign("team-a/other", holder),  # another model
            Pins(b"k" * 32, 60).sign(MODEL, holder, now=0),  # expired long ago
            "not-a-pin",
        ]
        for pin in (None, *forged):
            status, _ = await resume(pin)
            assert status == 404, pin  # placed as any request: the natural pod has no stream
        status, seen = await resume(cookie)
        stream_id = last_id.split(";")[0].rsplit(":", 1)[0]
        assert status == 200 and seen[0].split(";")[0] == stream_id + ":3", seen
        await client.aclose()
    # The resumes never started a generation: one stream, on the holder.
    assert (engines[holder].started, engines[natural].started) == (1, 0)


async def test_the_router_learns_each_callers_tenant_from_the_pod_and_hides_it(tmp_path):
    """The pod is the one that knows callers (its keys file); the router learns the tenant
    a pod salts a credential's prompts with from the pod's answer (router/tenants.py),
    keeps it under the credential's hash only, and the client never sees the header."""
    from sluice_server.core.auth.cachesalt import CACHE_TENANT_HEADER
    from sluice_server.router.tenants import UNKNOWN, credential

    keys = tmp_path / "keys"
    keys.write_text("sk-a tenant=acme\nsk-b tenant=globex\n")
    async with two_pods(tmp_path, server={"api_key_file": keys}) as (act, api, engines):
        await wait_candidates(act, ["pod-a", "pod-b"])
        seen = {}
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            for key in ("sk-a", "sk-b", "sk-wrong"):
                r = await c.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip
                seen[key] = (r.status_code, r.headers.get(CACHE_TENANT_HEADER))
            async with websockets.connect(
                act.url.replace("http", "ws") + "/v1/ws?api_key=sk-a",
                additional_headers=HEADERS,
            ) as ws:
                assert ws.response.headers.get(CACHE_TENANT_HEADER) is None
        tenants = act.app.upstreams[MODEL].tenants
    assert seen == {"sk-a": (200, None), "sk-b": (200, None), "sk-wrong": (401, None)}
    assert tenants.of(credential([(b"authorization", b"Bearer sk-a")])) == "acme"
    assert tenants.of(credential([(b"x-api-key", b"sk-b")])) == "globex"
    assert tenants.of(credential([(b"x-api-key", b"sk-wrong")])) is UNKNOWN
    assert len(tenants) == 2  # hashes of the two accepted credentials, nothing else


async def test_a_models_file_that_turns_round_robin_on_places_each_request_in_turn(tmp_path):
    """`balance: round-robin` in the model's entry (spec.routing.balance, written by the
    operator): from the reload on, the same prompt goes to each pod in turn, counted
    `round-robin`; the model's pod view (its index, feeds, scraped loads) is the same one."""
    async with two_pods(tmp_path) as (act, api, engines):
        await wait_candidates(act, ["pod-a", "pod-b"])
        view = act.app.views[MODEL]
        port = view.model.pods.port
        picks = act.app.metrics.picks

        async def send(n: int) -> list[int]:
            async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
                for _ in range(n):  # one at a time: nothing in flight decides
                    assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            return [engines[p].started for p in IPS]

        # Least-loaded (the default): the same prompt, the same pod every time.
        before = await send(4)
        assert sorted(before) == [0, 4], before
        act.write({MODEL: pods_entry(port, balance="round-robin")})
        await eventually_async(lambda: view.model.balance == "round-robin", timeout=15,
                               message="the reload to reach the view")  # fmt: skip
        after = await send(4)
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2], (before, after)
        assert picks.labels(NS, NAME, "round-robin")._value.get() == 4
        assert act.app.views[MODEL] is view


async def test_the_pods_internal_endpoints_are_never_relayed(tmp_path):
    """A pod's /internal/ endpoints (its prefix-cache description) are the router's to read,
    not a client's: 404 through the router, any path prefix, any method, WebSocket too."""
    async with two_pods(tmp_path) as (act, api, engines):
        await eventually_async(lambda: len(candidates(act)) == 2, timeout=15,
                               message="both pods candidates")  # fmt: skip
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=30) as c:
            for method, path in (("GET", "/internal/prefix-cache"),
                                 ("GET", "/mistral/internal/prefix-cache/files/tokenizer.json"),
                                 ("POST", "/internal/prefix-cache")):  # fmt: skip
                r = await c.request(method, path)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_forwarded", r.text
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200  # control
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(act.url.replace("http", "ws") + "/internal/x",
                                          additional_headers=HEADERS):  # fmt: skip
                pass
        assert refused.value.response.status_code == 404
