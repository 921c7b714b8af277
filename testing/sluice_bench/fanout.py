"""Fan-out client: how many concurrent streams one server holds (own process): one
process, or a pod of `--api-workers` processes (CPU time and RSS are then the whole tree's).

The server runs the simulator engine with stamped tokens: every token's text carries the
wall-clock time the engine produced it (`word@1732950000.123456`). Client and server share
the machine's clock, so arrival time minus stamp is the delivery lag through the server.

The ramp opens streams in steps (stages). At each stage it waits for the new streams'
first tokens, then measures for `hold_s`: tokens/s, lag p50/p99/max of the tokens that
arrived in the window, errors (non-200, error events, streams that ended early, failed
connects), the server's RSS (growth over the idle baseline / streams) and its CPU time
(cores; cores per 1,000 tokens/s). It stops early when the server is clearly saturated.

The search (`"search": true`) finds the largest offered load that passes (p99 lag under
the target, no errors): it doubles the streams until a stage fails, then narrows the gap
between the largest pass and the smallest failure. Run it with the server and this client
pinned to cores of their own (run.py does), so the load generator does not take the
server's CPU and the result reads as tokens/s per server core.
Streams are long (`max_tokens` outlasts the run); at the end the client closes them all.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import psutil
from testkit.cpus import process_tree, tree_cpu_s

from sluice_bench.loadgen import percentile, serve_stdin

STAMP = re.compile(rb"@(\d{9,11}\.\d{6})")


class State:
    def __init__(self) -> None:
        self.measuring = False
        self.lags: list[float] = []
        self.tokens = 0
        self.errors = 0
        self.error_samples: set[str] = set()
        self.started = 0  # streams that received their first token
        self.stopping = False

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.add(what[:200])

    def stamps(self, data: bytes) -> bool:
        """Record the tokens in `data`; True if it held any."""
        found = STAMP.findall(data)
        if not found:
            return False
        if self.measuring:
            now = time.time()
            self.tokens += len(found)
            self.lags.extend(now - float(s) for s in found)
        return True


async def sse_stream(session, base, payload, st: State) -> None:
    first = True
    async with session.post(f"{base}/v1/stream", json=payload) as resp:
        if resp.status != 200:
            st.error(f"HTTP {resp.status}: {(await resp.text())[:100]}")
            return
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            cut = buffer.rfind(b"\n")  # only whole lines: a stamp never splits
            if cut < 0:
                continue
            lines, buffer = buffer[: cut + 1], buffer[cut + 1 :]
            if st.stamps(lines) and first:
                first = False
                st.started += 1
            if b'"error"' in lines or b"event: error" in lines:
                st.error(lines.decode(errors="replace"))
                return
    if not st.stopping:
        st.error("stream ended early")


async def ws_stream(session, base, payload, st: State) -> None:
    first = True
    url = base.replace("http://", "ws://") + "/ws/stream"
    async with session.ws_connect(url, max_msg_size=0) as ws:
        params = {k: payload[k] for k in ("max_tokens", "ignore_eos")}
        frame = {"id": "1", "messages": payload["messages"], "params": params}
        await ws.send_str(json.dumps(frame))
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = msg.data.encode()
            if st.stamps(data) and first:
                first = False
                st.started += 1
            if b'"error"' in data:
                st.error(msg.data)
                return
    if not st.stopping:
        st.error("websocket closed early")


async def guarded(coro, st: State) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not st.stopping:
            st.error(f"{type(exc).__name__}: {exc}")


def rss_bytes(proc: psutil.Process) -> int:
    total = 0
    for p in process_tree(proc):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


class Fleet:
    """The client's open streams and one measurement over them (a stage)."""

    def __init__(self, cmd: dict, session: aiohttp.ClientSession, server: psutil.Process) -> None:
        self.cmd, self.session, self.server = cmd, session, server
        self.opener = sse_stream if cmd["protocol"] == "sse" else ws_stream
        self.payload = {
            "model": cmd["model"],
            "messages": [{"role": "user", "content": "fan out please"}],
            "max_tokens": cmd["max_tokens"],
            "ignore_eos": True,
        }
        self.st = State()
        self.tasks: list[asyncio.Task] = []
        self.me = psutil.Process()
        self.baseline_rss = 0

    def _open(self) -> asyncio.Task:
        return asyncio.create_task(
            guarded(self.opener(self.session, self.cmd["base_url"], self.payload, self.st), self.st)
        )

    async def warm(self) -> None:
        """Warm the server's code paths, then take the idle baseline."""
        warm = [self._open() for _ in range(20)]
        await asyncio.sleep(1.5)
        self.st.stopping = True
        for t in warm:
            t.cancel()
        await asyncio.gather(*warm, return_exceptions=True)
        await asyncio.sleep(1.0)
        self.st = State()
        self.baseline_rss = rss_bytes(self.server)

    async def resize(self, target: int) -> None:
        """Open or close streams until `target` are open; wait (bounded) for the new ones'
        first tokens. Closed streams are the newest: a cancel is not an error."""
        st, cmd = self.st, self.cmd
        if target < len(self.tasks):
            gone = self.tasks[target:]
            del self.tasks[target:]
            for t in gone:
                t.cancel()
            await asyncio.gather(*gone, return_exceptions=True)
            await asyncio.sleep(0.5)
            return
        added = target - len(self.tasks)
        goal, errors0 = st.started + added, st.errors
        batch = max(1, int(cmd["ramp_per_s"] * 0.05))
        while len(self.tasks) < target:
            for _ in range(min(batch, target - len(self.tasks))):
                self.tasks.append(self._open())
            await asyncio.sleep(0.05)
        settle_until = time.monotonic() + cmd["settle_s"] + added / 1000
        while st.started < goal - (st.errors - errors0) and time.monotonic() < settle_until:  # noqa: ASYNC110 - bounded poll
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)

    async def stage(self, target: int) -> dict:
        """Hold `target` streams open and measure for `hold_s`."""
        st, cmd = self.st, self.cmd
        errors_before = st.errors
        await self.resize(target)
        st.lags, st.tokens = [], 0
        psutil.cpu_percent(None)  # starts the machine-wide busy measurement
        cpu0, me0, t0 = tree_cpu_s(self.server), tree_cpu_s(self.me), time.monotonic()
        st.measuring = True
        await asyncio.sleep(cmd["hold_s"])
        st.measuring = False
        elapsed = time.monotonic() - t0
        cores = (tree_cpu_s(self.server) - cpu0) / elapsed
        rss = rss_bytes(self.server)
        tps = st.tokens / elapsed
        lags_ms = [x * 1000 for x in st.lags]
        return {
            "streams": target,
            "started": st.started,
            "errors": st.errors,
            "new_errors": st.errors - errors_before,
            "tokens_per_s": tps,
            "expected_tokens_per_s": target * 1000.0 / cmd["itl_ms"],
            "lag_p50_ms": percentile(lags_ms, 50),
            "lag_p99_ms": percentile(lags_ms, 99),
            "lag_max_ms": max(lags_ms) if lags_ms else None,
            "server_rss_mb": rss / 2**20,
            "rss_per_stream_kb": (rss - self.baseline_rss) / target / 1024,
            "server_cores": cores,
            "cores_per_1k_tps": cores / (tps / 1000) if tps else None,
            "client_cores": (tree_cpu_s(self.me) - me0) / elapsed,
            # Other work on the machine steals the same cores: read lag with this.
            "machine_busy_pct": psutil.cpu_percent(None),
        }

    async def close(self) -> None:
        self.st.stopping = True
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def passes(stage: dict, cmd: dict) -> bool:
    """No errors in this stage and p99 lag under the target."""
    return (
        stage["new_errors"] == 0
        and stage["lag_p99_ms"] is not None
        and stage["lag_p99_ms"] < cmd["lag_target_ms"]
    )


async def ramp(fleet: Fleet, cmd: dict, deadline: float) -> tuple[list[dict], int]:
    """The fixed stages, cumulative; stops early once failing or saturated. The largest
    concurrency that passed, with every stage before it passing too."""
    stages, best, failed = [], 0, False
    for target in cmd["stages"]:
        if time.monotonic() > deadline:
            break
        stage = await fleet.stage(target)
        stages.append(stage)
        if passes(stage, cmd) and not failed:
            best = target
        else:
            failed = True
        p99 = stage["lag_p99_ms"]
        saturated = p99 is not None and p99 > cmd["give_up_lag_ms"]
        if fleet.st.errors > 0.05 * target or (saturated and target >= cmd.get("min_streams", 0)):
            break  # failing, or saturated past the floor: more streams only pile up lag
    return stages, best


async def search(fleet: Fleet, cmd: dict, deadline: float) -> tuple[list[dict], int]:
    """The largest offered load that passes: double from `start` until a stage fails, then
    halve the gap (on a log scale) between the largest pass and the smallest failure until
    they are within `resolution` of each other. Streams are closed to step down, so a
    failure's backlog does not linger: each step settles before it is measured."""
    stages: list[dict] = []
    good, bad = 0, None
    n = cmd["start"]
    while time.monotonic() < deadline and n <= cmd["max_streams"]:
        stage = await fleet.stage(n)
        stages.append(stage)
        if not passes(stage, cmd):
            bad = n
            break
        good, n = n, n * 2
    while bad is not None and time.monotonic() < deadline:
        if good == 0:
            n = bad // 2
            if n < cmd["start"] // 4:
                break
        elif bad / good <= 1 + cmd["resolution"]:
            break
        else:
            n = int(round((good * bad) ** 0.5))
        stage = await fleet.stage(n)
        stages.append(stage)
        if passes(stage, cmd):
            good = n
        else:
            bad = n
    return stages, good


async def run(cmd: dict) -> dict:
    server = psutil.Process(cmd["server_pid"])
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    deadline = time.monotonic() + cmd["budget_s"]
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        fleet = Fleet(cmd, session, server)
        await fleet.warm()
        find = search if cmd.get("search") else ramp
        stages, best = await find(fleet, cmd, deadline)
        await fleet.close()
    return {
        "protocol": cmd["protocol"],
        "itl_ms": cmd["itl_ms"],
        "workers": cmd.get("workers", 1),
        "search": bool(cmd.get("search")),
        "pinned": cmd.get("pinned"),
        "baseline_rss_mb": fleet.baseline_rss / 2**20,
        "stages": stages,
        "max_ok_streams": best,
        "error_samples": sorted(fleet.st.error_samples),
    }


if __name__ == "__main__":
    serve_stdin(run)
