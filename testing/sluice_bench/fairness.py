"""Fairness between tenants on one pod: the admission queue, slot shares, priority classes
and vLLM's priority scheduler, measured (docs/benchmarks.md, "Sharing a pod").

    python -m sluice_bench.fairness --engine simulator     # about 6 minutes
    python -m sluice_bench.fairness --engine vllm          # the tiny model, about 15 minutes
    python -m sluice_bench.fairness --quick                # smoke run (simulator, short)
    python -m sluice_bench.fairness --render               # the docs section from the JSON

One pod (a server process; `--max-concurrent-streams 8`, so the flood fills it) and two
tenants, each with its own API key. Tenant A floods: a closed loop of 24 workers asking for
long generations (a 429 is retried after its Retry-After). Tenant B is steady: short
requests at a fixed rate, never retried. Scenarios, each on a fresh server:

1. **TTFT of the steady tenant.** B alone; B beside 6 of A's streams that never wait (the
   engine's load with nobody queued: what B's TTFT can be at best beside the flood); then
   A and B under today's behaviour (no queue: 429 at once), with a queue but no slot
   shares, and with the queue and slot shares. Reported: B's TTFT p50/p99, its queue wait
   p99 as the server measured it (`sluice_queue_wait_seconds`, scraped at the window's
   start and end) and its 429s, and A's tokens/s (the cost of B's headroom).
2. **Shares when both are backlogged.** A (weight 3, long generations) and B (weight 1,
   short ones) both flood: tokens generated per tenant in the measurement window, against
   the weights' 75/25.
3. **Priority under overload.** One tenant's `interactive` and `batch` keys both flood a
   pod whose queue (16) overflows: admitted, shed and TTFT per class.
4. **The engine's own queue** (vLLM only): no admission queue, `--max-num-seqs 4`, 32
   `batch` streams in the engine, one `interactive` request every second: its TTFT with
   `--scheduling-policy priority` (what `--priority-classes` starts vLLM with) against
   `fcfs`, in the same run.

Each request asks for 0.5x to 1.5x its party's token count (fixed per request number), so
streams end at different times as they would in production. A request's TTFT is request
sent -> first token event. Tokens in the window are each
finished request's `usage.completion_tokens` spread evenly over its first-to-last token
time and clipped to the window (the load stops asking at the window's end and lets the
streams in flight finish). Results: docs/bench-fairness.json (kept per engine) and the
section between the `bench:fairness` markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from testkit.net import free_port
from testkit.repo import ROOT

from sluice_bench.loadgen import percentile
from sluice_bench.procs import PY, ProcGroup, Server, engine_env, separate_engines

BEGIN, END = "<!-- bench:fairness:begin -->", "<!-- bench:fairness:end -->"
CAP = 8
CLASSES = "interactive,batch"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b", "hi": "sk-interactive", "lo": "sk-batch"}
TENANTS = {"a": "a", "b": "b", "hi": "c", "lo": "c"}  # the key file's tenant of each key
ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20),
               "--max-model-len", "1024"]  # fmt: skip


@dataclass
class Shape:
    """Load sizes per engine: generations long enough that the flood holds its slots."""

    a_tokens: int
    b_tokens: int
    b_rate: float  # B's requests per second
    seconds: float  # measurement window
    warmup: float


SHAPES = {
    "simulator": Shape(a_tokens=200, b_tokens=20, b_rate=2.5, seconds=40, warmup=6),
    "vllm": Shape(a_tokens=384, b_tokens=24, b_rate=2.5, seconds=40, warmup=6),
    "quick": Shape(a_tokens=60, b_tokens=8, b_rate=4, seconds=3, warmup=1),
}


@dataclass
class Req:
    who: str
    sent: float
    status: int = 0
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


async def one(session: aiohttp.ClientSession, base: str, who: str, max_tokens: int,
              n: int) -> tuple[Req, float]:  # fmt: skip
    """POST /v1/stream as `who` for about `max_tokens` (0.5x to 1.5x, fixed per request
    number: streams of one length would all end together, in waves); (record, Retry-After
    seconds or 0)."""
    tokens = max(1, round(max_tokens * (0.5 + random.Random(f"{who}{n}").random())))
    body = {"prompt": f"request {n} of {who}: tell a long story", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    rec = Req(who, time.perf_counter())
    headers = {"Authorization": f"Bearer {KEYS[who]}"}
    try:
        async with session.post(f"{base}/v1/stream", json=body, headers=headers) as r:
            rec.status = r.status
            if r.status != 200:
                rec.error = (await r.text())[:200]
                return rec, float(r.headers.get("Retry-After", "1"))
            buffer = b""
            async for chunk in r.content.iter_any():
                now = time.perf_counter()
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:") or line == b"data: [DONE]":
                            continue
                        msg = json.loads(line[5:])
                        if "error" in msg:
                            rec.error = msg["error"].get("code")
                        elif msg.get("finished"):
                            rec.tokens = msg["usage"]["completion_tokens"]
                        elif msg.get("token"):
                            rec.first = rec.first or now
                            rec.last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec, 0.0


async def flood(session, base: str, who: str, workers: int, max_tokens: int, until: float,
                out: list) -> None:  # fmt: skip
    """A closed loop: each worker asks again when its stream ends (after Retry-After on a
    refusal), until `until`."""
    count = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < until:
            rec, retry = await one(session, base, who, max_tokens, next(count))
            out.append(rec)
            if rec.status != 200:
                await asyncio.sleep(min(retry, max(0.0, until - time.perf_counter())))

    await asyncio.gather(*(worker() for _ in range(workers)))


async def steady(session, base: str, who: str, rate: float, max_tokens: int, until: float,
                 out: list) -> None:  # fmt: skip
    """An open loop: one request every 1/rate seconds, whatever happened to the others."""
    tasks, n = [], 0
    start = time.perf_counter()
    while True:
        due = start + n / rate
        if due >= until:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(session, base, who, max_tokens, n)))
        n += 1
    for rec, _ in await asyncio.gather(*tasks):
        out.append(rec)


def in_window(rec: Req, t0: float, t1: float) -> float:
    """Tokens of a finished request generated inside [t0, t1] (spread over its stream)."""
    if rec.first is None or rec.last is None or not rec.tokens:
        return 0.0
    if rec.last <= rec.first:
        return float(rec.tokens) if t0 <= rec.first <= t1 else 0.0
    overlap = max(0.0, min(rec.last, t1) - max(rec.first, t0))
    return rec.tokens * overlap / (rec.last - rec.first)


def summary(recs: list[Req], t0: float, t1: float) -> dict:
    """One party's numbers: requests sent in the window, their outcomes and TTFT, and the
    tokens generated in the window."""
    sent = [r for r in recs if t0 <= r.sent <= t1]
    ok = [r for r in sent if r.status == 200 and r.error is None and r.first is not None]
    ttfts = [t * 1000 for r in ok if (t := r.ttft) is not None]
    tokens = sum(in_window(r, t0, t1) for r in recs)
    return {
        "requests": len(sent),
        "ok": len(ok),
        "refused_429": sum(r.status == 429 for r in sent),
        "failed_after_200": sum(r.status == 200 and r.error is not None for r in sent),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "tokens": round(tokens),
        "tokens_per_s": tokens / (t1 - t0),
    }


# -- servers --------------------------------------------------------------------------


class Pods:
    """Starts one server per scenario (the previous one stopped first)."""

    def __init__(self, engine: str, group: ProcGroup, scratch: Path, env: dict) -> None:
        self.engine, self.group, self.scratch, self.env = engine, group, scratch, env
        self.current: Server | None = None
        self.layout: dict = {}

    def start(self, name: str, keys: str, flags: list[str], engine_args: Sequence[str] = ()) -> str:
        if self.current is not None:
            self.group.stop(self.current)
        key_file = self.scratch / f"keys-{name}"
        key_file.write_text(keys)
        port = free_port()
        if self.engine == "simulator":
            model = ["--engine", "simulator", "--model", "sim", "--sim-ttft-ms", "50",
                     "--sim-itl-ms", "20"]  # fmt: skip
        else:
            model = ["--model", "tiny", "--served-model-name", "tiny"]
        argv = [PY, "-m", "sluice_server", *model, "--host", "127.0.0.1", "--port", str(port),
                "--api-key-file", str(key_file), "--log-level", "warning",
                "--access-log", "false", *flags]  # fmt: skip
        if self.engine == "vllm":
            argv += ["--", *ENGINE_ARGS, *engine_args]
        logs = self.scratch / "logs"
        logs.mkdir(exist_ok=True)
        server = self.current = self.group.add(Server(f"fair-{name}", argv, self.env, logs,
                                                      port, "/ready"))  # fmt: skip
        server.wait_ready(300)
        if self.engine == "vllm":
            self.layout = separate_engines([server])
            if self.layout:  # the load generator next to the server, off the engine's core
                os.sched_setaffinity(0, set(self.layout["front_cpus"]))
        return server.base_url


def keys(weights: dict[str, int] | None = None) -> str:
    w = weights or {}
    lines = [f"{KEYS['a']} tenant=a priority=batch" + (f" weight={w['a']}" if "a" in w else ""),
             f"{KEYS['b']} tenant=b priority=batch" + (f" weight={w['b']}" if "b" in w else ""),
             f"{KEYS['hi']} tenant=c priority=interactive", f"{KEYS['lo']} tenant=c priority=batch"]  # fmt: skip
    return "\n".join(lines) + "\n"


QUEUE = ["--max-concurrent-streams", str(CAP), "--queue-size", "64", "--queue-timeout-seconds",
         "30", "--priority-classes", CLASSES]  # fmt: skip
POLICIES = {
    "today (no queue)": ["--max-concurrent-streams", str(CAP), "--priority-classes", CLASSES],
    "queue, no slot shares": [*QUEUE, "--queue-slot-sharing", "false"],
    "queue + slot shares": QUEUE,
}


_BUCKET = re.compile(r"^sluice_queue_wait_seconds_bucket\{([^}]*)\} (\S+)$", re.M)


async def queue_waits(session, base: str) -> dict[str, dict[float, float]]:
    """The server's own queue-wait histogram: tenant -> {upper bound: cumulative count}."""
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, dict[float, float]] = {}
    for labels, value in _BUCKET.findall(text):
        have = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        le = float(have["le"])
        tenant = out.setdefault(have["tenant"], {})
        tenant[le] = tenant.get(le, 0.0) + float(value)
    return out


def wait_quantile(before: dict[float, float], after: dict[float, float], q: float):
    """The q-quantile (ms) of the waits between two scrapes, interpolated in its bucket
    as Prometheus's histogram_quantile does; None without samples."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if bound == float("inf"):
                return lower * 1000
            inside = cum - below
            return (lower + (bound - lower) * ((rank - below) / inside if inside else 1)) * 1000
        lower, below = bound, cum
    return None


async def run_load(base: str, shape: Shape, parties: dict) -> dict:
    """`parties`: name -> ("flood", who, workers, tokens) | ("steady", who, rate, tokens).
    Each party's numbers, with its tenant's queue wait p99 as the server measured it."""
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    records: dict[str, list[Req]] = {name: [] for name in parties}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        t0, t1 = start + shape.warmup, start + shape.warmup + shape.seconds

        async def at_window_start():
            await asyncio.sleep(shape.warmup)
            return await queue_waits(session, base)

        jobs = [at_window_start()]
        for name, (kind, who, size, tokens) in parties.items():
            if kind == "flood":
                jobs.append(flood(session, base, who, size, tokens, t1, records[name]))
            else:
                jobs.append(steady(session, base, who, size, tokens, t1, records[name]))
        before, *_ = await asyncio.gather(*jobs)
        after = await queue_waits(session, base)
    out = {name: summary(recs, t0, t1) for name, recs in records.items()}
    for name, (_, who, _, _) in parties.items():
        tenant = TENANTS[who]
        out[name]["queue_wait_p99_ms"] = wait_quantile(before.get(tenant, {}),
                                                       after.get(tenant, {}), 0.99)  # fmt: skip
    return out


async def scenario_ttft(pods: Pods, shape: Shape) -> dict:
    out = {}
    b = ("steady", "b", shape.b_rate, shape.b_tokens)
    a = ("flood", "a", 24, shape.a_tokens)
    base = pods.start("alone", keys(), QUEUE)
    out["B alone"] = await run_load(base, shape, {"B": b})
    # The engine's load without anyone waiting: A at 6 streams, never more (6 + B's 2 fit).
    out["B beside 6 of A's streams, no waits"] = await run_load(
        base, shape, {"A": ("flood", "a", 6, shape.a_tokens), "B": b}
    )
    for label, flags in POLICIES.items():
        base = pods.start(re.sub(r"[^a-z]+", "-", label).strip("-"), keys(), flags)
        out[label] = await run_load(base, shape, {"A": a, "B": b})
    return out


async def scenario_shares(pods: Pods, shape: Shape) -> dict:
    base = pods.start("shares", keys({"a": 3, "b": 1}), QUEUE)
    res = await run_load(base, shape, {"A": ("flood", "a", 24, shape.a_tokens),
                                       "B": ("flood", "b", 24, shape.a_tokens // 4)})  # fmt: skip
    total = res["A"]["tokens"] + res["B"]["tokens"]
    res["share_a"] = res["A"]["tokens"] / total if total else None
    res["weights"] = {"a": 3, "b": 1}
    return res


async def scenario_priority(pods: Pods, shape: Shape) -> dict:
    """Interactive requests at a steady rate (below the pod's capacity), batch ones
    flooding past it: the queue (16) overflows with batch requests."""
    flags = ["--max-concurrent-streams", str(CAP), "--queue-size", "16",
             "--queue-timeout-seconds", "30", "--priority-classes", CLASSES]  # fmt: skip
    base = pods.start("priority", keys(), flags)
    tokens = shape.b_tokens * 2
    return await run_load(base, shape, {"interactive": ("steady", "hi", 4.0, tokens),
                                        "batch": ("flood", "lo", 24, tokens)})  # fmt: skip


async def scenario_engine_policy(pods: Pods, shape: Shape) -> dict:
    """No admission queue; the engine's queue holds the backlog (max_num_seqs 4)."""
    out = {}
    flags = ["--max-concurrent-streams", "64", "--priority-classes", CLASSES]
    for policy in ("priority", "fcfs"):
        base = pods.start(f"engine-{policy}", keys(), flags,
                          ["--max-num-seqs", "4", "--scheduling-policy", policy])  # fmt: skip
        out[policy] = await run_load(base, shape, {
            "batch": ("flood", "lo", 32, shape.a_tokens),
            "interactive": ("steady", "hi", 1.0, 16),
        })  # fmt: skip
    return out


# -- report ---------------------------------------------------------------------------


def _f(v, digits=0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def tables(engine: str, res: dict) -> str:
    shape = res["shape"]
    lines = [f"#### {'Real engine (vLLM, tiny model, CPU)' if engine == 'vllm' else 'Simulator'}",
             "",
             f"Pod: {CAP} stream slots. A: 24 workers in a closed loop, about {shape['a_tokens']} "
             f"tokens a request. B: {shape['b_rate']:g} requests/s, about {shape['b_tokens']} "
             f"tokens each. Window {shape['seconds']:g} s after {shape['warmup']:g} s of warm-up.",
             "",
             "| policy | B TTFT p50 ms | B TTFT p99 ms | B p99 / alone | B queue wait p99 ms | B 429 | A tokens/s | A 429 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ttft = res["ttft"]
    alone = ttft["B alone"]["B"]["ttft_p99_ms"]
    for label, r in ttft.items():
        b, a = r["B"], r.get("A")
        ratio = b["ttft_p99_ms"] / alone if b["ttft_p99_ms"] and alone else None
        a = a if a and a["requests"] else None
        lines.append(f"| {label} | {_f(b['ttft_p50_ms'], 1)} | {_f(b['ttft_p99_ms'], 1)} | "
                     f"{_f(ratio, 2) + 'x' if ratio else '-'} | {_f(b.get('queue_wait_p99_ms'), 1)} | "
                     f"{b['refused_429']} / {b['requests']} | "
                     f"{_f(a['tokens_per_s']) if a else '-'} | {a['refused_429'] if a else '-'} |")  # fmt: skip
    sh = res["shares"]
    lines += ["", "Both backlogged, weights A 3 : B 1 (A's generations 4x B's length):", "",
              "| tenant | weight | tokens in window | share | target |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    total = sh["A"]["tokens"] + sh["B"]["tokens"]
    for t, w in (("A", 3), ("B", 1)):
        share = sh[t]["tokens"] / total if total else 0
        lines.append(f"| {t} | {w} | {sh[t]['tokens']:,} | {share:.1%} | {w / 4:.0%} |")
    pr = res["priority"]
    lines += ["", "Priority under overload (interactive 4 requests/s, batch a closed loop of 24; "
              "queue of 16):", "",
              "| class | sent | admitted | shed (429) | TTFT p50 ms | TTFT p99 ms | tokens/s |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for cls in ("interactive", "batch"):
        r = pr[cls]
        lines.append(f"| {cls} | {r['requests']} | {r['ok']} | {r['refused_429']} | "
                     f"{_f(r['ttft_p50_ms'], 1)} | {_f(r['ttft_p99_ms'], 1)} | {_f(r['tokens_per_s'])} |")  # fmt: skip
    if "engine_policy" in res:
        ep = res["engine_policy"]
        lines += ["", "The engine's own queue (no admission queue, `--max-num-seqs 4`, 32 batch "
                  "streams waiting in vLLM): an interactive request every second:", "",
                  "| vLLM policy | interactive TTFT p50 ms | p99 ms | requests | batch tokens/s |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for policy in ("priority", "fcfs"):
            r = ep[policy]
            lines.append(f"| `{policy}` | {_f(r['interactive']['ttft_p50_ms'], 1)} | "
                         f"{_f(r['interactive']['ttft_p99_ms'], 1)} | {r['interactive']['ok']} | "
                         f"{_f(r['batch']['tokens_per_s'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_docs(results: dict, out: Path) -> None:
    parts = [f"{BEGIN}\n<!-- Written by testing/sluice_bench/fairness.py from docs/bench-fairness.json; "
             "edits here are overwritten. -->\n"]  # fmt: skip
    for engine in ("simulator", "vllm"):
        if engine in results:
            parts.append(
                f"Command: `{results[engine]['command']}`.\n\n" + tables(engine, results[engine])
            )
    parts.append(END)
    note = out / "benchmarks.md"
    text = note.read_text() if note.exists() else "# Benchmarks\n"
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + "\n".join(parts) + rest.split(END, 1)[1]
    else:
        text += "\n" + "\n".join(parts) + "\n"
    note.write_text(text)


async def run(engine: str, shape: Shape, pods: Pods) -> dict:
    res: dict = {"shape": asdict(shape)}
    res["ttft"] = await scenario_ttft(pods, shape)
    res["shares"] = await scenario_shares(pods, shape)
    res["priority"] = await scenario_priority(pods, shape)
    if engine == "vllm":
        res["engine_policy"] = await scenario_engine_policy(pods, shape)
    res["cpu_layout"] = pods.layout
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("simulator", "vllm"), default="simulator")
    p.add_argument("--quick", action="store_true", help="smoke run: simulator, short windows")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--render", action="store_true",
                   help="rewrite the docs section from --out's bench-fairness.json, no run")  # fmt: skip
    a = p.parse_args(argv)
    store = a.out / "bench-fairness.json"
    if a.render:
        write_docs(json.loads(store.read_text()), a.out)
        return 0
    engine = "simulator" if a.quick else a.engine
    shape = SHAPES["quick" if a.quick else engine]
    cache = Path(os.environ.get("SLUICE_CACHE") or ROOT / ".cache")
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-fair-", dir=cache))
    print(f"fairness: {engine}, logs in {scratch / 'logs'}", flush=True)
    with ProcGroup() as group:
        pods = Pods(engine, group, scratch, engine_env(scratch))
        res = asyncio.run(run(engine, shape, pods))
    cmd = "python -m sluice_bench.fairness " + ("--quick" if a.quick else f"--engine {engine}")
    res["command"] = cmd
    results = json.loads(store.read_text()) if store.exists() else {}
    results[engine] = res
    a.out.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(results, indent=1))
    write_docs(results, a.out)
    print(tables(engine, res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
