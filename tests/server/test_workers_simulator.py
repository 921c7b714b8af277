"""A pod with two front-end workers (`--api-workers 2`) on the simulator engine, as a real
process tree: streams land on both workers, one scrape of `/metrics` is the pod's totals,
the concurrency cap and the requests-per-minute limit are the pod's (negative control:
per-worker limits admit twice as much), SIGTERM drains every worker and exits 0, and a
worker that dies takes the pod to not-ready and then down with a non-zero exit."""

from __future__ import annotations

import asyncio
import time

import pytest
from pod_helpers import (
    client,
    drain_while_streaming,
    kill_a_worker_while_streaming,
    metric,
    read_stream,
    scrape,
    start_pod,
)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

SIM = ("--engine", "simulator", "--model", "sim")


async def test_streams_land_on_both_workers_and_metrics_sum(tmp_path):
    proc, url = start_pod(tmp_path, *SIM, "--sim-ttft-ms", "20", "--sim-itl-ms", "10")
    try:
        async with client(url) as c:
            results = []
            for _ in range(3):  # waves of concurrent connections
                results += await asyncio.gather(*(read_stream(c, 20) for _ in range(16)))
            assert all(r["status"] == 200 and r["done"] for r in results)
            by_worker = {w: sum(r["worker"] == w for r in results) for w in ("0", "1")}
            assert by_worker["0"] > 0 and by_worker["1"] > 0, by_worker
            n = len(results)
            usage = sum(r["last"]["usage"]["completion_tokens"] for r in results)
            # Several scrapes: whichever worker answers, the totals are the pod's.
            for _ in range(6):
                text = await scrape(c)
                assert metric(text, "sluice_requests_total", protocol="sse") == n
                assert metric(text, "sluice_ttft_seconds_count", protocol="sse") == n
                assert metric(text, "sluice_e2e_latency_seconds_count", protocol="sse") == n
                assert metric(text, "sluice_output_tokens_total", protocol="sse") == usage == n * 20
                assert metric(text, "sluice_active_streams", protocol="sse") == 0
                buckets = metric(text, "sluice_ttft_seconds_bucket", protocol="sse", le="+Inf")
                assert buckets == n
    finally:
        proc.stop()


@pytest.mark.parametrize("shared", [True, False], ids=["pod-limits", "per-worker-control"])
async def test_concurrency_cap_and_rpm_are_the_pods(tmp_path, shared):
    """--max-concurrent-streams 4 and --rate-limit-rpm 6 with two workers admit 4 streams and
    6 requests per pod; with per-worker limits (the control) twice as many."""
    keys = tmp_path / "keys"
    keys.write_text("sk-rpm tenant=a rpm=6\nsk-cap tenant=b rpm=0\n")
    proc, url = start_pod(tmp_path, *SIM, "--sim-ttft-ms", "5", "--sim-itl-ms", "20",
                          "--max-concurrent-streams", "4", "--api-key-file", str(keys),
                          shared=shared)  # fmt: skip
    factor = 1 if shared else 2
    try:
        async with client(url) as c:
            # Requests per minute: bursts of short requests until both workers refused one.
            t0, admitted, refused_by = time.monotonic(), 0, set()
            for _ in range(30):
                burst = await asyncio.gather(*(read_stream(c, 1, "sk-rpm") for _ in range(4)))
                for r in burst:
                    if r["status"] == 200:
                        admitted += 1
                    else:
                        assert (r["status"], r["error"]["code"]) == (429, "rate_limit_exceeded")
                        refused_by.add(r["worker"])
                if refused_by == {"0", "1"}:
                    break
            assert refused_by == {"0", "1"}, "both workers should have refused"
            # 6 rpm refills one request per 10 s (each bucket): none on a machine quick
            # enough to send the bursts within 10 s, one more for every 10 s they took.
            refills = int((time.monotonic() - t0) / 10)
            assert 6 * factor <= admitted <= (6 + refills) * factor, (admitted, refills)

            # Concurrent streams: long streams in bursts until both workers refused one.
            held, refused_by = [], set()
            loop = asyncio.get_running_loop()
            for _ in range(20):
                started = [loop.create_future() for _ in range(4)]
                burst = [asyncio.create_task(read_stream(c, 2000, "sk-cap", streaming=f))
                         for f in started]  # fmt: skip
                # Each read streams (its first token: the worker) or was refused (None).
                for t, worker in zip(burst, await asyncio.gather(*started), strict=True):
                    if worker is None:
                        r = await t
                        assert (r["status"], r["error"]["code"]) == (429, "capacity_exceeded")
                        refused_by.add(r["worker"])
                    else:
                        held.append(t)
                if refused_by == {"0", "1"}:
                    break
            assert refused_by == {"0", "1"}, "both workers should have refused"
            assert len(held) == 4 * factor
            text = await scrape(c)
            assert metric(text, "sluice_active_streams", protocol="sse") == 4 * factor
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    finally:
        proc.stop()


async def test_sigterm_drains_every_worker_and_exits_zero(tmp_path):
    proc, url = start_pod(tmp_path, *SIM, "--sim-ttft-ms", "5", "--sim-itl-ms", "10",
                          "--drain-timeout-seconds", "30")  # fmt: skip
    try:  # 3 s streams, the two pinned ones 15 s
        await drain_while_streaming(proc, url, streams=12, tokens=300, hold_tokens=1500, exit_s=45)
    finally:
        proc.stop()


async def test_a_dead_worker_makes_the_pod_not_ready_then_exit(tmp_path):
    proc, url = start_pod(tmp_path, *SIM, "--sim-ttft-ms", "5", "--sim-itl-ms", "10",
                          "--drain-timeout-seconds", "30")  # fmt: skip
    try:
        results = await kill_a_worker_while_streaming(
            proc,
            url,
            streams=12,
            tokens=300,
            ready_within_s=5,
            hold_tokens=3000,
        )
        # The survivor's streams finished (it drained); the killed worker's were cut.
        finished = [r for r in results if isinstance(r, dict) and r["done"]]
        assert len(finished) < len(results)
        assert proc.proc.wait(timeout=45) != 0, proc.tail()
        assert "died with exit code -9" in proc.tail(60)
    finally:
        proc.stop()
