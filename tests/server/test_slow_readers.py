"""Slow readers are judged by progress: a reader that keeps taking bytes, however slowly, is
never cut off and gets fewer, larger events; a reader that stops is cut off after the send
timeout; what a slow stream holds stays bounded. SSE and WebSocket alike.

The server is a real process (`python -m sluice_server`, uvicorn on uvloop, the simulator
engine making 3,000 tokens at 500 tokens/s, the default 10 s send timeout); the readers are
raw sockets with a small receive buffer (SO_RCVBUF, per socket) reading at a fixed pace.
Each runs once with the kernel sizing the server's send buffers (on loopback they grow to
megabytes) and once with the server's listening socket at a 64 KiB send buffer, like a
network path whose buffer stays small (per socket too; nothing machine-wide). Verdicts
come from the server's account: its access log (outcome, tokens, duration) and its RSS.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest
from slow_client import (
    Pace,
    SimServer,
    open_ws,
    post_stream,
    read,
    send_queues,
    sse_done,
    ws_done,
)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

TOKENS = 3000
TIMEOUT = 10.0  # the default --send-timeout-seconds
SSE_RATES = (65536, 16384, 4096, 2048, 1024)  # bytes/s
WS_RATES = (4096, 1024)
# 500 tokens/s; WebSocket pings (which these raw readers do not answer) past the tests' end.
PACED = ("--sim-ttft-ms", "10", "--sim-itl-ms", "2", "--heartbeat-seconds", "120")
BODY = {"prompt": "hi", "max_tokens": TOKENS, "ignore_eos": True}
SNDBUF = {"kernel-sized": None, "sndbuf-64k": 65536}


def generation(rid: str, tokens: int = TOKENS) -> dict:
    return {"id": rid, "prompt": "hi", "params": {"max_tokens": tokens, "ignore_eos": True}}


@pytest.mark.parametrize("sndbuf", list(SNDBUF.values()), ids=list(SNDBUF))
async def test_steady_slow_readers_are_never_cut_and_get_fewer_larger_events(tmp_path, sndbuf):
    with SimServer(tmp_path, *PACED, sndbuf=sndbuf) as server:
        sse = [asyncio.create_task(read(await post_stream(server.port, BODY), Pace(rate),
                                        sse_done)) for rate in SSE_RATES]  # fmt: skip
        ws = [asyncio.create_task(read(await open_ws(server.port, [generation(f"ws{rate}")]),
                                       Pace(rate), ws_done(1))) for rate in WS_RATES]  # fmt: skip
        got_sse, got_ws = await asyncio.gather(asyncio.gather(*sse), asyncio.gather(*ws))
        lines = await server.wait_access(len(SSE_RATES) + len(WS_RATES))
        problems = server.problems()
    per_token = {}
    for rate, got in zip(SSE_RATES, got_sse, strict=True):
        events = got.sse_events()
        tokens = [e for e in events if e.get("finished") is False]
        final = events[-1] if events else {}
        assert final.get("finish_reason") == "length", (rate, got.error, events[-2:])
        per_token[f"sse {rate // 1024} KB/s"] = len(tokens) / TOKENS
    for rate, got in zip(WS_RATES, got_ws, strict=True):
        frames = got.ws_frames()
        assert frames and frames[-1].get("finish_reason") == "length", (
            rate,
            got.error,
            frames[-2:],
        )
        per_token[f"ws {rate // 1024} KB/s"] = (len(frames) - 1) / TOKENS
    print("\nRESULT events per token (" + ("kernel-sized send buffers" if sndbuf is None else
          f"server SO_SNDBUF {sndbuf}") + "): " +
          ", ".join(f"{k}: {v:.3f}" for k, v in per_token.items()))  # fmt: skip
    # The server's account: every stream finished, none was cut off.
    assert sorted(x["outcome"] for x in lines) == ["finished"] * len(lines), lines
    assert all(x["completion_tokens"] == TOKENS for x in lines), lines
    # Coalescing: at 4 KB/s and below, a handful of tokens per event at least (one token
    # per event would need about 60 KB/s here).
    slow = {k: v for k, v in per_token.items() if int(k.split()[1]) <= 4}
    assert all(v < 0.25 for v in slow.values()), per_token
    assert per_token["sse 1 KB/s"] < per_token["sse 64 KB/s"], per_token
    assert problems == [], problems


async def test_a_reader_that_stops_is_cut_off_after_the_send_timeout(tmp_path):
    """SSE and WebSocket readers stop after their first 3 KB and keep the socket open; their
    streams (40 s of tokens, at 100 tokens/s so the stream buffer's cap stays far) would go
    on. The server resets each connection after the send timeout and records the outcome
    `stalled` (for each generation on the socket). Negative control: a reader at 1 KB/s
    beside them is not cut."""
    long = 4000
    with SimServer(tmp_path, *PACED, "--sim-itl-ms", "10") as server:
        stopped_sse = read(await post_stream(server.port, {**BODY, "max_tokens": long}),
                           Pace(1024, stop_after=3000), sse_done)  # fmt: skip
        ws = await open_ws(server.port, [generation("a", long), generation("b", long)])
        stopped_ws = read(ws, Pace(1024, stop_after=3000), ws_done(2))
        steady = read(await post_stream(server.port, {**BODY, "max_tokens": 600}), Pace(1024),
                      sse_done)  # fmt: skip
        got = await asyncio.gather(stopped_sse, stopped_ws, steady)
        lines = await server.wait_access(4)
        problems = server.problems()
    assert [g.error for g in got] == ["reset", "reset", None], [g.error for g in got]
    cut = [x for x in lines if x["completion_tokens"] < long and x["completion_tokens"] != 600]
    assert sorted((x["protocol"], x.get("stream")) for x in cut) == [
        ("sse", None), ("websocket", "a"), ("websocket", "b")], lines  # fmt: skip
    for line in cut:
        assert line["outcome"] == "stalled", line
        # Cut after the timeout, long before the stream's own end (40 s of tokens).
        assert TIMEOUT * 1000 <= line["duration_ms"] < 30_000, line
    finished = [x for x in lines if x not in cut]
    assert [(x["outcome"], x["completion_tokens"]) for x in finished] == [("finished", 600)]
    assert problems == [], problems


async def test_memory_per_slow_stream_stays_bounded(tmp_path):
    """32 readers at 1 KB/s while the engine makes 3,000 tokens each in 6 s: each stream's
    backlog waits in the server's buffer of engine outputs (bounded by
    --stream-buffer-tokens), with at most one event in the transport and a few KiB in the
    kernel in front of the reader (a bounded delay). Measured from the server's side: its
    RSS growth, and its sockets' kernel send queues (/proc/net/tcp)."""
    n = 32
    with SimServer(tmp_path, *PACED) as server:
        proc = psutil.Process(server.proc.pid)
        before = proc.memory_info().rss
        readers = [asyncio.create_task(read(await post_stream(server.port, BODY), Pace(1024),
                                            sse_done, limit_s=10)) for _ in range(n)]  # fmt: skip
        rss, kernel = before, []
        while not all(r.done() for r in readers):
            rss = max(rss, proc.memory_info().rss)
            queues = send_queues(server.port)
            kernel = max(kernel, queues, key=sum)
            await asyncio.sleep(0.2)
        got = [r.result() for r in readers]
        lines = await server.wait_access(n)
        problems = server.problems()
    per_stream = (rss - before) / n
    print(f"\nRESULT {n} readers at 1 KB/s, {TOKENS} tokens each: server RSS +"
          f"{(rss - before) / 2**20:.1f} MiB ({per_stream / 1024:.0f} KiB per stream); kernel "
          f"send queues at most {max(kernel, default=0) / 1024:.1f} KiB per stream, "
          f"{sum(kernel) / 2**20:.2f} MiB in all")  # fmt: skip
    assert all(g.error == "timeout" for g in got)  # still reading when the test stopped them
    # They left mid-stream; none was cut off as stalled.
    assert {x["outcome"] for x in lines} == {"disconnected"}, lines
    assert len(kernel) == n and max(kernel) < 32 * 1024, kernel
    assert per_stream < 1.5 * 2**20, per_stream
    assert problems == [], problems
