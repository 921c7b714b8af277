"""A model's versions sharing its traffic through the router (router/split.py, docs/placement.md
Versions): the owner `team-a/chat` and its version `team-a/chat-v2`, each with one pod (a
simulator model server found through a fake Pod watch) whose every token is its own word, so
each answer says which version produced it. Conversations of every session kind keep to one
version and land where the router's chooser puts them; a weight change moves only new
requests and only towards the version, and cuts no stream; a resume goes back to its
version by its pin. Negative controls: a version at weight 0 or missing from the file gets
nothing; a resume without its pin is placed as a new request (the owner: no such stream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from urllib.parse import urlencode

import httpx
import pytest
import websockets
from continuation_helpers import check_one_stream, events_of, text_and_usage
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import entry, metric, model_server, pods_api, router, sa_dir
from sluice_server.core.auth.routerkey import model_key
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.router.models import Split, Version
from sluice_server.router.pin import COOKIE
from sluice_server.router.split import bucket, choose, session
from testkit.faulty_link import FaultyLink
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
NS = "team-a"
OWNER, VERSION = f"{NS}/chat", f"{NS}/chat-v2"
WORDS = {OWNER: "alpha", VERSION: "omega"}  # each version's only word
PODS = {OWNER: ("chat-old", "127.0.0.1"), VERSION: ("chat-new", "127.0.0.2")}
MASTER = b"a-master-key-for-the-tests-0123456789"


def labels(key: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": key.split("/")[1], "sluice.dev/role": "leader"}


def models_file(port: int, weight: int, version: str = VERSION) -> dict:
    def pods(key: str) -> dict:
        return {"namespace": NS, "selector": labels(key), "port": port}

    split = {"versions": [{"model": OWNER, "weight": 100 - weight},
                          {"model": version, "weight": weight}]}  # fmt: skip
    return {
        OWNER: entry(8000, host="chat.team-a.invalid", pods=pods(OWNER), split=split),
        VERSION: entry(8000, host="chat-v2.team-a.invalid", pods=pods(VERSION)),
    }


@contextlib.asynccontextmanager
async def two_versions(tmp_path, weight: int, itl_ms: float = 1, **router_settings):
    """Both versions' pods and the router over the models file at `weight` for the version:
    (router, the pods' port)."""
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        for key, (pod, ip) in PODS.items():
            api.put(pod, ip, labels(key))
            engine = SimulatorEngine("sim", ttft_ms=2, itl_ms=itl_ms, words=(WORDS[key],))
            await stack.enter_async_context(
                model_server(port, engine, host=ip, resume_grace_seconds=30)
            )
        act = await stack.enter_async_context(
            router(tmp_path, models_file(port, weight), kube_api_url=api_url,
                   service_account_dir=sa_dir(tmp_path), **router_settings)
        )  # fmt: skip

        def both_ready() -> bool:
            sets = act.app.pods.sets.values()
            return len(sets) == 2 and all(len(s.candidates()) == 1 for s in sets)

        await eventually_async(both_ready, timeout=15, message="one pod of each version")
        yield act, port


def which(text: str) -> str:
    """The version an answer came from (`mixed` if both words appear, `none` if neither)."""
    found = [key for key, word in WORDS.items() if word in text]
    return found[0] if len(found) == 1 else ("mixed" if found else "none")


def split_of(weight: int) -> Split:
    return Split((Version(OWNER, 100 - weight), Version(VERSION, weight)))


class Turn:
    """One request as sent (so the test computes the chooser's answer from the same bytes)."""

    def __init__(self, method: str, path: str, headers: dict, body: dict | None = None,
                 query: dict | None = None) -> None:  # fmt: skip
        self.method, self.path, self.headers = method, path, {"X-Sluice-Model": OWNER, **headers}
        self.body = b"" if body is None else json.dumps(body).encode()
        self.query = urlencode(query or {}).encode()

    def predicted(self, weight: int) -> str:
        hdrs = [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        s = session(hdrs, self.query, self.path, self.body)
        assert s is not None
        return choose(split_of(weight), bucket(OWNER, s.key), {OWNER, VERSION})

    async def send(self, client: httpx.AsyncClient) -> str:
        headers = {**self.headers, "content-type": "application/json"}
        url = self.path + (f"?{self.query.decode()}" if self.query else "")
        r = await client.request(self.method, url, headers=headers, content=self.body or None)
        assert r.status_code == 200, r.text
        return which(r.text)


def conversation(kind: str, i: int, tokens: int = 3) -> list[Turn]:
    """The two turns of conversation `i`, keyed as `kind` says."""
    bearer = {"Authorization": f"Bearer sk-{i % 5}"}
    system = {"role": "system", "content": "You answer briefly."}
    first = {"role": "user", "content": f"question one of conversation {i}"}
    second = [first, {"role": "assistant", "content": "alpha"},
              {"role": "user", "content": "and then?"}]  # fmt: skip
    chat = "/v1/chat/completions"
    turns = []
    for history in ([first], second):
        if kind == "header":
            turns.append(
                Turn(
                    "POST",
                    chat,
                    {"X-Sluice-Session": f"s-{i}"},
                    {"model": "sim", "messages": history, "max_tokens": tokens},
                )
            )
        elif kind == "user":
            turns.append(
                Turn(
                    "POST",
                    chat,
                    bearer,
                    {
                        "model": "sim",
                        "messages": history,
                        "max_tokens": tokens,
                        "user": f"user-{i}",
                    },
                )
            )
        elif kind == "anthropic-user":
            turns.append(
                Turn(
                    "POST",
                    "/v1/messages",
                    {},
                    {
                        "model": "sim",
                        "messages": history,
                        "max_tokens": tokens,
                        "metadata": {"user_id": f"user-{i}"},
                    },
                )
            )
        elif kind == "credential":  # the fallback: the credential and the first turn
            turns.append(
                Turn(
                    "POST",
                    chat,
                    bearer,
                    {"model": "sim", "messages": [system, *history], "max_tokens": tokens},
                )
            )
        elif kind == "anonymous":  # the fallback with no credential: the first turn alone
            turns.append(
                Turn(
                    "POST",
                    chat,
                    {},
                    {"model": "sim", "messages": history, "max_tokens": tokens, "stream": True},
                )
            )
        elif kind == "responses":
            turns.append(
                Turn(
                    "POST",
                    "/v1/responses",
                    bearer,
                    {
                        "model": "sim",
                        "instructions": "be brief",
                        "input": history,
                        "max_output_tokens": tokens,
                    },
                )
            )
        elif kind == "tokens-get":  # EventSource: its prompt in the query
            turns.append(
                Turn(
                    "GET", "/v1/stream", {}, None, {"prompt": f"tell me {i}", "max_tokens": tokens}
                )
            )
    return turns  # fmt: skip


KINDS = ("header", "user", "anthropic-user", "credential", "anonymous", "responses",
         "tokens-get")  # fmt: skip
BY = {"header": "header", "user": "user", "anthropic-user": "user"}


async def run_conversations(act, convs: list[list[Turn]], turn: int) -> list[str]:
    """Turn `turn` of every conversation, 50 at a time: the version each answer came from."""
    async with httpx.AsyncClient(base_url=act.url, timeout=60) as c:
        out: list[str] = []
        for start in range(0, len(convs), 50):
            batch = convs[start : start + 50]
            out += await asyncio.gather(*(conv[turn].send(c) for conv in batch))
    return out


def picks(act, **labels: str) -> float:
    """`sluice_router_split_picks_total` of the owner, summed over the labels not given."""
    page = act.app.metrics.scrape().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "sluice_router_split_picks_total"
        and sample.labels["model"] == "chat"
        and all(sample.labels[k] == v for k, v in labels.items())
    )


async def test_conversations_keep_to_the_version_the_chooser_gives_them(tmp_path):
    convs = [conversation(KINDS[i % len(KINDS)], i) for i in range(210)]
    async with two_versions(tmp_path, 10) as (act, _):
        first = await run_conversations(act, convs, 0)
        second = await run_conversations(act, convs, 1)
        assert picks(act) == 2 * len(convs)
        by = {b: picks(act, by=b) for b in ("header", "user", "fallback")}
        versions = {v: picks(act, version=v.split("/")[1]) for v in (OWNER, VERSION)}
    split_across = [i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    assert split_across == []
    for i, conv in enumerate(convs):
        assert first[i] == conv[0].predicted(10) == conv[1].predicted(10), i
    on_version = first.count(VERSION)
    print(f"split: {on_version} of {len(convs)} conversations on the version")
    assert 0 < on_version < len(convs) // 5  # both used; about a tenth (the exact share: unit)
    # No session key and no credential: the first turn keeps each conversation on one
    # version, and the conversations still spread over both (not all sent to one).
    anonymous = [first[i] for i in range(len(convs)) if KINDS[i % len(KINDS)] == "anonymous"]
    assert len(anonymous) == 30 and set(anonymous) == {OWNER, VERSION}
    kinds = [KINDS[i % len(KINDS)] for i in range(len(convs))]
    assert by == {
        "header": 2 * kinds.count("header"),
        "user": 2 * (kinds.count("user") + kinds.count("anthropic-user")),
        "fallback": 2 * sum(kinds.count(k) for k in KINDS if k not in BY),
    }
    assert versions == {OWNER: 2 * first.count(OWNER), VERSION: 2 * on_version}


async def test_a_weight_change_moves_new_requests_only_towards_the_version(tmp_path):
    """20 streams in flight while the version's weight goes from 10 to 50: all complete on
    the version they began on; the conversations' next turns move only owner -> version."""
    tokens = 120
    convs = [conversation("header", i) for i in range(100)]
    streamed = [Turn("POST", "/v1/chat/completions", {"X-Sluice-Session": f"s-{i}"},
                     {"model": "sim", "messages": [{"role": "user", "content": "long"}],
                      "max_tokens": tokens, "stream": True,
                      "stream_options": {"include_usage": True}})
                for i in range(20)]  # fmt: skip
    async with two_versions(tmp_path, 10, itl_ms=20) as (act, port):
        before = await run_conversations(act, convs, 0)
        client = httpx.AsyncClient(base_url=act.url, timeout=60)
        raws = ["" for _ in streamed]

        async def read(n: int, turn: Turn) -> None:
            async with client.stream("POST", turn.path, headers=turn.headers,
                                     content=turn.body) as r:  # fmt: skip
                assert r.status_code == 200
                async for text in r.aiter_text():
                    raws[n] += text

        tasks = [asyncio.ensure_future(read(n, t)) for n, t in enumerate(streamed)]
        await eventually_async(lambda: all(r.count("data: ") >= 3 for r in raws), timeout=30,
                               message="3 events on every stream")  # fmt: skip
        act.write(models_file(port, 50))
        await eventually_async(
            lambda: act.app.models.by_key[OWNER].split.versions[1].weight == 50,
            timeout=10, message="the new weights loaded",
        )  # fmt: skip
        assert not any(t.done() for t in tasks)  # in flight across the change
        after = await run_conversations(act, convs, 1)
        await asyncio.gather(*tasks)
        await client.aclose()
        page = act.app.metrics.scrape().decode()
    for n, (raw, turn) in enumerate(zip(raws, streamed, strict=True)):
        events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]", n  # none cut
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == tokens, n
        assert which(raw) == turn.predicted(10), n  # wholly on the version it began on
    moves = {(a, b) for a, b in zip(before, after, strict=True) if a != b}
    assert moves == {(OWNER, VERSION)}  # some moved, and only towards the version
    for i, conv in enumerate(convs):
        assert (before[i], after[i]) == (conv[0].predicted(10), conv[1].predicted(50)), i
    assert "upstream_error" not in "".join(raws)
    assert metric(page, "sluice_activator_requests_total", outcome="disconnected") == 0


async def test_weight_zero_and_a_missing_version_send_it_nothing(tmp_path, caplog):
    """Negative controls: at weight 0 the version gets nothing; a split naming a model not
    in the file (logged once per reload) sends its share to the owner; naming the version
    directly still reaches it."""
    convs = [conversation(KINDS[i % len(KINDS)], i) for i in range(70)]
    caplog.set_level(logging.WARNING, logger="sluice_server.router.app")
    async with two_versions(tmp_path, 0) as (act, port):
        at_zero = await run_conversations(act, convs, 0)
        act.write(models_file(port, 50, version=f"{NS}/chat-v3"))
        await eventually_async(
            lambda: act.app.models.by_key[OWNER].split.versions[1].key == f"{NS}/chat-v3",
            timeout=10, message="the split naming chat-v3 loaded",
        )  # fmt: skip
        missing = await run_conversations(act, convs, 1)
        async with httpx.AsyncClient(base_url=act.url, timeout=30) as c:
            direct = await c.post("/v1/chat/completions", headers={"X-Sluice-Model": VERSION},
                                  json={"model": "sim", "messages": [{"role": "user",
                                        "content": "hi"}], "max_tokens": 3})  # fmt: skip
        assert picks(act, version="chat-v2") == 0
        assert picks(act, version="chat") == 2 * len(convs)
    assert set(at_zero) == set(missing) == {OWNER}
    assert which(direct.text) == VERSION
    warned = [r.getMessage() for r in caplog.records if "chat-v3" in r.getMessage()]
    assert len(warned) == 1 and "team-a/chat-v3 (50%)" in warned[0], warned


async def test_routes_that_are_no_conversation_turn_stay_with_the_owner(tmp_path):
    """`/v1/models` and the like name the owner's model and are answered by the owner's pod,
    whoever asks: they are not split and count as no conversation's pick (at weight 90 the
    version would take most of them)."""

    def sent(act, model: str) -> float:
        page = act.app.metrics.scrape().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(page)
            for sample in family.samples
            if sample.name == "sluice_router_picks_total" and sample.labels["model"] == model
        )

    async with two_versions(tmp_path, 90) as (act, _):
        async with httpx.AsyncClient(base_url=act.url, timeout=30) as c:
            for i in range(20):
                headers = {"X-Sluice-Model": OWNER, "Authorization": f"Bearer key-{i}",
                           "X-Sluice-Session": f"s-{i}"}  # fmt: skip
                r = await c.get("/v1/models", headers=headers)
                assert r.status_code == 200, r.text
        assert picks(act) == 0
        assert (sent(act, "chat"), sent(act, "chat-v2")) == (20, 0)


async def test_a_resume_goes_back_to_the_version_its_pin_names(tmp_path):
    """A token stream on the version, dropped and resumed with `Last-Event-ID` and its pin
    under a session key that would now choose the owner: it resumes on the version. Without
    the pin the resume is placed as a new request: the owner, which has no such stream."""
    key_file = tmp_path / "pin.key"
    key_file.write_bytes(b"k" * 32)
    on_version = next(f"s-{i}" for i in range(1000)
                      if choose(split_of(10), bucket(OWNER, f"s-{i}".encode()),
                                {OWNER, VERSION}) == VERSION)  # fmt: skip
    on_owner = next(f"s-{i}" for i in range(1000)
                    if choose(split_of(10), bucket(OWNER, f"s-{i}".encode()),
                              {OWNER, VERSION}) == OWNER)  # fmt: skip
    async with two_versions(tmp_path, 10, itl_ms=30, pin_key_file=key_file) as (act, _):
        client = httpx.AsyncClient(base_url=act.url, timeout=30)
        last_id, text = None, ""
        headers = {"X-Sluice-Model": OWNER, "X-Sluice-Session": on_version}
        async with client.stream("POST", "/v1/stream", headers=headers,
                                 json={"prompt": "long", "max_tokens": 200}) as r:  # fmt: skip
            assert r.status_code == 200
            cookie = r.cookies.get(COOKIE)
            async for line in r.aiter_lines():
                text += line
                if line.startswith("id: "):
                    last_id = line[4:]
                if last_id and last_id.split(";")[0].endswith(":2"):
                    break
        assert cookie and cookie.startswith("chat-new.") and last_id and which(text) == VERSION
        client.cookies.clear()

        async def resume(pin: str | None) -> tuple[int, str]:
            h = {"X-Sluice-Model": OWNER, "X-Sluice-Session": on_owner, "Last-Event-ID": last_id}
            if pin is not None:
                h["Cookie"] = f"{COOKIE}={pin}"
            seen = ""
            async with client.stream("GET", "/v1/stream", headers=h) as r:
                async for line in r.aiter_lines():
                    seen += line + "\n"
                    if seen.count("id: ") == 2:
                        break
                return r.status_code, seen

        status, _ = await resume(None)
        assert status == 404  # the owner's pod has no such stream
        status, seen = await resume(cookie)
        stream_id = last_id.split(";")[0].rsplit(":", 1)[0]
        assert status == 200 and f"id: {stream_id}:3" in seen and which(seen) == VERSION, seen
        await client.aclose()


async def test_websockets_by_header_or_credential_and_bad_input_refused(tmp_path):
    """A WebSocket is keyed at connect: its header, else its credential; with neither it
    goes to the owner. A session header over 256 bytes is refused (400), and a body over
    --max-body-bytes is refused before any version is chosen (413)."""
    async with two_versions(tmp_path, 50, max_body_bytes=4096) as (act, _):
        url = act.url.replace("http://", "ws://") + "/ws/stream"

        async def ws(headers: dict, query: str = "") -> str:
            frames: list[dict] = []
            async with websockets.connect(url + query, additional_headers={
                    "X-Sluice-Model": OWNER, **headers}) as socket:  # fmt: skip
                await socket.send(json.dumps({"id": 1, "prompt": "hi",
                                              "params": {"max_tokens": 3}}))  # fmt: skip
                while not frames or not frames[-1].get("finished"):
                    frames.append(json.loads(await socket.recv()))
            return which("".join(f.get("token", "") for f in frames))

        def predicted(headers: list[tuple[bytes, bytes]], query: bytes = b"") -> str:
            s = session(headers, query, "/ws/stream", None)
            return OWNER if s is None else choose(split_of(50), bucket(OWNER, s.key),
                                                  {OWNER, VERSION})  # fmt: skip

        for i in range(6):
            sess = f"ws-{i}"
            assert await ws({"X-Sluice-Session": sess}) == predicted(
                [(b"x-sluice-session", sess.encode())]), sess  # fmt: skip
            assert await ws({}, f"?api_key=key-{i}") == predicted([], f"api_key=key-{i}".encode())
        assert {await ws({}) for _ in range(4)} == {OWNER}
        async with httpx.AsyncClient(base_url=act.url, timeout=30) as c:
            long = await c.post(
                "/v1/messages",
                headers={"X-Sluice-Model": OWNER, "X-Sluice-Session": "x" * 300},
                json={"max_tokens": 3},
            )
            big = await c.post("/v1/chat/completions", headers={"X-Sluice-Model": OWNER},
                               content=b"{" + b" " * 5000 + b"}")  # fmt: skip
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers={
                    "X-Sluice-Model": OWNER, "X-Sluice-Session": "x" * 300}):  # fmt: skip
                pass
        assert refused.value.response.status_code == 400
        assert long.status_code == 400 and "at most 256" in long.text
        assert long.json()["type"] == "error"  # Anthropic's shape on its route
        assert big.status_code == 413
        page = act.app.metrics.scrape().decode()
        assert metric(page, "sluice_activator_requests_total", namespace=NS, model="chat",
                      outcome="rejected") == 3  # fmt: skip


async def test_a_broken_stream_continues_on_a_pod_of_its_own_version(tmp_path):
    """The version's stream, its pod killed midway, continues on the version's other pod,
    never on the owner's (whose pods take only the owner's continuation key): one whole
    stream of the version's words."""
    master = tmp_path / "master-key"
    master.write_bytes(MASTER + b"\n")
    port = free_port()
    # pod IPs: the owner's pod, the version's pod A (a link in front of its server) and B.
    owner_ip, a_ip, a_server_ip, b_ip = "127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8"
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        api.put("chat-old", owner_ip, labels(OWNER))
        api.put("chat-new-a", a_ip, labels(VERSION))
        api.put("chat-new-b", b_ip, labels(VERSION), ready=False)
        for key, ip in ((OWNER, owner_ip), (VERSION, a_server_ip), (VERSION, b_ip)):
            pod_key = tmp_path / f"{ip}.key"
            pod_key.write_bytes(model_key(MASTER, NS, key.split("/")[1]) + b"\n")
            engine = SimulatorEngine("sim", ttft_ms=2, itl_ms=25, words=(WORDS[key],))
            await stack.enter_async_context(
                model_server(port, engine, host=ip, continuation_key_file=pod_key)
            )
        link = await FaultyLink(a_ip, port, a_server_ip, port).start()
        stack.push_async_callback(link.aclose)
        models = models_file(port, 100)
        for entry_ in models.values():
            entry_["migration"] = {"maxMigrations": 2, "stallSeconds": 5}
        act = await stack.enter_async_context(
            router(tmp_path, models, kube_api_url=api_url, service_account_dir=sa_dir(tmp_path),
                   continuation_key_file=master)
        )  # fmt: skip

        def ready(*counts: int) -> bool:
            sets = {s.selector.labels: s for s in act.app.pods.sets.values()}
            got = [len(sets[k].candidates()) if k in sets else 0
                   for k in (tuple(sorted(labels(OWNER).items())),
                             tuple(sorted(labels(VERSION).items())))]  # fmt: skip
            return got == list(counts)

        await eventually_async(lambda: ready(1, 1), timeout=15, message="pods of both")
        raw = ""
        path = "/v1/chat/completions"
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 40,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        async def read() -> None:
            nonlocal raw
            async with (
                httpx.AsyncClient(base_url=act.url, timeout=60) as c,
                c.stream("POST", path, headers={"X-Sluice-Model": OWNER}, json=body) as r,
            ):
                assert r.status_code == 200
                async for text in r.aiter_text():
                    raw += text

        task = asyncio.ensure_future(read())
        await eventually_async(lambda: raw.count("data: ") >= 6, timeout=30,
                               message="6 events")  # fmt: skip
        api.ready("chat-new-b", True)
        await eventually_async(lambda: ready(1, 2), timeout=15, message="pod B ready")
        link.kill()
        await task
        page = act.app.metrics.scrape().decode()
    events = events_of(raw)
    check_one_stream(path, events)  # contiguous ids, one terminal event
    text, usage = text_and_usage(path, events)
    assert which(text) == VERSION and usage is not None and usage["completion_tokens"] == 40
    continued = "sluice_router_migrations_total"
    assert metric(page, continued, namespace=NS, model="chat-v2", result="continued") == 1
    assert metric(page, continued, namespace=NS, model="chat", result="continued") == 0
