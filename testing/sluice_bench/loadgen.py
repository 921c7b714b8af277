"""The one load generator every HTTP system is measured with (runs in its own process).

A closed loop: `concurrency` workers each send the next request as soon as their previous
stream ends, over one aiohttp session (keep-alive). Per request it records the time to the
first non-empty token chunk, the gaps between later chunks (inter-token latency as vLLM's
benchmark defines it: per chunk), and the output token count the server reports.

Run as a worker: one JSON command per stdin line, one JSON result per stdout line
(`run.py` drives it). The bare-engine worker (`bare_engine.py`) reuses `closed_loop` and
`summarise` so both paths compute the numbers the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass(slots=True)
class Record:
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


OneRequest = Callable[[int], Awaitable[Record]]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def closed_loop(concurrency: int, num_requests: int, one: OneRequest, timeout_s: float):
    """Run `num_requests` requests with at most `concurrency` in flight."""
    next_index = 0
    records: list[Record] = []

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_requests:
            index = next_index
            next_index += 1
            try:
                rec = await one(index)
            except Exception as exc:  # a failed request is a data point, not a crash
                rec = Record(error=f"{type(exc).__name__}: {exc}")
            records.append(rec)

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    timed_out = num_requests - len(records)
    return records, start, end, timed_out


def summarise(records: list[Record], start: float, end: float, timed_out: int = 0) -> dict:
    ok = [r for r in records if r.error is None and r.ttft is not None]
    errors = [r.error for r in records if r.error is not None] + ["timeout"] * timed_out
    ttfts = [t * 1000 for r in ok if (t := r.ttft) is not None]
    itls = [
        (b - a) * 1000 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    tokens = sum(r.tokens for r in records)
    duration = end - start
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(e[:200] for e in errors))[:3],
        "duration_s": duration,
        "output_tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p50_ms": percentile(itls, 50),
        "itl_p99_ms": percentile(itls, 99),
    }


# -- protocol clients ----------------------------------------------------------------


def _sse_events(buffer: bytearray, chunk: bytes) -> list[bytes]:
    """Append `chunk`; return the data payloads of the complete events in the buffer."""
    buffer += chunk
    out: list[bytes] = []
    while True:
        cut = buffer.find(b"\n\n")
        if cut < 0:
            return out
        event = bytes(buffer[:cut])
        del buffer[: cut + 2]
        data = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


async def _post_sse(session, url: str, payload: dict, rec: Record):
    """POST and yield (arrival time, decoded event) for each SSE data event but [DONE];
    a non-200 answer is recorded as the request's error."""
    buffer = bytearray()
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content.iter_any():
            now = time.perf_counter()
            for data in _sse_events(buffer, raw):
                if data != b"[DONE]":
                    yield now, json.loads(data)


async def openai_chat(session, base: str, model: str, messages, max_tokens: int) -> Record:
    """POST /v1/chat/completions, stream=true; tokens from the final usage chunk."""
    payload = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    rec = Record(start=time.perf_counter())
    chunks = 0
    async for now, msg in _post_sse(session, f"{base}/v1/chat/completions", payload, rec):
        if "error" in msg:
            rec.error = str(msg["error"])[:200]
            continue
        choices = msg.get("choices")
        if choices:
            if choices[0].get("delta", {}).get("content"):
                chunks += 1
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                rec.chunk_times.append(now)
        elif msg.get("usage"):
            rec.tokens = msg["usage"]["completion_tokens"]
    if not rec.tokens:
        rec.tokens = chunks
    return rec


def _token_event(rec: Record, msg: dict, now: float) -> None:
    """Our token protocol (SSE and WebSocket share the message shapes)."""
    kind = msg.get("type") or msg.get("event")
    if kind == "error" or ("error" in msg and kind is None):
        rec.error = str(msg.get("error") or msg.get("message"))[:200]
        return
    text = msg.get("text", msg.get("token", ""))
    n = msg.get("num_tokens")
    if text:
        if rec.ttft is None:
            rec.ttft = now - rec.start
        rec.chunk_times.append(now)
    if n is not None and kind not in ("done", "end", "finish"):
        rec.tokens += n
    elif text and n is None:
        rec.tokens += 1
    usage = msg.get("usage")
    if usage and usage.get("completion_tokens"):
        rec.tokens = usage["completion_tokens"]


async def token_sse(session, base: str, model: str, messages, max_tokens: int) -> Record:
    """POST /v1/stream: our token SSE route."""
    payload = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    rec = Record(start=time.perf_counter())
    async for now, msg in _post_sse(session, f"{base}/v1/stream", payload, rec):
        _token_event(rec, msg, now)
    return rec


async def websocket(session, base: str, model: str, messages, max_tokens: int) -> Record:
    """One WebSocket connection per request on /ws/stream (one generation per socket, so
    the handshake is in the TTFT like the HTTP routes' request)."""
    payload = {
        "id": "1",
        "model": model,
        "messages": messages,
        "params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
    }
    rec = Record(start=time.perf_counter())
    url = base.replace("http://", "ws://") + "/ws/stream"
    async with session.ws_connect(url, autoping=True, max_msg_size=0) as ws:
        await ws.send_str(json.dumps(payload))
        async for msg in ws:
            now = time.perf_counter()
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            _token_event(rec, data, now)
            if (data.get("type") or data.get("event")) in ("done", "end", "finish", "error"):
                break
            if data.get("finished") or data.get("finish_reason"):
                break
    return rec


CLIENTS = {"openai": openai_chat, "sse": token_sse, "websocket": websocket}


async def run_point(cmd: dict) -> dict:
    client = CLIENTS[cmd["protocol"]]
    prompts = cmd["prompts"]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cmd.get("request_timeout_s", 120))
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(i: int) -> Record:
            messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
            return await client(session, cmd["base_url"], cmd["model"], messages, cmd["max_tokens"])

        records, start, end, timed_out = await closed_loop(
            cmd["concurrency"], cmd["num_requests"], one, cmd.get("point_timeout_s", 300)
        )
    return summarise(records, start, end, timed_out)


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    del soft


def claim_stdout():
    """Keep the real stdout for results; send everything else printed (vLLM logs) to stderr."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


_PROTO = None


def serve_stdin(handler: Callable[[dict], Awaitable[dict]]) -> None:
    """Worker loop: JSON command lines in, JSON result lines out, until EOF."""
    global _PROTO
    raise_fd_limit()
    out = _PROTO = _PROTO or claim_stdout()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            try:
                result = await handler(json.loads(line))
            except Exception:
                result = {"fatal": traceback.format_exc()[-2000:]}
            out.write(json.dumps(result) + "\n")
            out.flush()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    serve_stdin(run_point)
