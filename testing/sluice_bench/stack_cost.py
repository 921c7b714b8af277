"""What one token event and one open stream cost in our server's streaming stack.

In-process and socket-free, so the numbers hold up on a busy shared machine (CPU time,
not wall time): the real app (`build_app`) on the simulator engine, driven through ASGI
with a send() that drops the bytes. Two measurements:

* `cpu`: N streams x T tokens paced by the simulator, over token SSE, WebSocket or the
  OpenAI chat route (`--protocol openai`: the simulator's built-in OpenAI renderer under
  our route wrapper); process CPU time per token and per
  event (an event can carry several coalesced tokens when the consumer falls behind).
  `--variant engine` iterates the simulator alone (the floor); `--variant no-timeout`
  replaces our SSE send (a direct send watched by one timer per response) with a plain
  `await send(...)`: what the send-timeout protection costs per event (the cost of a cancel
  scope per send, in transport/sendwatch.py, was measured the same way). `--variant
  tracing` turns OpenTelemetry on (every request sampled, spans exported over OTLP/HTTP to
  a receiver in another process, testing/testkit/otlp.py);
  `--variant access-log` writes the access log (to /dev/null): what each costs per token.
* `ab`: the `cpu` measurement for this checkout (B) and another one (A, `--against
  DIR`, e.g. a detached worktree of main) in alternating subprocesses, pinned to one core
  (`--cpu`), per protocol: every pair, the medians and B/A. The way every change to the
  per-event path is measured.
* `mem`: N streams held open; tracemalloc growth per stream, top allocation sites, and
  asyncio tasks per stream.

    python -m sluice_bench.stack_cost cpu --protocol sse --variant base
    python -m sluice_bench.stack_cost cpu --protocol sse --variant no-timeout
    python -m sluice_bench.stack_cost cpu --protocol sse --variant tracing
    python -m sluice_bench.stack_cost mem --protocol websocket
    git worktree add --detach /tmp/sluice-main main
    python -m sluice_bench.stack_cost ab --against /tmp/sluice-main --pairs 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from sluice_server.app import build_app
from sluice_server.engine.base import SamplingOptions, StreamRequest
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.settings import Settings


def patch_no_timeout() -> None:
    from sluice_server.transport.sendwatch import SendWatchdog

    async def direct(self, send, message):
        await send(message)

    # The variant measures the server without the send timeout: its one patch.
    SendWatchdog.send = direct  # type: ignore[method-assign]


def start_receiver() -> tuple[subprocess.Popen, str]:
    """An OTLP/HTTP receiver in its own process (its decoding is not our CPU time)."""
    testing = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{testing}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "testkit.otlp"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    assert proc.stdout is not None  # stdout=PIPE
    return proc, proc.stdout.readline().strip()


def access_log_to_devnull() -> None:
    from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER

    log = logging.getLogger(ACCESS_LOGGER)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(logging.StreamHandler(open(os.devnull, "w")))  # noqa: SIM115


class NullTransport:
    """A transport that never backs up (the send() below drops the bytes), so the send
    watchdog is armed as on a real connection (server/sluice_server/transport/sendwatch.py)."""

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


class Link:
    """`receive` as uvicorn passes it: a bound method of what keeps the transport."""

    transport = NullTransport()

    def __init__(self, receive) -> None:
        self._receive = receive

    async def receive(self):
        return await self._receive()


def drivers(app, max_tokens: int, ends: list[asyncio.Event], counter: list[int]):
    """One coroutine per protocol that runs a single stream through the ASGI app. Each
    stream's client "disconnects" when its `end` event is set: when the stream finished,
    or when the caller sets every event in `ends` (no helper tasks, so task counts are
    the server's own)."""
    msgs = [{"role": "user", "content": "hi"}]
    body = json.dumps({"messages": msgs, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    server = ("127.0.0.1", 8000)

    async def sse(path: str = "/v1/stream", payload: bytes = body) -> None:
        sent = False
        done = asyncio.Event()
        ends.append(done)

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body":
                counter[0] += 1
                if not msg.get("more_body", False):
                    done.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": server, "state": {}}  # fmt: skip
        await app(scope, Link(receive).receive, send)

    async def websocket() -> None:
        frame = {
            "id": "1",
            "messages": msgs,
            "params": {"max_tokens": max_tokens, "ignore_eos": True},
        }
        inbox = [
            {"type": "websocket.connect"},
            {"type": "websocket.receive", "text": json.dumps(frame)},
        ]
        finished = asyncio.Event()
        ends.append(finished)

        async def receive():
            if inbox:
                return inbox.pop(0)
            await finished.wait()
            return {"type": "websocket.disconnect", "code": 1000}

        async def send(msg):
            if msg["type"] == "websocket.send":
                counter[0] += 1
                if '"finished": true' in (msg.get("text") or ""):
                    finished.set()

        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "scheme": "ws", "path": "/ws/stream", "raw_path": b"/ws/stream",
                 "query_string": b"", "root_path": "", "headers": [], "subprotocols": [],
                 "client": ("127.0.0.1", 1), "server": server, "state": {},
                 "extensions": {"websocket.http.response": {}}}  # fmt: skip
        await app(scope, Link(receive).receive, send)

    chat = json.dumps({"messages": msgs, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip

    async def openai() -> None:  # the simulator's built-in OpenAI renderer under our wrapper
        await sse("/v1/chat/completions", chat)

    return {"sse": sse, "websocket": websocket, "openai": openai}


async def cpu(args) -> None:
    engine = SimulatorEngine("sim", ttft_ms=5, itl_ms=args.itl_ms)
    extra = {"otlp_traces_endpoint": args.endpoint} if args.variant == "tracing" else {}
    settings = Settings(model="sim", engine="simulator", max_concurrent_streams=10**6, **extra)
    app = build_app(settings, engine)
    counter = [0]
    one = drivers(app, args.tokens, [], counter)[args.protocol]

    async def engine_only(i: int) -> None:
        opts = SamplingOptions(max_tokens=args.tokens, ignore_eos=True)
        async for _ in engine.generate(
            StreamRequest(request_id=f"e{i}", prompt="hi", options=opts)
        ):
            counter[0] += 1

    async with app.router.lifespan_context(app):
        for rnd in range(2):  # round 0 warms up
            counter[0] = 0
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            if args.variant == "engine":
                await asyncio.gather(
                    *(engine_only(rnd * args.streams + i) for i in range(args.streams))
                )
            else:
                await asyncio.gather(*(one() for _ in range(args.streams)))
            c1, t1 = time.process_time(), time.perf_counter()
    tokens = args.streams * args.tokens
    print(f"{args.protocol} {args.variant}: {args.streams} streams x {args.tokens} tokens at "
          f"{1000 / args.itl_ms:g} tok/s each: {(c1 - c0) / tokens * 1e6:.1f} us CPU/token, "
          f"{(c1 - c0) / max(counter[0], 1) * 1e6:.1f} us CPU/event ({counter[0]} events), "
          f"wall {t1 - t0:.2f} s")  # fmt: skip


async def mem(args) -> None:
    engine = SimulatorEngine("sim", ttft_ms=5, itl_ms=args.itl_ms)
    app = build_app(Settings(model="sim", engine="simulator", max_concurrent_streams=10**6), engine)
    ends: list[asyncio.Event] = []
    one = drivers(app, 10**6, ends, [0])[args.protocol]
    async with app.router.lifespan_context(app):
        warm = [asyncio.create_task(one()) for _ in range(10)]
        await asyncio.sleep(0.5)
        base_tasks = len(asyncio.all_tasks())
        gc.collect()
        tracemalloc.start(1)
        before = tracemalloc.take_snapshot()
        tasks = [asyncio.create_task(one()) for _ in range(args.streams)]
        await asyncio.sleep(1.5)
        gc.collect()
        after = tracemalloc.take_snapshot()
        per_stream_tasks = (len(asyncio.all_tasks()) - base_tasks) / args.streams
        stats = after.compare_to(before, "lineno")
        total = sum(s.size_diff for s in stats)
        print(f"{args.protocol}: {total / args.streams / 1024:.1f} KB traced Python heap per open "
              f"stream, {per_stream_tasks:.1f} asyncio tasks per stream ({args.streams} streams)")  # fmt: skip
        for s in stats[: args.top]:
            frame = s.traceback[0]
            where = frame.filename.split("site-packages/")[-1].split("/lib/python3.11/")[-1]
            print(f"  {s.size_diff / args.streams:7.0f} B/stream  {where}:{frame.lineno}")
        for end in ends:
            end.set()
        await asyncio.gather(*tasks, *warm, return_exceptions=True)


def run_one(checkout: Path, protocol: str, args) -> float:
    """One `cpu` run of `checkout`'s server code in a fresh process: us CPU per token."""
    env = {**os.environ, "PYTHONPATH": f"{checkout / 'operator'}{os.pathsep}{checkout / 'server'}"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "cpu", "--protocol", protocol,
           "--variant", args.variant, "--streams", str(args.streams), "--tokens",
           str(args.tokens), "--itl-ms", str(args.itl_ms)]  # fmt: skip
    if args.cpu is not None:
        cmd = ["taskset", "-c", str(args.cpu), *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    found = re.search(r"([\d.]+) us CPU/token", out)
    if found is None:
        raise RuntimeError(f"no 'us CPU/token' line in the cpu run's output:\n{out}")
    return float(found.group(1))


def ab(args) -> None:
    here = Path(__file__).resolve().parents[2]
    other = Path(args.against).resolve()
    print(f"A = {other}, B = {here}; {args.streams} streams x {args.tokens} tokens, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for protocol in args.protocols.split(","):
        a: list[float] = []
        b: list[float] = []
        for i in range(args.pairs):  # alternate, starting with the other side every pair
            order = [(other, a), (here, b)] if i % 2 == 0 else [(here, b), (other, a)]
            for checkout, into in order:
                into.append(run_one(checkout, protocol, args))
        ma, mb = statistics.median(a), statistics.median(b)
        pairs = ", ".join(f"{x:.1f}/{y:.1f}" for x, y in zip(a, b, strict=True))
        print(f"{protocol}: us CPU per token A/B pairs {pairs}; median A {ma:.1f}, "
              f"B {mb:.1f}, B/A {mb / ma:.2f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["cpu", "mem", "ab"])
    p.add_argument("--protocol", choices=["sse", "websocket", "openai"], default="sse")
    p.add_argument("--variant", choices=["base", "no-timeout", "engine", "tracing", "access-log"],
                   default="base")  # fmt: skip
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--against", help="ab: the other checkout (A)")
    p.add_argument("--pairs", type=int, default=3, help="ab: alternating A/B pairs")
    p.add_argument("--protocols", default="sse,websocket,openai", help="ab: comma-separated")
    p.add_argument("--cpu", type=int, help="ab: pin every run to this core (taskset)")
    args = p.parse_args()
    if args.what == "ab":
        if not args.against:
            p.error("ab needs --against DIR (the checkout to compare with)")
        ab(args)
        return
    if args.variant == "no-timeout":
        patch_no_timeout()
    receiver = None
    if args.variant == "tracing":
        receiver, args.endpoint = start_receiver()
    if args.variant == "access-log":
        access_log_to_devnull()
    if args.what == "mem" and args.streams == 100:
        args.streams = 500
    coro = cpu(args) if args.what == "cpu" else mem(args)
    try:
        try:  # uvicorn runs on uvloop when it is installed (uvicorn[standard])
            import uvloop

            uvloop.run(coro)
        except ImportError:
            asyncio.run(coro)
    finally:
        if receiver is not None:
            assert receiver.stdin is not None  # stdin=PIPE
            receiver.stdin.close()
            receiver.wait(30)


if __name__ == "__main__":
    main()
