"""Balancing benchmark: least-loaded vs round-robin over three replicas behind nginx.

Three simulator servers (`python -m sluice_server --engine simulator`), whose TTFT grows
with the streams each already has in flight (`--sim-ttft-per-stream-ms`), so an imbalance
shows as TTFT. In front, a real nginx configured from the annotations the operator writes
for `spec.routing.balance` on the F5 NGINX Ingress (`builders/ingress.balance_annotations`:
`nginx.org/lb-method` least_conn or round_robin), rendered by tests/server/nginx_proxy.py
with the upstream directive each asks for, one nginx worker (so least_conn's counts are
exact; a controller with several workers shares them through its upstream zone). So the
table measures nginx's method behind our annotations, not our own balancing code.

Load: a fixed arrival rate, each request a 16-token or a 2,000-token stream; two mixes in
one run: `random` (a seeded 1-in-4 draw) and `every 3rd` (each third request is long, the
pattern round robin aligns with three replicas). Per request the client records TTFT
(request sent to the first token event); every 200 ms each server is asked its own
`sluice_active_streams`, and the table gives each replica's mean and the busiest replica's
mean over the mean of all three.

    python tests/bench/balance.py            # prints the table
    python tests/bench/balance.py --write    # and writes it into docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1] / "tests"), str(HERE.parents[1] / "tests" / "server")]

import aiohttp  # noqa: E402
from nginx_proxy import NginxProxy  # noqa: E402
from procs import ProcGroup, Server  # noqa: E402
from testkit.net import free_port  # noqa: E402
from testkit.repo import ROOT  # noqa: E402

SHORT, LONG = 16, 2000
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:balance:begin -->", "<!-- bench:balance:end -->"
ACTIVE_RE = re.compile(r"^sluice_active_streams\{[^}]*\} ([0-9.e+-]+)$", re.M)


def annotations(balance: str) -> dict[str, str]:
    """What the operator writes for this balance on the F5 controller."""
    from sluice_operator.builders.ingress import balance_annotations
    from sluice_operator.validation import load_model

    body = {"metadata": {"name": "m", "namespace": "default"},
            "spec": {"model": {"uri": "hf://org/m"},
                     "ingress": {"enabled": True, "controller": "f5-nginx"},
                     "routing": {"balance": balance}}}  # fmt: skip
    return balance_annotations(load_model(body))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def lengths(mix: str, n: int, seed: int) -> list[int]:
    if mix == "every 3rd":
        return [LONG if i % 3 == 0 else SHORT for i in range(n)]
    rng = random.Random(seed)
    return [LONG if rng.random() < 0.25 else SHORT for _ in range(n)]


async def one(session: aiohttp.ClientSession, url: str, tokens: int) -> float | None:
    """TTFT in ms of one token stream, or None when it failed."""
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/stream", json={"prompt": "hi", "max_tokens": tokens}) as r:
        if r.status != 200:
            return None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = (time.perf_counter() - t0) * 1000
        return ttft


async def sample(session: aiohttp.ClientSession, servers: list[str], out: list[list[float]],
                 stop: asyncio.Event) -> None:  # fmt: skip
    while not stop.is_set():
        for i, base in enumerate(servers):
            async with session.get(base + "/metrics") as r:
                text = await r.text()
            out[i].append(sum(float(v) for v in ACTIVE_RE.findall(text)))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


async def run_load(proxy: str, servers: list[str], plan: list[int], rate: float) -> dict:
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    active: list[list[float]] = [[] for _ in servers]
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(session, servers, active, stop))
        start = time.perf_counter()
        tasks = []
        for i, tokens in enumerate(plan):  # a fixed arrival rate, whatever the answers do
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, proxy, tokens)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await sampler
    ttfts = [r for r in results if isinstance(r, float)]
    means = [sum(a) / len(a) if a else 0.0 for a in active]
    overall = sum(means) / len(means)
    return {
        "requests": len(plan),
        "failed": len(plan) - len(ttfts),
        "ttft_p50_ms": percentile(ttfts, 0.50),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "active_means": means,
        "busiest_over_mean": max(means) / overall if overall else 0.0,
    }


def start_servers(group: ProcGroup, log_dir: Path, n: int, a) -> list[Server]:
    servers = []
    for i in range(n):
        port = free_port()
        argv = [sys.executable, "-m", "sluice_server", "--engine", "simulator", "--model", "sim",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                "--sim-ttft-ms", str(a.ttft_ms), "--sim-itl-ms", str(a.itl_ms),
                "--sim-ttft-per-stream-ms", str(a.ttft_per_stream_ms),
                "--max-concurrent-streams", "1000"]  # fmt: skip
        servers.append(group.add(Server(f"replica-{i}", argv, None, log_dir, port, "/ready")))
    for s in servers:
        s.wait_ready(60)
    return servers


def table(rows: list[dict], a) -> str:
    head = (
        f"Three simulator replicas (TTFT {a.ttft_ms:g} ms + {a.ttft_per_stream_ms:g} ms per "
        f"stream in flight, {a.itl_ms:g} ms between tokens) behind nginx with the upstream "
        f"method our `nginx.org/lb-method` annotation asks for; {a.requests} streams per run "
        f"at {a.rate:g}/s, each {SHORT} or {LONG} tokens. Active streams: each replica's own "
        "`sluice_active_streams`, sampled every 200 ms, mean per replica.\n\n"
        "| mix | routing.balance | nginx | TTFT p50 (ms) | TTFT p99 (ms) | active streams per "
        "replica (mean) | busiest / mean | failed |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        per = ", ".join(f"{m:.1f}" for m in r["active_means"])
        lines.append(
            f"| {r['mix']} | {r['balance']} | {r['method']} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {per} | {r['busiest_over_mean']:.2f} | {r['failed']} |"
        )
    verdicts = []
    for mix in dict.fromkeys(r["mix"] for r in rows):
        by = {r["balance"]: r for r in rows if r["mix"] == mix}
        ratio = by["round-robin"]["ttft_p99_ms"] / by["least-loaded"]["ttft_p99_ms"]
        spread = by["least-loaded"]["busiest_over_mean"]
        verdicts.append(
            f"- {mix}: round-robin's TTFT p99 is {ratio:.1f}x least-loaded's (target >= 2x: "
            f"{'met' if ratio >= 2 else 'not met'}); least-loaded's busiest replica is "
            f"{spread:.2f}x the mean (target <= 1.5x: {'met' if spread <= 1.5 else 'not met'})."
        )
    return head + "\n".join(lines) + "\n\n" + "\n".join(verdicts) + "\n"


def write(text: str) -> None:
    doc = DOC.read_text()
    block = f"{BEGIN}\n<!-- Written by tests/bench/balance.py --write; edits here are overwritten. -->\n{text}{END}"
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block")
    DOC.write_text(doc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--ttft-per-stream-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-balance-") as tmp, ProcGroup() as group:
        servers = start_servers(group, Path(tmp), 3, a)
        urls = [s.base_url for s in servers]
        for mix in ("random", "every 3rd"):
            plan = lengths(mix, a.requests, a.seed)
            for balance in ("round-robin", "least-loaded"):
                ann = annotations(balance)
                with NginxProxy(urls, "ingress", annotations=ann) as proxy:
                    result = asyncio.run(run_load(proxy.url, urls, plan, a.rate))
                row = {"mix": mix, "balance": balance, "method": ann["nginx.org/lb-method"],
                       **result}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    text = table(rows, a)
    print(text)
    if a.write:
        write(text)


if __name__ == "__main__":
    main()
