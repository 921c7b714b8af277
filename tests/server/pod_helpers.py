"""A pod with several front-end workers (`--api-workers N`) as a real process tree for the
tests: the supervisor started with testkit's `ManagedProcess`, its worker pids, and the
pod's `/metrics` as numbers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.wait import eventually, eventually_async

# The supervisor with per-worker limits: the negative control of the shared-limit tests.
PER_WORKER_LIMITS = (
    "import sys; from sluice_server.settings import parse_settings; "
    "from sluice_server.supervisor import run_pod; "
    "sys.exit(run_pod(parse_settings(sys.argv[1:]), share_limits=False))"
)


def start_pod(log_dir: Path, *flags: str, workers: int = 2, shared: bool = True,
              env: dict | None = None, timeout: float = 60) -> tuple[ManagedProcess, str]:  # fmt: skip
    """Start the supervisor (`python -m sluice_server`) on a free port and wait for /ready.

    The pod runs at a lower CPU priority than the test (nice 10, its whole session: the
    kernel's autogroup shares CPU time between sessions first). The test is its client, and
    what the client sees must not be an artefact of the pod's engine keeping both cores
    busy. At equal priority a 50 ms sleep loop beside a streaming engine pod woke up to
    15.7 s late, with no CPU steal; niced, never more than 0.55 s late."""
    port = free_port()
    head = ["-m", "sluice_server"] if shared else ["-c", PER_WORKER_LIMITS]
    argv = [sys.executable, *head, "--host", "127.0.0.1", "--port", str(port),
            "--api-workers", str(workers), *flags]  # fmt: skip
    name = f"pod-{port}"
    proc = ManagedProcess(name, argv, log_dir, env=env, nice=10).start()
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/ready", timeout=timeout, process=proc)
    return proc, url


def worker_pids(proc: ManagedProcess) -> list[int]:
    """The supervisor's worker processes: its children started by multiprocessing's spawn
    (not its resource tracker, nor vLLM's engine core, which renames itself)."""
    return [c.pid for c in psutil.Process(proc.pid).children()
            if "spawn_main" in " ".join(c.cmdline())]  # fmt: skip


_SAMPLE = re.compile(r"^([\w:]+)\{([^}]*)\} (\S+)$")  # vLLM's names have colons


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def startup_phases(text: str) -> dict[str, float]:
    """`sluice_startup_phase_seconds` by phase, in start-up order (`startup.PHASES`)."""
    from sluice_server.startup import PHASES

    return {p: metric(text, "sluice_startup_phase_seconds", phase=p)
            for p in PHASES if f'phase="{p}"' in text}  # fmt: skip


async def scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return r.text


def client(url: str) -> httpx.AsyncClient:
    """A new connection per request: a kept-alive one would stay with its worker."""
    return httpx.AsyncClient(base_url=url, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))  # fmt: skip


async def pin(url: str, worker: str) -> httpx.AsyncClient:
    """A client whose one kept-alive connection is served by `worker`. A cheap GET /ready
    finds the worker of each new connection, and a connection to another worker is closed
    and tried again: no stream is ever opened on the wrong worker (one left to run while
    a starved test process gets round to closing it skews the engine's counters)."""
    for _ in range(50):
        c = httpx.AsyncClient(base_url=url, timeout=60,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))  # fmt: skip
        if (await c.get("/ready")).headers.get("x-sluice-worker") == worker:
            return c
        await c.aclose()
    raise AssertionError(f"no connection reached worker {worker}")


@contextlib.asynccontextmanager
async def pinned(url: str, worker: str):
    """`pin` as a context: the client is closed on the way out."""
    c = await pin(url, worker)
    try:
        yield c
    finally:
        await c.aclose()


async def read_stream(c: httpx.AsyncClient, max_tokens: int, key: str | None = None, *,
                      streaming: asyncio.Future | None = None) -> dict:  # fmt: skip
    """One /v1/stream read to its end: status, worker, request id, token events, last
    payload. `streaming` is resolved at the first token (or the refusal)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "fan out", "max_tokens": max_tokens, "ignore_eos": True}
    out = {"tokens": 0, "last": None, "done": False}
    try:
        async with c.stream("POST", "/v1/stream", json=body, headers=headers) as r:
            out["status"], out["worker"] = r.status_code, r.headers.get("x-sluice-worker")
            out["rid"] = r.headers.get("x-request-id")
            if r.status_code != 200:
                out["error"] = json.loads(await r.aread())["error"]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                else:
                    out["last"] = json.loads(data)
                    out["tokens"] += 1
                    if streaming is not None and not streaming.done():
                        streaming.set_result(out["worker"])
            return out
    finally:
        if streaming is not None and not streaming.done():
            streaming.set_result(None)


def access_entry(proc: ManagedProcess, rid: str, within_s: float = 30) -> dict[str, str]:
    """The fields of the pod's access-log line for request `rid`, written when the
    request ends: the server's own account of it, whatever the test process saw."""

    def entry() -> dict[str, str] | None:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if f" access request_id={rid} " in line:
                return dict(re.findall(r"(\w+)=(\S+)", line))
        return None

    return eventually(
        entry, timeout=within_s, interval=0.2, message=f"an access-log line for {rid}"
    )


def drains_logged(proc: ManagedProcess) -> list[int]:
    """The stream count of each worker's "draining (up to ...s for N streams)" line."""
    log = proc.log_path.read_text(errors="replace")
    return [int(n) for n in re.findall(r"draining \(up to \S+ for (\d+) streams\)", log)]


async def _ready_turns_503(
    c: httpx.AsyncClient, within_s: float, worker_killed: bool = False
) -> None:
    """Poll /ready until 503. With `worker_killed`, a connection that reaches the killed
    worker's socket is retried; otherwise any transport error fails the test."""
    since = time.monotonic()
    tries: list[str] = []  # what each poll got, for the failure message

    async def unready() -> bool:
        t0 = time.monotonic()
        try:
            # A poll of its own, bounded: one answer that comes late (seen: 12.7 s, "ready"
            # from before the supervisor noticed the death) must not eat the whole drain.
            r = await c.get("/ready", timeout=2.0)
            if r.status_code == 503:
                return True
            got = f"{r.status_code} {r.text[:80]}"
        except httpx.TransportError as e:
            if not worker_killed:
                raise
            got = repr(e)[:80]
        tries.append(f"{t0 - since:.2f}s +{time.monotonic() - t0:.2f}s: {got}")
        return False

    await eventually_async(unready, timeout=within_s, interval=0.02, retry_on=(),
                           message=lambda: f"/ready to turn 503: {tries[:6]} ... {tries[-2:]}")  # fmt: skip


async def streaming_on_both(c: httpx.AsyncClient, streams: int, tokens: int,
                            pinned_tokens: int | None = None) -> list:  # fmt: skip
    """`streams` read tasks (`read_stream`) of `tokens` each, once every one of them got its
    first token. The first two run on connections pinned to worker 0 and 1 (of
    `pinned_tokens`, when given), both pinned before any read starts."""

    async def on_own(own: httpx.AsyncClient, started: asyncio.Future) -> dict:
        try:
            return await read_stream(own, pinned_tokens or tokens, streaming=started)
        finally:
            await own.aclose()

    pins = [await pin(str(c.base_url), w) for w in "01"]
    loop = asyncio.get_running_loop()
    started = [loop.create_future() for _ in range(streams)]
    reads = [asyncio.create_task(on_own(own, f)) for own, f in zip(pins, started, strict=False)]
    reads += [asyncio.create_task(read_stream(c, tokens, streaming=f)) for f in started[2:]]
    assert all(await asyncio.gather(*started)), "a read was refused before it streamed"
    return reads


async def drain_while_streaming(proc: ManagedProcess, url: str, *, streams: int, tokens: int,
                                hold_tokens: int, exit_s: float) -> None:  # fmt: skip
    """SIGTERM the supervisor (only it, as the kubelet does) while `streams` reads run: /ready
    turns 503 at once, a new stream is refused as draining, every read on both workers
    finishes whole, and the pod exits 0.

    The reads pinned to each worker are of `hold_tokens`: still running when the signal
    comes (once every read has its first token), and short enough to finish within the
    drain. Each worker's log says how many streams its drain waited for: at least one each."""
    async with client(url) as c:
        reads = await streaming_on_both(c, streams, tokens, pinned_tokens=hold_tokens)
        proc.proc.send_signal(signal.SIGTERM)
        await _ready_turns_503(c, within_s=5)
        late = await c.post("/v1/stream", json={"prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        results = await asyncio.gather(*reads)
    assert {r["worker"] for r in results} == {"0", "1"}
    for i, r in enumerate(results):
        assert r["done"] and r["last"]["finish_reason"] == "length", r
        assert r["last"]["usage"]["completion_tokens"] == (hold_tokens if i < 2 else tokens)
    assert proc.proc.wait(timeout=exit_s) == 0, proc.tail()
    drained = drains_logged(proc)
    assert len(drained) == 2 and min(drained) >= 1, drained


async def kill_a_worker_while_streaming(proc: ManagedProcess, url: str, *, streams: int,
                                        tokens: int, ready_within_s: float,
                                        hold_tokens: int) -> list:  # fmt: skip
    """SIGKILL one worker while `streams` reads run on both (at least one on each): /ready
    turns 503 within `ready_within_s`, the survivor's reads finish whole; the reads'
    results (dicts, or the errors of the killed worker's).

    The 503 can only be seen while the survivor drains, which ends when its last stream
    does. So once every read streams (their first tokens, not a time: a starved test
    process may take seconds to get there), a stream of `hold_tokens` is opened, and the
    worker killed at once is the one that does not serve it (found by its TCP connection):
    the survivor stays up, answering, until the 503 was seen and the hold is closed."""
    pids = worker_pids(proc)
    assert len(pids) == 2, pids
    async with client(url) as c:
        reads = await streaming_on_both(c, streams, tokens)
        hold = await c.send(c.build_request("POST", "/v1/stream", json={
            "prompt": "hold", "max_tokens": hold_tokens, "ignore_eos": True}), stream=True)  # fmt: skip
        assert hold.status_code == 200, await hold.aread()
        holder = _serving_pid(pids, hold.extensions["network_stream"])
        survivor = hold.headers["x-sluice-worker"]
        reading = asyncio.create_task(_discard(hold))
        os.kill(next(p for p in pids if p != holder), signal.SIGKILL)
        killed_at = time.strftime("%H:%M:%S")
        try:
            await _ready_turns_503(c, ready_within_s, worker_killed=True)
        except AssertionError as e:
            raise AssertionError(f"{e}; killed at {killed_at}; the pod's log ends:\n"
                                 f"{proc.tail(40)}") from None  # fmt: skip
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await hold.aclose()
        results = await asyncio.gather(*reads, return_exceptions=True)
    kept = [r for r in results if isinstance(r, dict) and r["worker"] == survivor]
    assert kept and all(r["done"] and r["last"]["finish_reason"] == "length" for r in kept), kept
    return results


def _serving_pid(pids: list[int], stream) -> int:
    """The worker whose accepted socket is the other end of this client connection."""
    here = stream.get_extra_info("client_addr")
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and (conn.raddr.ip, conn.raddr.port) == tuple(here):
                return pid
    raise AssertionError(f"no worker holds the connection from {here}")


async def _discard(r: httpx.Response) -> None:
    async for _ in r.aiter_raw():
        pass
