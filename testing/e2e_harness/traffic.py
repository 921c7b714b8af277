"""Streams in flight through the ingress, judged by how each one ended.

`Traffic(url, log_dir, long=20, ...)` runs a client in a process of its own (pinned with
`cpus` where arrival times matter), so its reads do not wait on the test's threads: it opens
`long` token streams of `long_tokens` tokens at once, then sends a short stream every
`1/rate` seconds until `stop_arrivals()`; `finish()` waits for every stream to end and
returns one `Outcome` per request.

A request counts as served only when its stream ended the way the protocol says a complete
stream ends: status 200, a final event with a `finish_reason` whose usage counts every
token asked for, then `data: [DONE]` (token events are not counted: the server coalesces
them when a reader lags, so their number depends on read speed). Anything else (an error event, a connection cut, a 5xx from the ingress, a
timeout) is a failure, with what the client saw. `served_by_pods()` cross-checks with the
servers' own access logs: the request id the response carried must have an access-log line
with `outcome=finished`, so the verdict does not rest on the client alone.

Run as a module (`python -m e2e_harness.traffic URL ...`) it is the client process: JSON
lines on stdout, `stop` on stdin ends the arrivals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testkit.process import ManagedProcess


@dataclass(frozen=True)
class Outcome:
    kind: str  # long | short
    start: float
    end: float
    status: int | None
    request_id: str | None
    tokens: int
    finish_reason: str | None
    done: bool
    error: str = ""

    @property
    def served(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.done and (
            not self.error)  # fmt: skip


class Traffic:
    def __init__(self, url: str, log_dir: Path, *, long: int = 20, long_tokens: int = 300,
                 rate: float = 4.0, short_tokens: int = 5, timeout: float = 180.0,
                 cpus: set[int] | None = None, name: str = "traffic") -> None:  # fmt: skip
        argv = [sys.executable, "-m", "e2e_harness.traffic", url, "--long", str(long),
                "--long-tokens", str(long_tokens), "--rate", str(rate), "--short-tokens",
                str(short_tokens), "--timeout", str(timeout)]  # fmt: skip
        self.process = ManagedProcess(name, argv, log_dir, cpus=cpus, pipes=True)
        self.outcomes: list[Outcome] = []
        self.long = long

    def start(self) -> Traffic:
        self.process.start()
        return self

    def wait_long_started(self, timeout: float = 60.0) -> None:
        """Block until every long stream has its first token (the client says so)."""
        line = self._read_line(timeout)
        if line.get("event") != "long-started":
            raise AssertionError(f"traffic client: {line}\n{self.process.tail()}")

    def stop_arrivals(self) -> None:
        stdin, _ = self.process.pipe_ends()
        stdin.write(b"stop\n")
        stdin.flush()

    def finish(self, timeout: float = 240.0) -> list[Outcome]:
        """Stop arrivals (if not yet), wait for every stream, return the outcomes."""
        try:
            self.stop_arrivals()
        except (BrokenPipeError, OSError):
            pass
        deadline = time.monotonic() + timeout
        while True:
            line = self._read_line(max(0.1, deadline - time.monotonic()))
            if line.get("event") == "done":
                break
            if "kind" in line:
                self.outcomes.append(Outcome(**line))
        self.process.stop()
        return self.outcomes

    def _read_line(self, timeout: float) -> dict:
        import select

        _, out = self.process.pipe_ends()
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            raise TimeoutError(f"traffic client silent for {timeout:.0f}s\n{self.process.tail()}")
        raw = out.readline()
        if not raw:
            raise AssertionError(f"traffic client exited\n{self.process.tail()}")
        return json.loads(raw)


_ACCESS = re.compile(r"request_id=(\S+) .*?outcome=(\S+)")


def server_outcomes(log_dir: Path) -> dict[str, str]:
    """request id -> access-log outcome, from every pod log in the node agent's log folder."""
    out: dict[str, str] = {}
    for log in Path(log_dir).glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if " access request_id=" in line and (m := _ACCESS.search(line)):
                out[m.group(1)] = m.group(2)
    return out


def verdict(outcomes: list[Outcome], servers: dict[str, str]) -> dict:
    """Counts a test asserts on, plus the first few failures to print."""
    failed = [o for o in outcomes if not o.served]
    unconfirmed = [
        o
        for o in outcomes
        if o.served and (o.request_id is None or servers.get(o.request_id) != "finished")
    ]
    return {
        "long": sum(o.kind == "long" for o in outcomes),
        "short": sum(o.kind == "short" for o in outcomes),
        "long_cut": sum(o.kind == "long" for o in failed),
        "short_failed": sum(o.kind == "short" for o in failed),
        "not_finished_in_server_log": len(unconfirmed),
        "failures": [o.__dict__ for o in (failed + unconfirmed)[:5]],
    }


# --- the client process -----------------------------------------------------------------
async def _one(http, url: str, kind: str, tokens: int, started: asyncio.Event | None) -> dict:
    t0 = time.time()
    status = rid = reason = None
    n, done, error = 0, False, ""
    body = {"messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": tokens}  # fmt: skip
    try:
        async with http.stream("POST", f"{url}/v1/stream", json=body) as r:
            status, rid = r.status_code, r.headers.get("x-request-id")
            if status != 200:
                error = (await r.aread()).decode(errors="replace")[:200]
            else:
                event = "message"
                async for line in r.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                        elif event == "error":
                            error = data[:200]
                        else:
                            ev = json.loads(data)
                            if ev.get("finished"):
                                reason = ev.get("finish_reason")
                                # Token events coalesce when the reader lags: count
                                # what the stream says it generated, not events.
                                n = (ev.get("usage") or {}).get("completion_tokens", n)
                            else:
                                n += 1
                                if started is not None and n == 1:
                                    started.set()
                    elif not line:
                        event = "message"
    except Exception as e:  # a cut connection, a timeout: the outcome, not a crash
        error = f"{type(e).__name__}: {e}"[:200]
    if started is not None:
        started.set()
    if reason is not None and n < tokens and not error:
        error = f"{n} of {tokens} tokens"
    return {"kind": kind, "start": t0, "end": time.time(), "status": status, "request_id": rid,
            "tokens": n, "finish_reason": reason, "done": done, "error": error}  # fmt: skip


async def _client(a: argparse.Namespace) -> None:
    import httpx

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:  # "stop", or the parent gone (EOF): no new arrivals
        sys.stdin.readline()
        stop.set()
        loop.remove_reader(sys.stdin.fileno())

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    timeout = httpx.Timeout(a.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        tasks: set[asyncio.Task] = set()

        async def run(kind: str, tokens: int, started: asyncio.Event | None = None) -> None:
            emit(await _one(http, a.url, kind, tokens, started))

        flags = [asyncio.Event() for _ in range(a.long)]
        for f in flags:
            t = asyncio.create_task(run("long", a.long_tokens, f))
            tasks.add(t)
        await asyncio.gather(*(f.wait() for f in flags))
        emit({"event": "long-started"})
        while not stop.is_set() and a.rate > 0:
            tasks.add(asyncio.create_task(run("short", a.short_tokens)))
            try:
                await asyncio.wait_for(stop.wait(), 1 / a.rate)
            except TimeoutError:
                pass
        await asyncio.gather(*tasks)
    emit({"event": "done"})


def main() -> None:
    p = argparse.ArgumentParser(description="token streams in flight (e2e traffic client)")
    p.add_argument("url")
    p.add_argument("--long", type=int, default=20)
    p.add_argument("--long-tokens", type=int, default=300)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--short-tokens", type=int, default=5)
    p.add_argument("--timeout", type=float, default=180.0)
    asyncio.run(_client(p.parse_args()))


if __name__ == "__main__":
    main()
