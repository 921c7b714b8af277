"""The router's pick over one model's pods (router/upstream.py over podview.py): a request
goes to the pod whose index holds its prompt's blocks (from KV events, or from what the
router sent), with the negative control that a prefix weight of 0 places by load alone;
a KV-event-fed index is emptied when its pod restarts and forgotten when the pod leaves;
a pod's load is read from vLLM's /metrics format and from the simulator server's."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from sluice_server.kvcache import kvevents
from sluice_server.router.loads import Load, parse_load
from sluice_server.router.metrics import RouterMetrics
from sluice_server.router.models import Balance, KvEventPorts, Model, PodSelector
from sluice_server.router.placement import Scoring
from sluice_server.router.pods import Pod, PodSet
from sluice_server.router.podview import PodView
from sluice_server.router.prefixindex import PrefixIndex
from sluice_server.router.upstream import Closing, Upstream
from testkit.wait import eventually_async

NS, NAME = "team-a", "chat"
HASHES = [101, 102, 103, 104]


def pod(name: str, ip: str, restarts: int = 0) -> Pod:
    return Pod(name, f"uid-{name}", ip, True, False, restarts, ("c1",))


def model(kv: KvEventPorts | None = None, balance: Balance = "least-loaded") -> Model:
    selector = PodSelector(NS, (("app", "chat"),), 8000, kv)
    return Model(NS, NAME, "chat.invalid", 8000, 30.0, 100, 1.0, selector, balance)


def podset(*pods: Pod) -> PodSet:
    s = PodSet(model().pods)  # type: ignore[arg-type]
    s.replace(list(pods))
    return s


def upstream(pods: PodSet, scoring: Scoring | None = None, hashes=None,
             balance: Balance = "least-loaded") -> Upstream:  # fmt: skip
    m, metrics = model(balance=balance), RouterMetrics()
    view = PodView(m, pods, metrics, scoring)
    return Upstream(m, None, metrics, 1.0, 1.0, Closing(), pods, view, hashes)  # type: ignore[arg-type]


def picks(up: Upstream, by: str) -> float:
    return up.view.metrics.picks.labels(NS, NAME, by)._value.get()  # type: ignore[union-attr]


def provider(path: str, body: bytes, tenant: str | None) -> list[int] | None:
    """A fake PromptHashes: the body names its blocks (`"101 102"`); other routes: None."""
    if path != "/v1/completions":
        return None
    return [int(w) for w in body.split()]


async def test_a_request_goes_to_the_pod_whose_events_hold_its_prefix_even_when_busier():
    pods = podset(pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2"))
    up = upstream(pods, hashes=provider)
    assert up.view is not None
    up.view.index.feed("pod-b", live=True)
    up.view.index.stored("pod-b", HASHES)
    busy = up.pick(b"other", pin="pod-b")  # a stream runs on pod-b: it is the busier
    assert busy is not None and up.in_flight == {"pod-b": 1}
    hashes = await up.prompt_hashes("/v1/completions", b"101 102 103 104", None)
    assert hashes == HASHES
    target = up.pick(b"k", hashes=hashes)
    assert target is not None and target.pod == "pod-b"
    assert picks(up, "prefix") == 1
    # Negative control: the same pods, index and load with the prefix weight at 0 (load
    # only): the request goes to the idle pod.
    control = upstream(pods, Scoring().without_prefix(), hashes=provider)
    assert control.view is not None
    control.view.index.feed("pod-b", live=True)
    control.view.index.stored("pod-b", HASHES)
    control.in_flight.update({"pod-b": 1})
    other = control.pick(b"k", hashes=HASHES)
    assert other is not None and other.pod == "pod-a"
    assert picks(control, "prefix") == 0 and picks(control, "load") == 1


async def test_without_events_the_pod_a_prefix_was_sent_to_gets_the_next_request():
    """The approximate index: what the router sent places the next request sharing it."""
    up = upstream(podset(pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")))
    first = up.pick(b"first", hashes=HASHES)
    assert first is not None and picks(up, "load") == 1
    second = up.pick(b"second", hashes=HASHES[:3] + [999])  # shares 3 blocks; first still runs
    assert second is not None and second.pod == first.pod
    assert picks(up, "prefix") == 1
    # Unknown blocks (None): load only, so the idle pod.
    third = up.pick(b"third", hashes=None)
    assert third is not None and third.pod != first.pod


async def test_round_robin_takes_each_pod_in_turn_whatever_the_prefix_and_load():
    """`balance: round-robin`: each candidate in turn by name; the pod whose events hold the
    prompt's blocks, the busier one, gets no more than its turn. A pin is still honoured."""
    pods = podset(pod("pod-b", "10.0.0.2"), pod("pod-a", "10.0.0.1"), pod("pod-c", "10.0.0.3"))
    up = upstream(pods, hashes=provider, balance="round-robin")
    assert up.view is not None
    up.view.index.feed("pod-b", live=True)
    up.view.index.stored("pod-b", HASHES)
    got = []
    for i in range(6):
        target = up.pick(f"k{i}".encode(), hashes=HASHES)
        assert target is not None
        got.append(target.pod)  # in flight: pod-a busier than pod-c after the first turn
    assert got == ["pod-a", "pod-b", "pod-c"] * 2, got
    assert (picks(up, "round-robin"), picks(up, "prefix"), picks(up, "load")) == (6, 0, 0)
    assert not up.view.index.longest_prefix("pod-a", HASHES)  # nothing remembered as sent
    pinned = up.pick(b"k", pin="pod-c", hashes=HASHES)
    assert pinned is not None and pinned.pod == "pod-c" and picks(up, "pin") == 1
    # Negative control: the same pods and index, least-loaded: every request on pod-b.
    control = upstream(pods, hashes=provider)
    assert control.view is not None
    control.view.index.feed("pod-b", live=True)
    control.view.index.stored("pod-b", HASHES)
    placed = [t.pod for i in range(3) if (t := control.pick(f"k{i}".encode(), hashes=HASHES))]
    assert placed == ["pod-b"] * 3 and picks(control, "prefix") == 3, placed


async def test_a_failing_provider_places_by_load_and_pins_are_counted():
    def broken(path, body, headers):
        raise RuntimeError("no tokenizer")

    up = upstream(podset(pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")), hashes=broken)
    assert await up.prompt_hashes("/v1/completions", b"x", None) is None
    pinned = up.pick(b"k", pin="pod-a")
    assert pinned is not None and pinned.pod == "pod-a" and picks(up, "pin") == 1
    # Without pods (a Service): no provider call, no view.
    plain = Upstream(
        Model(NS, NAME, "h", 8000, 30.0, 100, 1.0),
        None,  # type: ignore[arg-type]
        RouterMetrics(),
        1.0,
        1.0,
        Closing(),
        hashes=provider,
    )
    assert await plain.prompt_hashes("/v1/completions", b"1", None) is None
    target = plain.pick(b"k")
    assert target is not None and target.pod is None


class FakeSubscriber:
    """A Subscriber whose updates the test hands over; notes when it is stopped."""

    made: list[FakeSubscriber] = []

    def __init__(self, pod: str, endpoint: str, replay: str | None) -> None:
        self.pod, self.endpoint, self.replay = pod, endpoint, replay
        self.queue: asyncio.Queue[kvevents.Update] = asyncio.Queue()
        self.stopped = False
        FakeSubscriber.made.append(self)

    async def run(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped = True

    async def updates(self):
        while True:
            yield await self.queue.get()

    def stored(self, seq: int, hashes: list[int]) -> None:
        event = kvevents.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
            lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        batch = kvevents.KVEventBatch(ts=0.0, events=[event])
        self.queue.put_nowait(kvevents.Batch(self.pod, seq, batch))


async def test_an_event_fed_index_is_emptied_on_a_restart_and_forgotten_when_the_pod_leaves():
    FakeSubscriber.made.clear()
    a, b = pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")
    pods = podset(a, b)
    m, metrics = model(KvEventPorts(5557, 5558)), RouterMetrics()
    view = PodView(m, pods, metrics, subscriber=FakeSubscriber)  # type: ignore[arg-type]
    live = metrics.kv_feeds.labels(NS, NAME)
    view.start()
    try:
        await eventually_async(lambda: len(FakeSubscriber.made) == 2, timeout=5)
        sub_a = next(s for s in FakeSubscriber.made if s.pod == "pod-a")
        assert (sub_a.endpoint, sub_a.replay) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
        assert not view.index.is_live("pod-a") and live._value.get() == 0  # no batch yet
        sub_a.stored(0, HASHES)
        await eventually_async(lambda: view.index.longest_prefix("pod-a", HASHES) == 4, timeout=5)
        assert view.index.is_live("pod-a") and view.live_feeds() == 1
        # A Reset (events lost): the precise set is emptied and the feed is not live.
        sub_a.queue.put_nowait(kvevents.Reset("pod-a", "lost batches 1..2"))
        await eventually_async(lambda: not view.index.is_live("pod-a"), timeout=5)
        assert view.index.size("pod-a")[0] == 0
        sub_a.stored(3, HASHES)
        await eventually_async(lambda: view.index.is_live("pod-a"), timeout=5)
        # The container restarts: nothing of the pod is kept, and a new feed follows it.
        view.index.sent("pod-a", [7])
        pods.replace([pod("pod-a", "10.0.0.1", restarts=1), b])
        assert view.index.size("pod-a") == (0, 0) and not view.index.is_live("pod-a")
        await eventually_async(lambda: sub_a.stopped, timeout=5)
        again = [s for s in FakeSubscriber.made if s.pod == "pod-a"]
        assert len(again) == 2 and not again[1].stopped
        again[1].stored(0, HASHES[:2])
        await eventually_async(lambda: view.index.longest_prefix("pod-a", HASHES) == 2, timeout=5)
        # The pod leaves the candidates: its feed stops and the index forgets it.
        pods.replace([b])
        await eventually_async(lambda: "pod-a" not in view.index.pods(), timeout=5)
        await eventually_async(lambda: again[1].stopped, timeout=5)
        assert set(view.feeds) == {"pod-b"} and view.live_feeds() == 0
    finally:
        await view.aclose()
    assert all(s.stopped for s in FakeSubscriber.made)


# What vLLM 0.32's /metrics serves (vllm/v1/metrics/loggers.py: PrometheusStatLogger; one
# engine), abridged: the two gauges read, and their neighbours that must not be.
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.4375
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4096.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.25
"""
SERVER_PAGE = """\
# HELP sluice_queue_depth Requests waiting in the admission queue, by priority class.
# TYPE sluice_queue_depth gauge
sluice_queue_depth{model="chat",priority="interactive"} 1.0
sluice_queue_depth{model="chat",priority="batch"} 2.0
# HELP sluice_active_streams Streams generating.
# TYPE sluice_active_streams gauge
sluice_active_streams{model="chat",protocol="openai"} 4.0
"""


def test_the_load_is_read_from_vllms_page_and_the_servers_queue():
    assert parse_load(VLLM_PAGE) == Load(5, 0.4375)
    # The server's admission queue (every engine, the simulator too) adds to the waiting.
    assert parse_load(SERVER_PAGE) == Load(3, 0.0)
    assert parse_load(SERVER_PAGE + VLLM_PAGE) == Load(8, 0.4375)
    # Negative control: a page without a waiting measure is no reading.
    assert parse_load(SERVER_PAGE.split("# HELP sluice_active")[0].replace("queue", "x")) is None
    assert parse_load("") is None
    # Only those metrics' lines are parsed: the rest of a page is not read at all.
    assert parse_load("other{ not prometheus\n" + SERVER_PAGE) == Load(3, 0.0)
    with pytest.raises(ValueError):
        parse_load('sluice_queue_depth{priority="high" 3\n')


async def test_a_scrape_records_the_load_and_a_page_without_it_reads_as_never_scraped():
    pages = {"10.0.0.1": VLLM_PAGE, "10.0.0.2": "# nothing here\n"}

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics" and request.url.port == 8000
        return httpx.Response(200, text=pages[request.url.host])

    a, b = pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")
    m, metrics = model(), RouterMetrics()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        view = PodView(m, podset(a, b), metrics, client=client)
        await view.scrape(a)
        await view.scrape(b)
    la, lb = view.loads([a, b], {"pod-b": 2})
    assert (la.waiting, la.kv_use, la.in_flight) == (5, 0.4375, 0)
    assert la.scrape_age_s < 5
    assert lb.scrape_age_s == math.inf and lb.in_flight == 2
    scrapes = metrics.scrapes.labels
    assert scrapes(NS, NAME, "ok")._value.get() == 1
    assert scrapes(NS, NAME, "missing")._value.get() == 1


@pytest.mark.parametrize("field", ["prefix_weight", "queue_weight", "in_flight_weight"])
def test_the_router_flags_default_to_placements_scoring(field):
    from pathlib import Path

    from sluice_server.router.app import scoring
    from sluice_server.settings import RouterSettings

    assert scoring(RouterSettings(models_file=Path("m.json"))) == Scoring()
    assert getattr(scoring(RouterSettings(models_file=Path("m.json"), **{field: 0})), field) == 0


async def test_a_failed_subscriber_takes_its_feed_down_and_a_fresh_one_follows_the_pod(
    monkeypatch,
):
    """A subscriber whose socket loop raises: the pod is scored without its feed, and a new
    subscriber follows it after the retry wait; a batch on it makes the feed live again."""
    from sluice_server.router import kvfeed

    monkeypatch.setattr(kvfeed, "RETRY_FIRST", 0.05)

    class Failing(FakeSubscriber):
        async def run(self) -> None:
            if len(FakeSubscriber.made) == 1:  # the first one fails
                raise OSError("zmq socket closed")
            await super().run()

    FakeSubscriber.made.clear()
    index = PrefixIndex()
    feed = kvfeed.KvFeed("pod-a", "10.0.0.1", 5557, 5558, index, make=Failing)
    feed.start()
    try:
        await eventually_async(lambda: feed.restarts == 1, timeout=5, message="a fresh one")
        assert len(FakeSubscriber.made) == 2 and not index.is_live("pod-a")
        FakeSubscriber.made[1].stored(0, HASHES)
        await eventually_async(lambda: index.longest_prefix("pod-a", HASHES) == 4, timeout=5)
        assert index.is_live("pod-a")
    finally:
        await feed.aclose()
    assert FakeSubscriber.made[1].stopped and feed.restarts == 1


async def test_short_bodies_are_hashed_on_the_loop_long_ones_on_the_hashing_thread():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from sluice_server.router import upstream as upstream_mod

    threads: list[str] = []

    def recording(path: str, body: bytes, tenant: str | None) -> list[int] | None:
        threads.append(threading.current_thread().name)
        return provider(path, body, tenant)

    pods = podset(pod("pod-a", "10.0.0.1"))
    with ThreadPoolExecutor(1, thread_name_prefix="hashing") as hashing:
        up = upstream(pods, hashes=recording)
        up.hashing = hashing
        short = b"101 102"
        long = b"101 " * (upstream_mod.INLINE_BYTES // 4 + 1)
        assert await up.prompt_hashes("/v1/completions", short, None) == [101, 102]
        assert len(await up.prompt_hashes("/v1/completions", long, None) or ()) > 1
        # round robin never reads the hashes: none computed, on no thread
        rr = upstream(pods, hashes=recording, balance="round-robin")
        rr.hashing = hashing
        assert await rr.prompt_hashes("/v1/completions", short, None) is None
        assert await rr.prompt_hashes("/v1/completions", long, None) is None
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("hashing") and len(threads) == 2
