"""Streams continued on another replica (docs/migration.md), on two simulator servers: a
stream the router relays is cut after k events, the rest comes from `POST
/internal/continue` on the second server, and the spliced bytes are one stream equal to the
uninterrupted one (its text, its usage: prompt once, completion summed; event ids
contiguous across the seam; one terminal event; one response id and time). Negative
controls: without the router's header the bytes are today's; a wrong or missing key is
refused; a continuation without the received token ids splices a wrong answer."""

from __future__ import annotations

import json
import re
from urllib.parse import urlencode

import httpx
import pytest
import websockets
from app_helpers import serve_simulator, ws_url
from continuation_helpers import (
    KEY,
    ROUTER,
    check_one_stream,
    continue_on,
    cut,
    events_of,
    mark_of,
    text_and_usage,
)
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [{"role": "user", "content": "where does the river go"}]
N = 12
BODIES = {
    "/v1/stream": {"prompt": "where does the river go", "max_tokens": N},
    "/v1/chat/completions": {"model": "sim", "messages": MESSAGES, "max_tokens": N,
                             "stream": True, "stream_options": {"include_usage": True}},
    "/v1/completions": {"model": "sim", "prompt": "where does the river go", "max_tokens": N,
                        "stream": True, "stream_options": {"include_usage": True}},
    "/v1/responses": {"model": "sim", "input": "where does the river go",
                      "max_output_tokens": N, "stream": True},
    "/v1/messages": {"model": "sim", "messages": MESSAGES, "max_tokens": N, "stream": True},
}  # fmt: skip
ROUTES = [*BODIES, "GET /v1/stream"]


def sim(**kw) -> SimulatorEngine:
    """20 ms between tokens: a pod behind on a busy machine merges the tokens it holds into
    one event (it never queues events), and these tests cut streams after their k-th event."""
    return SimulatorEngine("sim", **{"ttft_ms": 5, "itl_ms": 20, **kw})


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "continuation-key"
    path.write_text(KEY + "\n")
    return path


def request_of(route: str) -> tuple[str, str, dict | None]:
    """(path, the path as sent with its query, the JSON body or None for a GET)."""
    if route.startswith("GET "):
        path = route[4:]
        return path, f"{path}?{urlencode(BODIES[path])}", None
    return route, route, BODIES[route]


async def stream(c: httpx.AsyncClient, sent_path: str, body: dict | None, headers=None) -> str:
    if body is None:
        r = await c.get(sent_path, headers=headers)
    else:
        r = await c.post(sent_path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.text


@pytest.mark.parametrize("route", ROUTES)
async def test_a_stream_cut_after_k_events_continues_on_another_server(key_file, route):
    path, sent_path, body = request_of(route)
    # A stream merged into fewer events (sim()) is cut only while tokens remain after the
    # cut, and every stream is cut at least after its first event.
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as a,
        serve_simulator(sim(), continuation_key_file=key_file) as b,
        httpx.AsyncClient(base_url=a, timeout=30) as ca,
        httpx.AsyncClient(base_url=b, timeout=30) as cb,
    ):
        whole = events_of(await stream(ca, sent_path, body, ROUTER))
        check_one_stream(path, whole)
        answer = text_and_usage(path, whole)
        assert answer[0] and answer[1], whole
        spliced_at = []
        for k in (1, 2, 3):
            raw = await stream(ca, sent_path, body, ROUTER)
            if sum(mark_of(e) is not None for e in events_of(raw)) < k:
                continue  # merged into fewer events than k
            before, state = cut(raw, k)
            if len(state["token_ids"]) >= N:  # the client already holds the whole answer
                continue
            r = await continue_on(cb, sent_path, body, state)
            assert r.status_code == 200, r.text
            spliced = before + events_of(r.text)
            check_one_stream(path, spliced)
            assert text_and_usage(path, spliced) == answer, (k, spliced)
            spliced_at.append(k)
        assert 1 in spliced_at, "the first event held the whole answer: nothing was continued"


@pytest.mark.parametrize("route", ROUTES)
async def test_without_the_router_header_no_event_changes(key_file, route):
    """Each token in one event (no interval): the bytes of a request without the header are
    those with it minus the router's id lines (the token stream keeps its own `<id>:<n>`
    ids), the random response ids and times aside. A pod that takes no continuations (no
    key file) marks nothing, header or not."""
    path, sent_path, body = request_of(route)
    async with (
        serve_simulator(sim(itl_ms=0), continuation_key_file=key_file) as url,
        httpx.AsyncClient(base_url=url) as c,
    ):
        plain = await stream(c, sent_path, body)
        marked = await stream(c, sent_path, body, ROUTER)
    async with serve_simulator(sim(itl_ms=0)) as url, httpx.AsyncClient(base_url=url) as c:
        keyless = await stream(c, sent_path, body, ROUTER)
    assert ";" not in "".join(re.findall(r"^id: .*$", plain, re.M))
    if path == "/v1/stream":
        expected = re.sub(r"^(id: [^\n;]*);[0-9,]*$", r"\1", marked, flags=re.M)
    else:
        assert "\nid:" not in marked and not marked.startswith("id:")
        expected = re.sub(r"^: sluice-id [^\n]*\n", "", marked, flags=re.M)

    def anonymous(raw: str) -> str:
        raw = re.sub(r"(chatcmpl-|cmpl-|resp_|msg_)[0-9a-f]{32}", r"\1X", raw)
        raw = re.sub(r'"(id|created|created_at)": ?"?[0-9a-fX]+"?', r'"\1":0', raw)
        return re.sub(r"id: [0-9a-f]{32}:", "id: X:", raw)

    assert anonymous(plain) == anonymous(expected)
    assert anonymous(plain) != anonymous(marked)  # the header does add ids
    assert anonymous(keyless) == anonymous(plain)  # but only where continuations are on


async def test_the_sdks_read_marked_streams_with_keep_alives_between_events(key_file):
    """The APIs' marks are comments: the official SDKs, which turn every blank line after
    an `id:` into an event (a `: ping` then fails to parse), read a marked stream whose
    events are 0.7 s apart with pings every 0.2 s as they read an unmarked one."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async with serve_simulator(
        sim(itl_ms=700), heartbeat_seconds=0.2, continuation_key_file=key_file
    ) as url:
        answers = []
        for headers in ({}, ROUTER):
            oc = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                             default_headers=headers)  # fmt: skip
            chat = await oc.chat.completions.create(model="sim", messages=MESSAGES,
                                                    max_tokens=3, stream=True)  # fmt: skip
            text = [c.choices[0].delta.content async for c in chat if c.choices]
            async with oc.responses.stream(model="sim", input="hi", max_output_tokens=3) as s:
                deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            ac = AsyncAnthropic(base_url=url, api_key="x", max_retries=0, default_headers=headers)
            async with ac.messages.stream(model="sim", max_tokens=3, messages=MESSAGES) as m:
                texts = [t async for t in m.text_stream]
            answers.append(("".join(text), "".join(deltas), "".join(texts)))
            await oc.close()
            await ac.close()
    assert answers[0] == answers[1] and all(answers[0])


async def test_a_continuation_without_the_received_ids_splices_a_wrong_answer(key_file):
    path = "/v1/chat/completions"
    body = BODIES[path]
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as a,
        httpx.AsyncClient(base_url=a, timeout=30) as c,
    ):
        answer = text_and_usage(path, events_of(await stream(c, path, body, ROUTER)))
        before, state = cut(await stream(c, path, body, ROUTER), 2)
        assert state["token_ids"]
        r = await continue_on(c, path, body, {**state, "token_ids": []})
        assert r.status_code == 200, r.text
        text, _ = text_and_usage(path, before + events_of(r.text), strict=False)
    received = text_and_usage(path, before)[0]
    assert text != answer[0] and text == received + answer[0]  # the start again after the seam


async def test_only_the_routers_key_continues(key_file, tmp_path):
    path = "/v1/stream"
    state = {"token_ids": [1, 2], "next_event": 2, "response_id": "r1"}
    async with serve_simulator(sim()) as off, httpx.AsyncClient(base_url=off) as c:
        r = await continue_on(c, path, BODIES[path], state)
        assert r.status_code == 404 and "--continuation-key-file" in r.json()["error"]["message"]
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as url,
        httpx.AsyncClient(base_url=url) as c,
    ):
        payload = {"path": path, "body": BODIES[path], **state}
        r = await c.post("/internal/continue", json=payload, headers=ROUTER)
        assert r.status_code == 401, r.text
        r = await c.post("/internal/continue", json=payload,
                         headers={"X-Sluice-Continuation-Key": "forged"})  # fmt: skip
        assert r.status_code == 403, r.text
        # The public key path is no way in: a client's API key is not the router's.
        r = await c.post("/internal/continue", json=payload,
                         headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert r.status_code == 401, r.text
        r = await continue_on(c, path, BODIES[path], state)
        assert r.status_code == 200 and "[DONE]" in r.text


async def test_a_path_under_the_servers_prefix_continues(key_file):
    """The router sends the client's path as it came through an Ingress that publishes the
    model under a prefix (`--root-path`): the entry reads the route under it."""
    path = "/v1/stream"
    state = {"token_ids": [1, 2], "next_event": 2, "response_id": "r1"}
    async with (
        serve_simulator(sim(), continuation_key_file=key_file, root_path="/team") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):
        r = await continue_on(c, "/team" + path, BODIES[path], state)
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
        r = await continue_on(c, "/other" + path, BODIES[path], state)
        assert r.status_code == 422 and "cannot be continued" in r.text, r.text


BAD = [
    ({"path": "/v1/stream"}, 422, "token_ids"),
    ({"next_event": -1}, 422, "next_event"),
    ({"token_ids": ["a"]}, 422, "token_ids"),
    ({"path": "/v1/models"}, 422, "cannot be continued"),
    ({"body": {**BODIES["/v1/chat/completions"], "n": 2}}, 422, "n > 1"),
    ({"body": {**BODIES["/v1/chat/completions"], "logprobs": True}}, 422, "logprobs"),
    ({"body": {**BODIES["/v1/chat/completions"], "stream": False}}, 422, "streamed"),
    ({"body": {**BODIES["/v1/chat/completions"],
               "tools": [{"type": "function", "function": {"name": "f"}}]}}, 422, "tool"),
    ({"token_ids": list(range(N))}, 422, "nothing is left"),
    ({"method": "GET"}, 422, "GET"),
    ({"surprise": 1}, 422, "surprise"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "status", "says"), BAD)
async def test_a_malformed_continuation_is_refused_saying_why(key_file, change, status, says):
    path = "/v1/chat/completions"
    payload = {"path": path, "body": BODIES[path], "token_ids": [1], "next_event": 2,
               "response_id": "chatcmpl-1", "created": 1, **change}  # fmt: skip
    if change.get("path") == "/v1/stream" and "body" not in change:
        del payload["token_ids"]
    hdrs = {**ROUTER, "X-Sluice-Continuation-Key": KEY}
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as url,
        httpx.AsyncClient(base_url=url) as c,
    ):
        r = await c.post("/internal/continue", json=payload, headers=hdrs)
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"], r.text
        r = await c.post("/internal/continue", content=b"{", headers=hdrs)
        assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]


async def test_the_caller_is_the_clients_credential_charged_never_rate_limited(key_file, tmp_path):
    """The continuation authenticates the client's own key (none: 401); with its requests
    per minute used up it still streams, and its tokens are charged to its tenant."""
    keys = tmp_path / "keys"
    keys.write_text("sk-a tenant=acme rpm=1\n")
    path = "/v1/stream"
    body = BODIES[path]
    auth = {"Authorization": "Bearer sk-a"}
    async with (
        serve_simulator(sim(), continuation_key_file=key_file, api_key_file=keys) as a,
        serve_simulator(sim(), continuation_key_file=key_file, api_key_file=keys) as b,
        httpx.AsyncClient(base_url=a, timeout=30) as ca,
        httpx.AsyncClient(base_url=b, timeout=30) as cb,
    ):
        before, state = cut(await stream(ca, path, body, {**ROUTER, **auth}), 2)
        assert (await cb.post(path, json=body, headers=auth)).status_code == 200
        assert (await cb.post(path, json=body, headers=auth)).status_code == 429
        r = await continue_on(cb, path, body, state)
        assert r.status_code == 401, r.text
        r = await continue_on(cb, path, body, state, auth)
        assert r.status_code == 200, r.text
        metrics = (await cb.get("/metrics")).text
    assert re.search(r'sluice_tenant_requests_total\{.*result="continued".*\} 1\.0', metrics)
    assert re.search(r'sluice_tenant_requests_total\{.*result="rate_limit".*\} 1\.0', metrics)
    # Billed: the first request's prompt and tokens, then only what the continuation made.
    tokens = re.search(r'sluice_tenant_tokens_total\{.*tenant="acme".*\} ([0-9.]+)', metrics)
    assert tokens is not None and float(tokens.group(1)) == (5 + N) + (N - len(state["token_ids"]))


async def ws_generation(url: str, frame: dict, headers: dict | None = None) -> list[str]:
    """The frames of one WebSocket generation, up to its final or error frame."""
    out = []
    async with websockets.connect(ws_url(url), additional_headers=headers or {}) as ws:
        await ws.send(json.dumps(frame))
        while True:
            text = await ws.recv()
            out.append(text)
            d = json.loads(text)
            if d.get("finished") or d.get("type") == "error":
                return out


def ws_mark(frame: str) -> tuple[int, list[int]] | None:
    """The router's prefix of a frame: (index, token ids), or None."""
    m = re.match(r'\{"_sluice":"(\d+);([0-9,]*)",', frame)
    return None if m is None else (int(m.group(1)), [int(i) for i in m.group(2).split(",") if i])


async def test_a_websocket_generation_continues_on_another_server(key_file):
    frame = {"id": "g1", "prompt": "where does the river go", "params": {"max_tokens": N}}
    async with serve_simulator(sim(itl_ms=0), continuation_key_file=key_file) as url:
        plain = await ws_generation(url, frame)  # one token event: the same frames
        marked = await ws_generation(url, frame, ROUTER)
    assert all(ws_mark(f) is None for f in plain)
    # Without the router's prefix (the router strips it) a frame is the one a client gets.
    assert [re.sub(r'^\{"_sluice":"[^"]*",', "{", f) for f in marked] == plain
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as a,
        serve_simulator(sim(), continuation_key_file=key_file) as b,
    ):
        plain = await ws_generation(a, frame)
        marked = await ws_generation(a, frame, ROUTER)
        k = 2
        ids = [i for f in marked[:k] for i in ws_mark(f)[1]]
        state = {"token_ids": ids, "next_event": ws_mark(marked[k - 1])[0] + 1}
        key = {**ROUTER, "X-Sluice-Continuation-Key": KEY}
        rest = await ws_generation(b, {**frame, "continuation": state}, key)
        spliced = [json.loads(f) for f in marked[:k] + rest]
        assert [d["index"] for d in spliced] == list(range(len(spliced)))
        assert [ws_mark(f)[0] for f in marked[:k] + rest] == list(range(len(spliced)))
        assert "".join(d["token"] for d in spliced) == "".join(
            json.loads(f)["token"] for f in plain
        )
        assert spliced[-1]["usage"] == json.loads(plain[-1])["usage"]
        assert [d["finished"] for d in spliced].count(True) == 1

        # Only a socket opened with the router's key continues; a wrong key is no socket.
        refused = await ws_generation(b, {**frame, "continuation": state}, ROUTER)
        assert json.loads(refused[-1])["error"]["code"] == "forbidden"
        with pytest.raises(websockets.InvalidStatus) as denied:
            await ws_generation(b, frame, {"X-Sluice-Continuation-Key": "forged"})
        assert denied.value.response.status_code == 403
        bad = await ws_generation(b, {**frame, "continuation": {"token_ids": "x"}}, key)
        assert json.loads(bad[-1])["error"]["code"] == "invalid_continuation"


async def test_a_reconnect_after_the_seam_resumes_on_the_continuing_server(key_file):
    """The continuing server holds the stream under the first server's stream id, so a
    `Last-Event-ID` in the router's form (`<id>:<n>;<token ids>`) resumes it there."""
    path = "/v1/stream"
    body = BODIES[path]
    async with (
        serve_simulator(sim(), continuation_key_file=key_file) as a,
        serve_simulator(sim(), continuation_key_file=key_file, resume_grace_seconds=5) as b,
        httpx.AsyncClient(base_url=a, timeout=30) as ca,
        httpx.AsyncClient(base_url=b, timeout=30) as cb,
    ):
        _, state = cut(await stream(ca, path, body, ROUTER), 2)
        r = await continue_on(cb, path, body, state)
        rest = events_of(r.text)
        first_id = re.search(r"^id: (.*)$", rest[0], re.M).group(1)
        assert r.headers["x-request-id"] == state["response_id"] == first_id.split(":")[0]
        again = await cb.get(path, headers={"Last-Event-ID": first_id})
        assert again.status_code == 200, again.text
        assert events_of(again.text) == rest[1:]  # exactly the events after that one
