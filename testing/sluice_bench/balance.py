"""Balancing benchmark: least-loaded vs round-robin over three replicas behind nginx.

Three simulator replicas (`--engine simulator`), whose TTFT grows with the streams each
already has in flight (`--sim-ttft-per-stream-ms`, the CRD's `ttftPerStreamMs`), so an
imbalance shows as TTFT. Two ways to run them:

- live pods (the default; needs K8S_ASSETS, etcd, nginx and bubblewrap, as tests/e2e):
  one StreamingModel with three replicas on a real control plane, deployed by the operator,
  each pod's server run by the e2e node agent under bubblewrap, reached through the e2e
  ingress (balance_live.py). The model's Ingress is an F5 one, so `spec.routing.balance`
  becomes the operator's `nginx.org/lb-method` annotation (least_conn or round_robin), and
  the e2e ingress applies the nginx upstream directive that annotation asks for (what that
  controller writes). Between the two phases of each mix the model is patched and the run
  waits until nginx runs the new method.
- `--direct`: three server processes behind a NginxProxy (testing/testkit/nginx_proxy.py)
  configured from the same annotations, no cluster.
Either way nginx runs one worker (so least_conn's counts are exact; a controller with
several workers shares them through its upstream zone), and the table measures nginx's
method behind our annotations, not our own balancing code.

Load: a fixed arrival rate, each request a 16-token or a 2,000-token stream; two mixes in
one run: `random` (a seeded 1-in-4 draw) and `every 3rd` (each third request is long, the
pattern round robin aligns with three replicas). Per request the client records TTFT
(request sent to the first token event); every 200 ms each server is asked its own
`sluice_active_streams` (at its own address, not through nginx), and the table gives each
replica's mean and the busiest replica's mean over the mean of all three.

    python -m sluice_bench.balance            # live pods (skips, saying why, without them)
    python -m sluice_bench.balance --write    # and writes the table into docs/benchmarks.md
    python -m sluice_bench.balance --direct   # no cluster: nginx and three processes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from testkit.net import free_port
from testkit.nginx_proxy import NginxProxy

from sluice_bench import docblock
from sluice_bench.procs import ProcGroup, Server

SHORT, LONG = 16, 2000
ACTIVE_RE = re.compile(r"^sluice_active_streams\{[^}]*\} ([0-9.e+-]+)$", re.M)


def lb_annotations(balance: str) -> dict[str, str]:
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


WHERE = {
    "live": "live pods of one StreamingModel (operator, real control plane, node agent running "
    "each pod under bubblewrap) behind the e2e ingress, which applies the upstream method the "
    "operator's `nginx.org/lb-method` annotation asks for; the model patched between phases",
    "direct": "three server processes behind nginx configured with the upstream method our "
    "`nginx.org/lb-method` annotation asks for (no cluster)",
}


def table(rows: list[dict], a) -> str:
    head = (
        f"Three simulator replicas (TTFT {a.ttft_ms:g} ms + {a.ttft_per_stream_ms:g} ms per "
        f"stream in flight, {a.itl_ms:g} ms between tokens): {WHERE[a.mode]}; {a.requests} "
        f"streams per run at {a.rate:g}/s, each {SHORT} or {LONG} tokens. Active streams: "
        "each replica's own `sluice_active_streams`, sampled every 200 ms, mean per replica."
        "\n\n"
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
    docblock.write("balance", "testing/sluice_bench/balance.py --write", text)


# Per mode: (requests, rate, ttft, ttft per stream, itl). Live pods share the cores with a
# control plane, an operator and a node agent: a larger TTFT per stream in flight and fewer
# token events per second (2,000-token streams at 1/s) keep a busy machine's scheduling
# noise below the imbalance being measured.
DEFAULTS = {"direct": (240, 8.0, 20.0, 20.0, 2.0), "live": (160, 4.0, 50.0, 50.0, 10.0)}


def phases(a, set_balance, urls: list[str], proxy_url) -> list[dict]:
    """Both mixes, round-robin then least-loaded each; `set_balance(b)` puts nginx on b's
    method and returns it, `proxy_url(b)` is a context manager giving the URL to load."""
    rows = []
    for mix in ("random", "every 3rd"):
        plan = lengths(mix, a.requests, a.seed)
        for balance in ("round-robin", "least-loaded"):
            method = set_balance(balance)
            with proxy_url(balance) as url:
                result = asyncio.run(run_load(url, urls, plan, a.rate))
            row = {"mix": mix, "balance": balance, "method": method, **result}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run_direct(a, tmp: Path) -> list[dict]:
    with ProcGroup() as group:
        urls = [s.base_url for s in start_servers(group, tmp, 3, a)]

        @contextlib.contextmanager
        def proxy(balance: str):
            with NginxProxy(urls, "ingress", annotations=lb_annotations(balance)) as p:
                yield p.url

        def method(balance: str) -> str:
            return lb_annotations(balance)["nginx.org/lb-method"]

        return phases(a, method, urls, proxy)


def run_live(a, tmp: Path) -> list[dict]:
    from sluice_bench.balance_live import LiveReplicas

    sim = {"ttftMs": a.ttft_ms, "itlMs": a.itl_ms, "ttftPerStreamMs": a.ttft_per_stream_ms,
           "jitter": 0}  # fmt: skip
    with LiveReplicas(tmp, sim) as live:
        print(f"live: {len(live.servers)} pods {live.servers} behind {live.url}", flush=True)
        return phases(a, live.set_balance, live.servers,
                      lambda _: contextlib.nullcontext(live.url))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--direct", dest="mode", action="store_const", const="direct",
                   default="live", help="no cluster: nginx in front of three processes")  # fmt: skip
    p.add_argument("--requests", type=int)
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--ttft-ms", type=float)
    p.add_argument("--ttft-per-stream-ms", type=float)
    p.add_argument("--itl-ms", type=float)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", type=Path, help="keep the run's logs here (default: a temp dir)")
    p.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    a = p.parse_args()
    for key, value in zip(("requests", "rate", "ttft_ms", "ttft_per_stream_ms", "itl_ms"),
                          DEFAULTS[a.mode], strict=True):  # fmt: skip
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.mode == "live":
        from sluice_bench.balance_live import live_problem

        if reason := live_problem():
            print(
                f"balance: live pods skipped: {reason}\n(`--direct` runs nginx and three "
                "server processes without a cluster; docs/benchmarks.md is left as it is)"
            )
            return
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: the cluster, pods and nginx are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        if a.workdir:
            a.workdir.mkdir(parents=True, exist_ok=True)
            tmp = a.workdir
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sluice-balance-")))
        rows = run_live(a, tmp) if a.mode == "live" else run_direct(a, tmp)
    text = table(rows, a)
    print(text)
    if a.write:
        write(text)


if __name__ == "__main__":
    main()
