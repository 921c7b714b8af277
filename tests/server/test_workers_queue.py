"""The admission queue of a pod with two front-end workers (`--api-workers 2`) on the
simulator, as a real process tree: the queue's bound and its timeout are the pod's whichever
worker a request lands on (negative control: per-worker queues hold twice as many), a client
that leaves while queued frees its place at once, and SIGTERM answers every queued request
503 at once while the streams in flight finish.

Connections are pinned to a worker (`pin`), so both workers are exercised whatever the
kernel's spreading does; the verdicts come from the pod's metrics and access log."""

from __future__ import annotations

import asyncio
import signal

import pytest
from pod_helpers import access_entry, client, metric, pin, read_stream, scrape, start_pod
from testkit.wait import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

SIM = ("--engine", "simulator", "--model", "sim", "--sim-ttft-ms", "5", "--sim-itl-ms", "20")
# The pod runs niced (pod_helpers.start_pod): on a machine busy with other work its two
# workers' start-up (imports) can take a minute of waiting for the CPU.
START_S = 180


async def pinned(url: str, workers: str) -> list:
    """One connection pinned to each worker named in `workers` ("001": two to worker 0,
    one to worker 1), all made before any request is sent."""
    return [await pin(url, w) for w in workers]


def reads(clients: list, tokens: int) -> list:
    """A `read_stream` task on each client: (client, task) pairs."""
    return [(c, asyncio.create_task(read_stream(c, tokens))) for c in clients]


async def pinned_reads(url: str, workers: str, tokens: int) -> list:
    return reads(await pinned(url, workers), tokens)


async def close(reads: list) -> None:
    for _, task in reads:
        task.cancel()
    await asyncio.gather(*(t for _, t in reads), return_exceptions=True)
    for c, _ in reads:
        await c.aclose()


async def pod_counts(url: str) -> tuple[float, float, float]:
    """Streams, queued requests and queue-full refusals, from one scrape of the pod."""
    async with client(url) as c:
        text = await scrape(c)
    return (metric(text, "sluice_active_streams"), metric(text, "sluice_queue_depth"),
            metric(text, "sluice_queue_sheds_total", reason="queue_full"))  # fmt: skip


@pytest.mark.parametrize("shared", [True, False], ids=["pod-queue", "per-worker-control"])
async def test_queue_bound_and_timeout_are_the_pods(tmp_path, shared):
    """--max-concurrent-streams 2 and --queue-size 3 over two workers: 2 streams on worker 0,
    then 3 requests queued (2 on worker 1, 1 on worker 0), then 4 more (2 on each) refused
    at once; each queued one is refused when its own 10 s pass, on either worker. With
    per-worker limits (the control) worker 1 streams its own 2 and every worker queues its
    own 3 again."""
    proc, url = start_pod(tmp_path, *SIM, "--max-concurrent-streams", "2", "--queue-size", "3",
                          "--queue-timeout-seconds", "10", "--heartbeat-seconds", "60",
                          shared=shared, timeout=START_S)  # fmt: skip
    held, waiting, extra = (
        await pinned(url, "00"),
        await pinned(url, "110"),
        await pinned(url, "0011"),
    )
    every: list = []
    try:
        every += reads(held, 3000)
        await eventually(lambda: _equal(pod_counts(url), (2.0, 0.0, 0.0)), what="streaming")
        queued = reads(waiting, 3000)  # long: in the control, worker 1 streams them
        every += queued
        want = (2.0, 3.0, 0.0) if shared else (4.0, 1.0, 0.0)
        await eventually(lambda: _equal(pod_counts(url), want), what=f"queued: {want}")
        more = reads(extra, 3000)
        every += more
        want = (2.0, 3.0, 4.0) if shared else (4.0, 5.0, 0.0)
        await eventually(lambda: _equal(pod_counts(url), want), what=f"full: {want}")
        if not shared:
            return
        refused = await asyncio.gather(*(t for _, t in more))
        assert [(r["status"], r["error"]["code"]) for r in refused] == [(429, "queue_full")] * 4
        assert {r["worker"] for r in refused} == {"0", "1"}
        timed_out = await asyncio.gather(*(t for _, t in queued))
        assert [(r["status"], r["error"]["code"]) for r in timed_out] == [
            (429, "queue_timeout")] * 3  # fmt: skip
        assert {r["worker"] for r in timed_out} == {"0", "1"}
        for r in timed_out:
            line = access_entry(proc, r["rid"])
            # Never early; and long before the streams ahead end (60 s): its own timer.
            assert line["status"] == "429" and 10000 <= float(line["queue_ms"]) < 40000, line
    finally:
        await close(every)
        for c in held + waiting + extra:
            await c.aclose()
        proc.stop()


async def _equal(value, want) -> bool:
    return (await value) == want


async def test_a_client_leaving_the_queue_frees_its_place_on_the_other_worker(tmp_path):
    proc, url = start_pod(tmp_path, *SIM, "--max-concurrent-streams", "1", "--queue-size", "1",
                          "--queue-timeout-seconds", "120", "--heartbeat-seconds", "60",
                          timeout=START_S)  # fmt: skip
    try:
        hold = await pinned_reads(url, "0", tokens=3000)
        probe = url
        await eventually(lambda: _equal(pod_counts(probe), (1.0, 0.0, 0.0)), what="holding")
        leaver = await pinned_reads(url, "1", tokens=5)
        await eventually(lambda: _equal(pod_counts(probe), (1.0, 1.0, 0.0)), what="queued")
        await close(leaver)  # its connection closes while it waits on worker 1
        await eventually(lambda: _equal(pod_counts(probe), (1.0, 0.0, 0.0)), within=20,
                         what="its queue place freed (the timeout is 120 s)")  # fmt: skip
        again = await pinned_reads(url, "0", tokens=5)  # queued, not refused
        await eventually(lambda: _equal(pod_counts(probe), (1.0, 1.0, 0.0)), what="queued again")
        async with client(url) as c:
            text = await scrape(c)
        assert metric(text, "sluice_requests_total") == 1  # no engine request but the hold's
        await close(again + hold)
    finally:
        proc.stop()


async def test_sigterm_answers_the_queue_503_and_streams_finish(tmp_path):
    proc, url = start_pod(tmp_path, *SIM, "--max-concurrent-streams", "2", "--queue-size", "4",
                          "--queue-timeout-seconds", "120", "--heartbeat-seconds", "60",
                          "--drain-timeout-seconds", "60", timeout=START_S)  # fmt: skip
    try:
        running = await pinned_reads(url, "01", tokens=250)  # 5 s each
        probe = url
        await eventually(lambda: _equal(pod_counts(probe), (2.0, 0.0, 0.0)), what="streaming")
        queued = await pinned_reads(url, "001", tokens=5)
        await eventually(lambda: _equal(pod_counts(probe), (2.0, 3.0, 0.0)), what="queued")
        proc.proc.send_signal(signal.SIGTERM)
        refused = await asyncio.gather(*(t for _, t in queued))
        streamed = await asyncio.gather(*(t for _, t in running))
        assert [r["status"] for r in refused] == [503, 503, 503]
        assert {r["error"]["code"] for r in refused} == {"draining"}
        assert all(r["done"] and r["last"]["finish_reason"] == "length" for r in streamed)
        assert proc.proc.wait(timeout=60) == 0, proc.tail()
        # The server's own account: each queued request was answered before either stream
        # ended (both still had seconds to go when the signal came).
        first_end = min(float(access_entry(proc, r["rid"])["duration_ms"]) for r in streamed)
        for r in refused:
            line = access_entry(proc, r["rid"])
            assert line["status"] == "503" and float(line["duration_ms"]) < first_end, line
        await close(running + queued)
    finally:
        proc.stop()
