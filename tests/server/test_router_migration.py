"""Streams that outlive their pod (router/migration.py, docs/migration.md): the router in
front of two simulator model servers that take continuations, found through a Pod watch
(a fake API server). Pod A is reached through a link the test breaks as the pod's loss
would (testkit/faulty_link.py): killed (every connection reset, as for SIGKILL) or frozen
(silence with the connections open, as for SIGSTOP or a partition). Every protocol's
stream, broken midway, reaches its client whole: the same text and usage as an unbroken
run, contiguous event ids, one final event. Negative controls: a model without `migration`
and a stream out of moves end with the protocol's error event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from urllib.parse import urlencode

import httpx
import pytest
import websockets
from continuation_helpers import check_one_stream, events_of, text_and_usage
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import (
    HEADERS,
    LABELS,
    MODEL,
    NAME,
    NS,
    metric,
    model_server,
    pods_api,
    pods_entry,
    router,
    sa_dir,
    wait_candidates,
)
from sluice_server.core.auth.routerkey import model_key
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.router.migration import Marks, continuation_body
from testkit.faulty_link import FaultyLink
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
MASTER = b"a-master-key-for-the-tests-0123456789"
MESSAGES = [{"role": "user", "content": "hello river"}]
TOKENS = 40
# (name, method, path, body or query): one streamed request of every protocol.
REQUESTS = [
    ("chat", "POST", "/v1/chat/completions",
     {"model": "sim", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("completions", "POST", "/v1/completions",
     {"model": "sim", "prompt": "hello river", "max_tokens": TOKENS, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("responses", "POST", "/v1/responses",
     {"model": "sim", "input": "hello river", "max_output_tokens": TOKENS, "stream": True}),
    ("messages", "POST", "/v1/messages",
     {"model": "sim", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}),
    ("tokens-post", "POST", "/v1/stream", {"prompt": "hello river", "max_tokens": TOKENS}),
    ("tokens-get", "GET", "/v1/stream", {"prompt": "hello river", "max_tokens": TOKENS}),
]  # fmt: skip


@contextlib.asynccontextmanager
async def pods_with_link(
    tmp_path,
    migration: dict | None,
    itl_ms: float = 25,
    engine=None,
    server: dict | None = None,
    engine_a=None,
    **router_settings,
):
    """Pod A (behind the link, the only Ready pod at first) and pod B (not Ready yet), both
    taking continuations with the model's key; the router with the master key. `engine_a`:
    pod A's own engine (else as pod B's). Yields (router, fake API, link, the pods' port)."""
    master = tmp_path / "master-key"
    master.write_bytes(MASTER + b"\n")
    pod_key = tmp_path / "pod-key"
    pod_key.write_bytes(model_key(MASTER, NS, NAME) + b"\n")
    port = free_port()
    extra = {"migration": migration} if migration is not None else {}
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        api.put("pod-a", "127.0.0.1", LABELS, ready=True)
        api.put("pod-b", "127.0.0.2", LABELS, ready=False)
        servers = []
        for ip in ("127.0.0.3", "127.0.0.2"):  # pod A's server, behind the link
            own = engine_a if ip == "127.0.0.3" else None
            pod_engine = own or engine or SimulatorEngine("sim", ttft_ms=5, itl_ms=itl_ms)
            servers.append(await stack.enter_async_context(
                model_server(port, pod_engine, host=ip, continuation_key_file=pod_key,
                             **(server or {}))
            ))  # fmt: skip
        link = await FaultyLink("127.0.0.1", port, "127.0.0.3", port).start()
        stack.push_async_callback(link.aclose)
        act = await stack.enter_async_context(
            router(tmp_path, {MODEL: pods_entry(port, **extra)}, kube_api_url=api_url,
                   service_account_dir=sa_dir(tmp_path), continuation_key_file=master,
                   **router_settings)
        )  # fmt: skip
        await wait_candidates(act, ["pod-a"])
        link.pod_a = servers[0]  # pod A's server (its app)
        link.stack = stack  # for more servers
        yield act, api, link, port


class Reader:
    """One streamed request read as raw text; `events` counts the events so far."""

    def __init__(self, client: httpx.AsyncClient, method: str, path: str, body: dict) -> None:
        self.client, self.method, self.path, self.body = client, method, path, body
        self.raw = ""
        self.status = 0
        self.headers: httpx.Headers | None = None

    @property
    def events(self) -> int:
        return self.raw.count("\n\n")

    async def run(self) -> Reader:
        if self.method == "GET":
            request = self.client.stream("GET", f"{self.path}?{urlencode(self.body)}")
        else:
            request = self.client.stream("POST", self.path, json=self.body)
        async with request as r:
            self.status, self.headers = r.status_code, r.headers
            async for text in r.aiter_text():
                self.raw += text
        return self


async def handed_over(url: str) -> float:
    """Streams the model server at `url` handed to the router (all its labels)."""
    async with httpx.AsyncClient() as c:
        page = (await c.get(url + "/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(page)
               for sample in family.samples
               if sample.name == "sluice_streams_handed_over_total")  # fmt: skip


async def unbroken(url: str) -> dict[str, tuple[str, dict | None]]:
    """Each request's text and usage from a model server directly, unbroken."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        readers = [await Reader(c, m, p, b).run() for _, m, p, b in REQUESTS]
    return {
        name: text_and_usage(path, events_of(r.raw))
        for (name, _, path, _), r in zip(REQUESTS, readers, strict=True)
    }


async def break_midway(act, api, fault, requests=REQUESTS, at: int = 6) -> list[Reader]:
    """Every request through the router on pod A; once each has `at` events, pod B turns
    Ready and `fault()` breaks pod A; the readers once their streams ended."""
    async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=60) as c:
        readers = [Reader(c, m, p, b) for _, m, p, b in requests]
        tasks = [asyncio.ensure_future(r.run()) for r in readers]
        await eventually_async(lambda: all(r.events >= at for r in readers), timeout=30,
                               message=f"{at} events on every stream")  # fmt: skip
        assert not any(t.done() for t in tasks), "a stream ended before the break"
        api.ready("pod-b", True)
        await wait_candidates(act, ["pod-a", "pod-b"])
        fault()
        await asyncio.gather(*tasks)
    return readers


def results(act) -> dict[str, float]:
    page = act.app.metrics.scrape().decode()
    return {
        r: metric(page, "sluice_router_migrations_total", namespace=NS, model=NAME, result=r)
        for r in ("continued", "refused", "exhausted", "unavailable", "unmarked")
    }


async def test_every_protocol_survives_its_pods_death(tmp_path):
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 5}) as (
        act, api, link, port,
    ):  # fmt: skip
        readers = await break_midway(act, api, link.kill)
        reference = await unbroken(f"http://127.0.0.2:{port}")
        gaps = act.app.metrics.migration_gap.labels(NS, NAME)
        assert results(act)["continued"] == len(REQUESTS)
        assert metric(act.app.metrics.scrape().decode(),
                      "sluice_router_migration_gap_seconds_count") == len(REQUESTS)  # fmt: skip
        del gaps
    for (name, _, path, _), r in zip(REQUESTS, readers, strict=True):
        assert r.status == 200, name
        assert "x-sluice-marked" not in r.headers, name  # the router's, never the client's
        events = events_of(r.raw)
        check_one_stream(path, events)  # contiguous ids, one terminal event, one id
        assert text_and_usage(path, events) == reference[name], name


async def test_a_silent_pod_is_given_up_after_the_stall_timeout(tmp_path):
    chat = REQUESTS[:1]
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 1.5}) as (
        act, api, link, port,
    ):  # fmt: skip
        (reader,) = await break_midway(act, api, link.freeze, chat)
        reference = await unbroken(f"http://127.0.0.2:{port}")
        page = act.app.metrics.scrape().decode()
        assert results(act)["continued"] == 1
        # Given up only after stallSeconds of silence (the pods' keep-alive is 0.5 s).
        assert metric(page, "sluice_router_migration_gap_seconds_sum") >= 1.5
    events = events_of(reader.raw)
    check_one_stream(chat[0][2], events)
    assert text_and_usage(chat[0][2], events) == reference["chat"]


async def test_without_migration_a_dead_pod_cuts_the_stream(tmp_path):
    """The negative control: the same break, on a model without `migration`."""
    (name, _, path, _) = chat = REQUESTS[0]
    async with pods_with_link(tmp_path, None) as (act, api, link, port):
        (reader,) = await break_midway(act, api, link.kill, [chat])
        reference = await unbroken(f"http://127.0.0.2:{port}")
        assert results(act) == dict.fromkeys(results(act), 0.0)
    events = events_of(reader.raw)
    assert any("upstream_error" in e for e in events[-2:])
    text, usage = text_and_usage(path, events)
    assert usage is None and reference[name][0].startswith(text) and text != reference[name][0]


async def test_a_refused_continuation_ends_with_the_pods_message(tmp_path):
    """The pods' key no longer the one the router derives (a rotation half applied): the
    continuing pod refuses (403) and the stream ends with the error event saying so, at
    once (no retry on other pods)."""
    chat = REQUESTS[:1]
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 5}) as (
        act, api, link, port,
    ):  # fmt: skip

        def kill_with_another_key() -> None:
            (tmp_path / "pod-key").write_text("not-the-derived-key\n")
            link.kill()

        (reader,) = await break_midway(act, api, kill_with_another_key, chat)
        assert results(act)["refused"] == 1 and results(act)["continued"] == 0
    error = "\n".join(events_of(reader.raw)[-2:])
    assert "could not be continued" in error and "not this model's key" in error


async def test_a_stream_out_of_moves_ends_with_the_error_event(tmp_path):
    chat = REQUESTS[:1]
    async with pods_with_link(tmp_path, {"maxMigrations": 0, "stallSeconds": 5}) as (
        act, api, link, port,
    ):  # fmt: skip
        (reader,) = await break_midway(act, api, link.kill, chat)
        assert results(act)["exhausted"] == 1 and results(act)["continued"] == 0
    error = "\n".join(events_of(reader.raw)[-2:])
    assert "upstream_error" in error and "maxMigrations" in error


async def ws_generations(url: str, headers: dict, ids=(1, 2), started=None) -> dict:
    """Two generations on one socket; every frame each got, in order, once both finished.
    `started` (an event) is set once each has 6 token frames."""
    frames: dict = {rid: [] for rid in ids}
    async with websockets.connect(url.replace("http://", "ws://") + "/ws/stream",
                                  additional_headers=headers) as ws:  # fmt: skip
        for rid in ids:
            await ws.send(json.dumps({"id": rid, "prompt": f"hello river {rid}",
                                      "params": {"max_tokens": TOKENS}}))  # fmt: skip
        while not all(f and f[-1].get("finished") for f in frames.values()):
            raw = await ws.recv()
            assert "_sluice" not in raw  # the router's mark never reaches the client
            frame = json.loads(raw)
            frames[frame["id"]].append(frame)
            if started is not None and all(len(f) >= 6 for f in frames.values()):
                started.set()
    return frames


@pytest.mark.parametrize("fault", ["killed", "drained", "engine failed"])
async def test_websocket_generations_survive_their_pod(tmp_path, fault):
    engine = FailingEngine("sim", ttft_ms=5, itl_ms=40) if fault == "engine failed" else None
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 5},
                              itl_ms=40, engine_a=engine) as (act, api, link, port):  # fmt: skip
        started = asyncio.Event()
        task = asyncio.ensure_future(ws_generations(act.url, HEADERS, started=started))
        await asyncio.wait_for(started.wait(), 30)
        assert not task.done()
        api.ready("pod-b", True)
        await wait_candidates(act, ["pod-a", "pod-b"])
        if fault == "killed":
            link.kill()
        elif engine is not None:
            engine.failing = True  # both generations' next tokens raise: the socket closes
        else:
            api.terminating("pod-a")
            await wait_candidates(act, ["pod-b"])
            drained = asyncio.ensure_future(link.pod_a.app.state.services.gate.drain(60, 0))
        frames = await asyncio.wait_for(task, 60)
        if fault == "drained":
            assert await drained == 0
        reference = await ws_generations(f"http://127.0.0.2:{port}", {})
        assert results(act)["continued"] == 2
    for rid, got in frames.items():
        assert [f["index"] for f in got] == list(range(len(got)))  # no frame twice or missing
        assert [f.get("finished") for f in got].count(True) == 1
        text = "".join(f.get("token", "") for f in got)
        assert text == "".join(f.get("token", "") for f in reference[rid])
        assert got[-1]["usage"] == reference[rid][-1]["usage"]


async def test_a_draining_pod_hands_its_streams_to_the_router(tmp_path):
    """Rollout, scale-down, eviction: the pod stops taking requests, and after its hand-over
    window its streams go on on another pod; its drain ends then, not with the streams."""
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 5},
                              itl_ms=60) as (act, api, link, port):  # fmt: skip
        services = link.pod_a.app.state.services
        drained: list[int] = []

        def drain() -> None:  # what SIGTERM starts (serve.py), with a 60 s drain timeout
            api.terminating("pod-a")

            async def run() -> None:
                drained.append(await services.gate.drain(60, 0.3))

            asyncio.ensure_future(run())

        readers = await break_midway(act, api, drain)
        reference = await unbroken(f"http://127.0.0.2:{port}")
        assert drained == [0]  # every stream left the pod: none cut, none outlived the drain
        assert results(act)["continued"] == len(REQUESTS)
        assert await handed_over(link.pod_a) == len(REQUESTS)
    for (name, _, path, _), r in zip(REQUESTS, readers, strict=True):
        events = events_of(r.raw)
        check_one_stream(path, events)
        assert text_and_usage(path, events) == reference[name], name


class FailingEngine(SimulatorEngine):
    """A simulator whose running requests fail on demand while the pod stays up: `failing`
    makes each raise at its next token, as vLLM's generators raise EngineDeadError when the
    engine core dies; `shutdown()` ends each with finish reason `abort`, as vLLM's engine
    does for the requests it aborts itself."""

    failing = False

    async def _generate(self, request):
        async for delta in super()._generate(request):
            if self.failing:
                raise RuntimeError("the engine core died")
            yield delta


@pytest.mark.parametrize("failure", ["raised", "aborted"])
async def test_an_engine_failure_is_continued_on_another_pod(tmp_path, failure):
    """Pod A's engine fails its running requests while pod A, its link and its Pod stay up:
    instead of the error event, pod A hands each stream to the router, which continues it
    on pod B. Every protocol's stream reaches its client whole. Negative control: the same
    failure on a stream the router does not relay ends with the pod's error event."""
    engine = FailingEngine("sim", ttft_ms=5, itl_ms=25)
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 30},
                              engine_a=engine) as (act, api, link, port):  # fmt: skip

        def fail() -> None:
            if failure == "raised":
                engine.failing = True
            else:
                asyncio.ensure_future(engine.shutdown())

        readers = await break_midway(act, api, fail)
        reference = await unbroken(f"http://127.0.0.2:{port}")
        assert results(act)["continued"] == len(REQUESTS)
        assert await handed_over(link.pod_a) == len(REQUESTS)
        if failure == "raised":  # the control: straight to pod A, not through the router
            async with httpx.AsyncClient(base_url=link.pod_a, timeout=30) as c:
                (name, method, path, body) = REQUESTS[0]
                direct = await Reader(c, method, path, body).run()
            assert "the engine core died" in "\n".join(events_of(direct.raw)[-2:])
    for (name, _, path, _), r in zip(REQUESTS, readers, strict=True):
        events = events_of(r.raw)
        check_one_stream(path, events)
        assert text_and_usage(path, events) == reference[name], name


async def test_a_resume_after_a_migration_follows_the_stream_to_its_new_pod(tmp_path):
    """A token stream (GET, resume window on) on pod A, continued on pod B or C when A dies
    (the one that ranks highest for the stream's id); its client then loses its connection
    and reconnects with `Last-Event-ID` and its pin cookie, which names pod A, gone by then:
    the resume follows the stream to the pod that continued it, as any router replica
    would place it, and the stream goes on from the next event."""
    pin_key = tmp_path / "pin-key"
    pin_key.write_bytes(b"p" * 40)
    query = {"prompt": "hello river", "max_tokens": TOKENS}
    get = ("tokens-get", "GET", "/v1/stream", query)
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 5}, itl_ms=60,
                              server={"resume_grace_seconds": 30},
                              pin_key_file=pin_key) as (act, api, link, port):  # fmt: skip
        pod_c = SimulatorEngine("sim", ttft_ms=5, itl_ms=60)
        await link.stack.enter_async_context(
            model_server(port, pod_c, host="127.0.0.5", resume_grace_seconds=30,
                         continuation_key_file=tmp_path / "pod-key"))  # fmt: skip
        api.put("pod-c", "127.0.0.5", LABELS, ready=False)
        async with httpx.AsyncClient(base_url=act.url, headers=HEADERS, timeout=60) as c:
            reader = Reader(c, "GET", "/v1/stream", query)
            task = asyncio.ensure_future(reader.run())
            await eventually_async(lambda: reader.events >= 4, timeout=30, message="4 events")
            cookie = reader.headers.get("set-cookie", "").split(";")[0]
            assert cookie.startswith("sluice-pin=pod-a."), cookie
            api.ready("pod-b", True)
            api.ready("pod-c", True)
            await wait_candidates(act, ["pod-a", "pod-b", "pod-c"])
            link.kill()
            await eventually_async(lambda: results(act)["continued"] == 1, timeout=30,
                                   message="continued")  # fmt: skip
            await eventually_async(lambda: reader.events >= 10, timeout=30, message="more")
            task.cancel()  # the client's connection drops (a network blip)
            await asyncio.gather(task, return_exceptions=True)
            last = events_of(reader.raw)[-1].split("\n")[0].removeprefix("id: ")
            api.ready("pod-a", False)  # Kubernetes saw the pod die
            await wait_candidates(act, ["pod-b", "pod-c"])
            resumed = Reader(c, "GET", "/v1/stream", query)
            again = {"Last-Event-ID": last, "Cookie": cookie}
            async with c.stream("GET", "/v1/stream", params=query, headers=again) as r:
                assert r.status_code == 200, await r.aread()
                resumed.raw = "".join([t async for t in r.aiter_text()])
            page = act.app.metrics.scrape().decode()
            # The continuation and the resume, both placed by the stream's id.
            assert metric(page, "sluice_router_picks_total", by="follow") == 2
            reference = await unbroken_one(f"http://127.0.0.2:{port}", get)
    whole = events_of(reader.raw) + events_of(resumed.raw)
    check_one_stream("/v1/stream", whole)
    assert text_and_usage("/v1/stream", whole) == reference


async def unbroken_one(url: str, request) -> tuple[str, dict | None]:
    _, method, path, body = request
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await Reader(c, method, path, body).run()
    return text_and_usage(path, events_of(r.raw))


GREEDY = {"max_tokens": 160, "temperature": 0, "ignore_eos": True}
REAL_CHAT = ("chat", "POST", "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the river."}],
              "stream": True, "stream_options": {"include_usage": True}, **GREEDY})  # fmt: skip


@pytest.mark.engine
async def test_on_the_real_engine_the_text_goes_on_as_if_unbroken(tmp_path, engine):
    """Two model servers on the session's real engine (tiny model, temperature 0), one
    stream: pod A's link killed midway, the client's text equals an unbroken run's (the
    continuing pod's engine input is prompt + the received token ids; every protocol's
    rendering of a continuation on this engine: test_continuation_engine.py)."""
    _, method, path, body = REAL_CHAT
    async with pods_with_link(tmp_path, {"maxMigrations": 2, "stallSeconds": 30},
                              engine=engine) as (act, api, link, port):  # fmt: skip
        (reader,) = await break_midway(act, api, link.kill, [REAL_CHAT], at=4)
        assert results(act)["continued"] == 1
        async with httpx.AsyncClient(base_url=f"http://127.0.0.2:{port}", timeout=120) as c:
            whole = await Reader(c, method, path, body).run()
    events = events_of(reader.raw)
    check_one_stream(path, events)
    text, usage = text_and_usage(path, events)
    assert len(text) > 100
    assert (text, usage) == text_and_usage(path, events_of(whole.raw))


# -- Marks: what the router reads of a marked stream, whatever the socket reads brought --

API_STREAM = (
    b': sluice-id chatcmpl-1@17:0;\ndata: {"role": 1}\n\n'
    b'data: {"a": 1}\n\n: sluice-id chatcmpl-1@17:2;5,6\ndata: {"b": 2}\n\n'
    b": ping\n\n"
    b': sluice-id chatcmpl-1@17:3;7\ndata: {"c": 3}\n\n'
    b'data: {"usage": 1}\n\n: sluice-id chatcmpl-1@17:5;\ndata: [DONE]\n\n'
)
TOKEN_STREAM = (
    b'retry: 1000\nid: s1:0;11\ndata: {"index":0}\n\n'
    b'id: s1:1;12,13\ndata: {"index":1}\n\n'
    b'id: s1:2;\ndata: {"finished":true}\n\nid: s1:3;\ndata: [DONE]\n\n'
)


@pytest.mark.parametrize("raw,token_sse", [(API_STREAM, False), (TOKEN_STREAM, True)])
async def test_marks_pass_whole_marked_frames_whatever_the_reads(raw, token_sse):
    rng = random.Random(7)
    for _ in range(200):
        marks = Marks(token_sse)
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(0, 12)))
        sent = b""
        for piece in (raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)):
            out = marks.take(piece)
            sent += out
            # What went out ends where a marked frame (or a keep-alive after one) ends.
            assert not out or out.endswith(b"\n\n")
            if marks.index is not None:
                last = sent.rfind(b"id: ", 0) if token_sse else sent.rfind(b": sluice-id ")
                assert sent[last:].split(b"\n", 1)[0].split(b":")[-1].split(b";")[0] == (
                    str(marks.index).encode()
                )
        assert sent + marks.rest() == raw
        assert marks.finished
    assert marks.index == (5 if not token_sse else 3)
    assert b",".join(marks.ids) == (b"5,6,7" if not token_sse else b"11,12,13")


async def test_a_frame_cut_before_its_end_is_held_and_a_keepalive_passes():
    marks = Marks(False)
    head = b': sluice-id r@1:0;4\ndata: {"x": 1}\n\n'
    assert marks.take(head + b': sluice-id r@1:1;5\ndata: {"y"') == head
    assert marks.index == 0 and marks.ids == [b"4"] and not marks.finished
    assert marks.take(b": 2}\n\n: ping\n\n") == b': sluice-id r@1:1;5\ndata: {"y": 2}\n\n: ping\n\n'
    assert marks.index == 1 and marks.ids == [b"4", b"5"]


async def test_the_continuation_body_names_the_stream_and_what_the_client_has():
    marks = Marks(False)
    marks.take(b": sluice-id chatcmpl-7@1733350000:3;791,3785\ndata: {}\n\n")
    body = json.loads(continuation_body("POST", "/v1/chat/completions", b'{"stream": true}',
                                        marks, token_sse=False))  # fmt: skip
    assert body == {"method": "POST", "path": "/v1/chat/completions", "body": {"stream": True},
                    "token_ids": [791, 3785], "next_event": 4, "response_id": "chatcmpl-7",
                    "created": 1733350000}  # fmt: skip
    marks = Marks(True)
    marks.take(b"id: 9f2c:0;1\ndata: {}\n\n")
    body = json.loads(continuation_body("GET", "/v1/stream?prompt=x", b"", marks, True))
    assert body == {"method": "GET", "path": "/v1/stream?prompt=x", "token_ids": [1],
                    "next_event": 1, "response_id": "9f2c"}  # fmt: skip
