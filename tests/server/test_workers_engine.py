"""A pod with two front-end workers on ONE real vLLM engine core (tiny model, CPU), started
as `sluice-server --api-workers 2` (vLLM's multi-API-server machinery): streams land on
both workers, one scrape is the pod's totals (ours and vLLM's), a client that goes away is
aborted on each worker, SIGTERM lets every worker's streams finish and exits 0, and a
killed worker takes the pod to not-ready and down.

One pod serves the first tests (the drain test stops it); the dead-worker test has its
own, started beside the first when the module starts, so the two starts overlap. Each
start costs 1-4 minutes here (engine core plus two front ends).

The abort proof is weaker than test_stream_abort.py's: that one spies on the engine's
output processor in the test's own process, which a separate pod does not allow. Here the
worker's access log says the client went away, and the engine's own counters show the
request was cut short and the engine went idle; the code path in each worker is the one
that test proves to 2 tokens.

What these tests check is the pod's own account (its access log, its counters), never how
fast the test process got somewhere. The pod runs at a lower CPU priority than the test
(`start_pod`), so its engine keeping both cores busy does not starve the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from epp_rules import extract, families
from pod_helpers import (
    access_entry,
    client,
    drain_while_streaming,
    kill_a_worker_while_streaming,
    metric,
    pin,
    pinned,
    read_stream,
    scrape,
    start_pod,
)
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine, pytest.mark.slow]

START_S = 600  # engine core + two front ends on a busy 2-core machine
LONG = 10_000  # tokens: over a minute of one stream here
HOLD = 3_000  # tokens: the drain test's pinned reads, about 30 s beside the others
MAX_SEQS = 12  # above every other test's concurrency (the drain test's 8 + 2 pinned)
EPP_STREAMS = 16  # the endpoint-picker test's load: MAX_SEQS running, the rest waiting
EPP_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
              "vllm:kv_cache_usage_perc", "vllm:cache_config_info")  # fmt: skip


def _pod(log_dir, *flags):
    scratch = tempfile.mkdtemp(prefix="sluice-pod-")
    # Streams far longer than the tiny model's 4,096 positions (its weights are random
    # anyway): a stream the test means to cut, or to hold open, then lasts over a minute,
    # longer than any stall of a starved test process.
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "TMPDIR": scratch,
           "VLLM_CACHE_ROOT": os.path.join(scratch, "vllm"),
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}  # fmt: skip
    # At most MAX_SEQS sequences run at once, so a load above it also shows as waiting.
    return start_pod(log_dir, "--model", "tiny", "--max-model-len", str(LONG + 64),
                     "--max-num-seqs", str(MAX_SEQS), "--drain-timeout-seconds", "180",
                     *flags, env=env, timeout=START_S)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def spare_pod(request, tmp_path_factory, tiny_model_path):
    """The dead-worker test's own pod (that test ends its pod), started in a thread as the
    module starts (autouse: before `pod`), so its start overlaps the shared pod's; a future
    of (process, url), or None when that test is not selected."""
    if not any(item.name == DEAD_WORKER_TEST for item in request.session.items):
        yield None
        return
    log_dir = tmp_path_factory.mktemp("spare-pod")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_pod, log_dir)
        try:
            yield future
        finally:
            with contextlib.suppress(Exception):  # its start failed: the test said so
                future.result(timeout=START_S)[0].stop(timeout=60)


@pytest.fixture(scope="module")
def pod(tmp_path_factory, tiny_model_path):
    proc, url = _pod(tmp_path_factory.mktemp("pod"))
    try:
        yield proc, url
    finally:
        proc.stop(timeout=60)


async def _settled(c: httpx.AsyncClient, limit_s: float = 30.0) -> str:
    """The pod's metrics once no stream is active and vLLM's token count stopped moving
    (the same in two scrapes in a row)."""
    previous: dict[str, float | None] = {"tokens": None}

    async def idle() -> str | None:
        text = await scrape(c)
        tokens = metric(text, "vllm:generation_tokens_total")
        moved, previous["tokens"] = tokens != previous["tokens"], tokens
        return text if metric(text, "sluice_active_streams") == 0 and not moved else None

    return await eventually_async(idle, timeout=limit_s, interval=0.2, retry_on=(),
                                  message="the engine to go idle")  # fmt: skip


async def test_streams_land_on_both_workers_and_metrics_sum(pod):
    _, url = pod
    async with client(url) as c:
        results = await asyncio.gather(*(read_stream(c, 16) for _ in range(12)))
        assert all(r["status"] == 200 and r["done"] for r in results)
        assert {r["worker"] for r in results} == {"0", "1"}
        text = await _settled(c)
    n = len(results)
    assert metric(text, "sluice_requests_total", protocol="sse") == n
    assert metric(text, "sluice_ttft_seconds_count", protocol="sse") == n
    assert metric(text, "sluice_ttft_seconds_bucket", protocol="sse", le="+Inf") == n
    assert metric(text, "sluice_output_tokens_total", protocol="sse") == n * 16
    # vLLM's own metrics, written by both front ends, summed the same way.
    assert metric(text, "vllm:generation_tokens_total") == n * 16
    assert metric(text, "vllm:request_success_total") == n


@pytest.mark.parametrize("worker", ["0", "1"])
async def test_disconnect_aborts_on_each_worker(pod, worker):
    proc, url = pod
    long = {"prompt": "The river", "max_tokens": LONG, "ignore_eos": True}
    async with client(url) as probe:
        before = await _settled(probe)
        async with pinned(url, worker) as c:
            async with c.stream("POST", "/v1/stream", json=long) as r:
                assert r.headers["x-sluice-worker"] == worker
                rid, got = r.headers["x-request-id"], 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        got += 1
                        if got >= 20:
                            break
            # Leaving the block with the body unread drops the TCP connection.
        after = await _settled(probe)
    # The worker's own account: the client went away, and the engine stopped short.
    entry = access_entry(proc, rid)
    assert entry["outcome"] == "disconnected", entry
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    print(f"\nworker {worker}: {got} tokens read, {generated:.0f} generated")
    assert got <= generated < LONG, entry  # cut short, not run to the end
    for name in ("sluice_client_disconnects_total", "sluice_aborts_total"):
        assert metric(after, name, protocol="sse") - metric(before, name, protocol="sse") == 1


async def _epp_reading(c: httpx.AsyncClient, done, limit_s: float = 300.0):
    """Scrape until `done(reading, pod's own metrics text)`; the EPP's reading of the last."""
    last: list = [None, ""]

    async def read():
        text = await scrape(c)
        last[:] = [extract(text), text]
        return (last[0], text) if done(last[0], text) else None

    def why() -> str:
        return f"the EPP reading to be done\n{last[0]}\n{last[1][-3000:]}"

    return await eventually_async(read, timeout=limit_s, interval=0.2, message=why)


def _exactly_once(text: str) -> None:
    fams = families(text)
    for name in EPP_GAUGES:
        assert len(fams.get(name, [])) == 1, (name, fams.get(name))


async def test_an_endpoint_picker_reads_the_pods_load_once_across_workers(pod):
    """llm-d-router's extractor rules (epp_rules.py) on this pod's /metrics: every gauge it
    reads is one series (it takes the first, so a per-worker split would read one worker's
    share), the values are the pod's (running + waiting = the streams the pod itself counts,
    so not doubled by two workers), they move with load and come back when it ends, and the
    cache config parses as the EPP parses it."""
    _, url = pod
    async with client(url) as c:
        text = await _settled(c)
        # A pod no request has reached yet may lack the scheduler gauges: vLLM's are
        # multiprocess "mostrecent" gauges, which the collector leaves out until first set
        # (the EPP then reports the family missing and keeps its zero defaults). Whatever
        # is there is there once.
        fams = families(text)
        for name in EPP_GAUGES:
            assert len(fams.get(name, [])) <= 1, (name, fams.get(name))
        assert "vllm:lora_requests_info" not in fams  # no adapters: none, as vLLM

        holds = []
        for i in range(EPP_STREAMS):  # half on each worker
            hold = await pin(url, str(i % 2))
            holds.append((hold, asyncio.create_task(read_stream(hold, LONG))))
        try:
            busy, text = await _epp_reading(
                c, lambda r, t: metric(t, "sluice_active_streams") == EPP_STREAMS
                and r.running + r.waiting == EPP_STREAMS and r.kv_cache_usage > 0)  # fmt: skip
            _exactly_once(text)
            # The scheduler runs at most MAX_SEQS (fewer if KV blocks run out); the rest wait.
            assert 0 < busy.running <= MAX_SEQS and busy.waiting >= EPP_STREAMS - MAX_SEQS, busy
            assert 0 < busy.kv_cache_usage <= 1 and busy.errors == []
            assert busy.block_size > 0 and busy.num_gpu_blocks > 0
        finally:
            for hold, task in holds:
                task.cancel()
                await hold.aclose()
            await asyncio.gather(*(t for _, t in holds), return_exceptions=True)
        after, text = await _epp_reading(c, lambda r, t: r.running == r.waiting == 0
                                         and r.kv_cache_usage == 0.0)  # fmt: skip
        _exactly_once(text)
        assert after.errors == []


async def test_sigterm_drains_every_worker_and_exits_zero(pod):
    proc, url = pod
    await drain_while_streaming(proc, url, streams=8, tokens=300, hold_tokens=HOLD, exit_s=240)


DEAD_WORKER_TEST = "test_a_dead_worker_makes_the_pod_not_ready_then_exit"


async def test_a_dead_worker_makes_the_pod_not_ready_then_exit(spare_pod: Future):
    proc, url = await asyncio.wrap_future(spare_pod)
    try:
        await kill_a_worker_while_streaming(
            proc,
            url,
            streams=8,
            tokens=400,
            ready_within_s=30,
            hold_tokens=LONG,
        )
        assert proc.proc.wait(timeout=120) != 0, proc.tail()
        log = proc.log_path.read_text(errors="replace")
        # vLLM's wait names the worker (its exit code can read None: it is not reaped yet).
        assert re.search(r"ApiServer_\d \(PID: \d+\) died with exit code", log), log[-3000:]
        assert re.search(r"workers exited with \[(-9, 0|0, -9)\]", log), log[-3000:]
    finally:
        proc.stop(timeout=60)
