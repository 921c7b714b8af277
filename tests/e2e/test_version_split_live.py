"""A new model version to a share of traffic, live (docs/versions.md): two simulator
StreamingModels serving one model name on a live node, the owner `chat` with the public
Ingress and `spec.routing.router.split: [{model: chat-v2, weight: 10}]`, the version
`chat-v2` with the router and an Ingress on a canary host with the owner's path (its pods
answer under the owner's prefix; the host is not the owner's); the chart's router (one pod)
in front. Requests go e2e ingress -> router -> pod.

- 1,000 conversations of two turns each, a third keyed by the X-Sluice-Session header, a
  third by the body's `user`, a third by the fallback (the first turn): the version served
  10% +- 3% of them (which pod served each request: its X-Request-Id in the pods' access
  logs), no conversation's turns on two versions, and every conversation where the
  router's own chooser (router/split.py) puts it.
- 20 streams in flight through the ingress, then the owner's weight for chat-v2 patched
  from 10 to 50: the router reloads its models file, no stream is cut (each ends with its
  final event, indexes contiguous, its usage the whole answer's), and a later turn of the
  first conversations moved only from the owner to the version, never back.
- The owner's condition TrafficSplit is True and status.split shows both versions with
  the new weights and each one's TTFT, error rate and tokens/s over the poller's window.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_harness.kube import eventually
from sluice_server.router.models import Split, Version
from sluice_server.router.split import bucket, choose, session

from .conftest import TIMINGS
from .live_helpers import by_request, live_pods, metric_sum, metrics_page, ready_model, sim_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("footprint")]

OWNER, NEW = "chat", "chat-v2"
SERVED = "sim"
CONVERSATIONS = 1000
STREAMS, STREAM_TOKENS = 20, 600  # 12 s per stream at 20 ms per token
REVISIT = 300  # conversations asked a third turn after the weight change


def _request(i: int, turn: int) -> tuple[dict[str, str], dict]:
    """Conversation i's turn (0-based): headers and body; its first turn repeats."""
    messages = [{"role": "user", "content": f"conversation {i}: hello"}]
    for t in range(1, turn + 1):
        messages += [{"role": "assistant", "content": "ok"},
                     {"role": "user", "content": f"turn {t}"}]  # fmt: skip
    body: dict = {"model": SERVED, "messages": messages, "max_tokens": 2}
    headers = {}
    if i % 3 == 0:
        headers["X-Sluice-Session"] = f"session-{i}"
    elif i % 3 == 1:
        body["user"] = f"user-{i}"
    return headers, body


def _expected(namespace: str, weight: int, i: int) -> str:
    """The version the router's chooser puts conversation i on."""
    headers, body = _request(i, 0)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    found = session(raw, b"", "/v1/chat/completions", json.dumps(body).encode())
    assert found is not None
    owner = f"{namespace}/{OWNER}"
    split = Split((Version(owner, 100 - weight), Version(f"{namespace}/{NEW}", weight)))
    return choose(split, bucket(owner, found.key), {owner, f"{namespace}/{NEW}"})


class Stream(threading.Thread):
    """One long OpenAI chat stream through the ingress; whole when it ended with [DONE],
    its usage the whole answer's and no error."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.chunks, self.tokens, self.done = 0, 0, False
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": SERVED, "stream": True, "max_tokens": STREAM_TOKENS,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"long stream {self.i}"}]}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              headers={"X-Sluice-Session": f"stream-{self.i}"},
                              timeout=httpx.Timeout(120, connect=10)) as r:  # fmt: skip
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        self.chunks += 1
                        usage = data.get("usage") or {}
                        self.tokens = usage.get("completion_tokens", self.tokens)
                        if self.chunks >= 10:
                            self.started.set()
                    self.done = self.done or line == "data: [DONE]"
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            self.started.set()

    @property
    def whole(self) -> bool:
        return self.done and self.error is None and self.tokens == STREAM_TOKENS

    def why(self) -> tuple:
        return (self.i, self.error, self.done, self.chunks, self.tokens)


def test_a_version_takes_its_share_per_conversation_and_a_weight_change_cuts_nothing(
    operator, models, namespace, live_nodes, live_router, ingress
):
    (node,), placement = live_nodes(1)
    (router,) = live_router.start(placement)
    fast = {"engine": {"simulator": {"ttftMs": 5, "itlMs": 20, "ttftPerStreamMs": 0,
                                     "jitter": 0}}}  # fmt: skip
    owner = sim_model(namespace, OWNER, placement, routing={"router": {
        "enabled": True, "split": [{"model": NEW, "weight": 10}]}}, **fast)  # fmt: skip
    version = sim_model(namespace, NEW, placement, routing={"router": {"enabled": True}},
                        ingress={"host": "canary.split.test"}, **fast)  # fmt: skip
    # The owner first: until its version exists, the owner keeps every conversation and
    # says why.
    models.create(owner)
    eventually(lambda: (models.condition(namespace, OWNER, "TrafficSplit") or {}).get("reason")
               == "VersionMissing", timeout=60, interval=0.5,
               message="TrafficSplit VersionMissing")  # fmt: skip
    models.create(version)
    ready_model(models, namespace, OWNER)
    ready_model(models, namespace, NEW)
    eventually(lambda: (models.condition(namespace, OWNER, "TrafficSplit") or {}).get("status")
               == "True", timeout=60, interval=0.5, message="TrafficSplit True")  # fmt: skip
    for name in (OWNER, NEW):
        eventually(lambda n=name: metric_sum(metrics_page(router.address), "sluice_activator_models_known",
                                       namespace=namespace, model=n) == 1, timeout=60,
                   interval=0.5, retry_on=(AssertionError, httpx.HTTPError),
                   message=f"the router to know {name}")  # fmt: skip
    url = f"{ingress.url}/{namespace}"
    eventually(lambda: httpx.get(f"{url}/v1/models", timeout=5).status_code == 200,
               timeout=60, interval=0.25, message="the owner through ingress -> router")  # fmt: skip
    pods = {p.metadata.name: m for m in (OWNER, NEW) for p in live_pods(models, namespace, m)}
    assert sorted(pods.values()) == [OWNER, NEW], pods

    client = httpx.Client(timeout=30)
    rid: dict[tuple[int, int], str] = {}

    def turn(i: int, t: int) -> None:
        headers, body = _request(i, t)
        r = client.post(f"{url}/v1/chat/completions", headers=headers, json=body)
        assert r.status_code == 200, r.text
        rid[(i, t)] = r.headers["x-request-id"]

    def served() -> dict[str, str]:
        """request id -> the version whose pod served it."""
        found = by_request(node, namespace, list(pods))
        return {r: pods[hits[0][0]] for r, hits in found.items() if len(hits) == 1}

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: turn(i, 0), range(CONVERSATIONS)))
        list(pool.map(lambda i: turn(i, 1), range(CONVERSATIONS)))
    took = time.monotonic() - started
    by = eventually(lambda: (s := served()) and all(rid[k] in s for k in rid) and s,
                    timeout=30, interval=0.5, message="every request in an access log")  # fmt: skip
    where = {i: {by[rid[(i, t)]] for t in (0, 1)} for i in range(CONVERSATIONS)}
    split_across = [i for i, w in where.items() if len(w) != 1]
    assert not split_across, split_across[:10]
    on_new = [i for i, w in where.items() if w == {NEW}]
    share = len(on_new) / CONVERSATIONS
    assert abs(share - 0.10) <= 0.03, share
    wrong = [i for i in range(CONVERSATIONS)
             if f"{namespace}/{next(iter(where[i]))}" != _expected(namespace, 10, i)]  # fmt: skip
    assert not wrong, wrong[:10]
    text = metrics_page(router.address)
    picks = {v: metric_sum(text, "sluice_router_split_picks_total", namespace=namespace, model=OWNER,
                     version=v) for v in (OWNER, NEW)}  # fmt: skip
    assert picks[NEW] == 2 * len(on_new), picks
    kinds = {k: metric_sum(text, "sluice_router_split_picks_total", namespace=namespace, by=k)
             for k in ("header", "user", "fallback")}  # fmt: skip
    assert all(v > 0 for v in kinds.values()), kinds

    # Promote: 10 -> 50 while 20 streams are in flight.
    reloads = metric_sum(
        metrics_page(router.address), "sluice_activator_models_reloads_total", result="ok"
    )
    streams = [Stream(url, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.error is None, s.why()
    models.patch(namespace, OWNER, {"spec": {"routing": {"router": {
        "split": [{"model": NEW, "weight": 50}]}}}})  # fmt: skip
    eventually(lambda: metric_sum(metrics_page(router.address), "sluice_activator_models_reloads_total",
                            result="ok") > reloads, timeout=60, interval=0.25,
               message="the router to reload its models file")  # fmt: skip
    in_flight = sum(1 for s in streams if s.is_alive())
    for s in streams:
        s.join(timeout=120)
    cut = [s.why() for s in streams if not s.whole]
    assert not cut, cut
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: turn(i, 2), range(REVISIT)))
    by = eventually(lambda: (s := served()) and all(rid[(i, 2)] in s for i in range(REVISIT))
                    and s, timeout=30, interval=0.5, message="the third turns logged")  # fmt: skip
    back = [i for i in range(REVISIT) if where[i] == {NEW} and by[rid[(i, 2)]] == OWNER]
    assert not back, back[:10]
    moved = [i for i in range(REVISIT) if where[i] == {OWNER} and by[rid[(i, 2)]] == NEW]
    assert all(f"{namespace}/{NEW}" == _expected(namespace, 50, i) for i in moved)
    assert all(by[rid[(i, 2)]] == _expected(namespace, 50, i).split("/")[1]
               for i in range(REVISIT))  # fmt: skip

    # The owner's status: both versions, the new weights, each one's numbers. Traffic keeps
    # flowing until the poller's window has requests on both.
    stop = threading.Event()

    def keep_busy() -> None:
        j = CONVERSATIONS
        while not stop.is_set():
            headers, body = _request(j, 0)  # streamed: a whole answer records no TTFT
            client.post(f"{url}/v1/chat/completions", headers=headers,
                        json={**body, "stream": True})  # fmt: skip
            j += 1

    busy = threading.Thread(target=keep_busy, daemon=True)
    busy.start()

    def both_measured():
        status = models.get(namespace, OWNER).get("status") or {}
        rows = {r["model"]: r for r in status.get("split") or []}
        ok = (set(rows) == {OWNER, NEW}
              and [rows[OWNER]["weight"], rows[NEW]["weight"]] == [50, 50]
              and all(r.get("ttftMilliseconds") is not None and r.get("tokensPerSecond", 0) > 0
                      and r.get("errorRate") is not None for r in rows.values()))  # fmt: skip
        return ok and rows

    try:
        rows = eventually(both_measured, timeout=120, interval=1,
                          message="status.split with both versions measured")  # fmt: skip
    finally:
        stop.set()
        busy.join(timeout=30)
    assert all(float(r["errorRate"]) == 0 for r in rows.values()), rows
    cond = models.condition(namespace, OWNER, "TrafficSplit") or {}
    assert cond.get("status") == "True" and f"{NEW} 50%" in cond.get("message", ""), cond
    TIMINGS["version split live: conversations / on the version (share) / split across / "
            "turns per s"] = (
        f"{CONVERSATIONS} / {len(on_new)} ({share:.3f}) / 0 / "
        f"{2 * CONVERSATIONS / took:.0f}")  # fmt: skip
    TIMINGS["version split live: weight 10 -> 50 with streams in flight / cut / moved back"] = (
        f"{in_flight} / 0 / 0")  # fmt: skip
    TIMINGS["version split live: status.split"] = json.dumps(list(rows.values()))
