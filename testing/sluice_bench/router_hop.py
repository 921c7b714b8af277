"""What the router's hop costs: token SSE streams through `sluice-server router` against the
same streams straight from a simulator server (one process each, 127.0.0.1, the router
finding the simulator as a Ready pod through a fake API server in this process).

    python -m sluice_bench.router_hop [--streams 16] [--tokens 500] [--held 200]

Prints, as JSON: the router's CPU-seconds per 1,000 relayed tokens (its /proc utime+stime
over a run of `--streams` concurrent streams of `--tokens` tokens) beside the simulator
server's own per 1,000 streamed tokens in the direct run; TTFT p50 direct and through the
router over sequential single streams, and the difference; the router's RSS growth per open
relayed stream with `--held` slow streams open at once. A rough measurement on a shared
machine: no pass/fail, the numbers go in the report that quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn
from testkit.fake_pods_api import FakePodsApi
from testkit.net import free_port

from sluice_bench.procs import ProcGroup, Server

PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def stream(
    client: httpx.AsyncClient, url: str, tokens: int, headers=None
) -> tuple[float, int]:
    """One token SSE stream: seconds to its first token event, and the token events seen."""
    t0 = time.perf_counter()
    first, seen = None, 0
    body = {"prompt": "hop", "max_tokens": tokens}
    async with client.stream("POST", url + "/v1/stream", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"token"' in line:
                seen += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first or 0.0, seen


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="router-hop-"))
    api = FakePodsApi()
    api_port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=api_port,
                                           log_level="warning", lifespan="off"))  # fmt: skip
    api_task = asyncio.create_task(server.serve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with ProcGroup() as procs:
        sims = {}
        for name, itl in (("fast", args.itl_ms), ("slow", 1000.0)):
            port = free_port()
            sims[name] = procs.add(Server(
                f"sim-{name}", [PY, "-m", "sluice_server", "--model", "sim", "--engine",
                                "simulator", "--host", "127.0.0.1", "--port", str(port),
                                "--sim-ttft-ms", "1", "--sim-itl-ms", str(itl),
                                "--log-level", "warning", "--access-log", "false"],
                env, work, port, "/ready"))  # fmt: skip
        for name, sim in sims.items():
            sim.wait_ready(timeout=60)
            api.put(f"sim-{name}", "127.0.0.1", {"app": name}, namespace="bench")
        models = {f"bench/{name}": {"host": f"{name}.bench.invalid", "keepaliveSeconds": 15,
                                    "pods": {"namespace": "bench", "selector": {"app": name},
                                             "port": sim.port}}
                  for name, sim in sims.items()}  # fmt: skip
        (work / "models.json").write_text(json.dumps(models))
        (work / "sa").mkdir()
        (work / "sa" / "token").write_text("bench")
        port = free_port()
        router = procs.add(Server(
            "router", [PY, "-m", "sluice_server", "router", "--models-file",
                       str(work / "models.json"), "--host", "127.0.0.1", "--port", str(port),
                       "--kube-api-url", f"http://127.0.0.1:{api_port}",
                       "--service-account-dir", str(work / "sa"), "--log-level", "warning"],
            env, work, port, "/ready"))  # fmt: skip
        router.wait_ready(timeout=60)
        fast = {"X-Sluice-Model": "bench/fast"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            await stream(c, router.base_url, 4, fast)  # warm: the pod is known, code paths hot
            await stream(c, sims["fast"].base_url, 4)

            async def burst(url: str, headers, pid: int) -> tuple[float, int]:
                cpu0 = cpu_seconds(pid)
                results = await asyncio.gather(*(stream(c, url, args.tokens, headers)
                                                 for _ in range(args.streams)))  # fmt: skip
                return cpu_seconds(pid) - cpu0, sum(n for _, n in results)

            sim_pid, router_pid = sims["fast"].pid, router.pid
            assert sim_pid is not None and router_pid is not None
            direct_cpu, direct_tokens = await burst(sims["fast"].base_url, None, sim_pid)
            sim_cpu0, router_cpu0 = cpu_seconds(sim_pid), cpu_seconds(router_pid)
            _, via_tokens = await burst(router.base_url, fast, router_pid)
            router_cpu = cpu_seconds(router_pid) - router_cpu0
            sim_cpu_routed = cpu_seconds(sim_pid) - sim_cpu0

            ttft_direct, ttft_router = [], []
            for _ in range(args.ttft_samples):
                ttft_direct.append((await stream(c, sims["fast"].base_url, 1))[0])
                ttft_router.append((await stream(c, router.base_url, 1, fast))[0])

            idle = rss_bytes(router_pid)
            slow = {"X-Sluice-Model": "bench/slow"}
            held = [asyncio.ensure_future(stream(c, router.base_url, 10_000, slow))
                    for _ in range(args.held)]  # fmt: skip
            await asyncio.sleep(args.held / 100 + 3)  # all open, a few tokens each
            loaded = rss_bytes(router_pid)
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    server.should_exit = True
    await api_task
    p50d, p50r = statistics.median(ttft_direct), statistics.median(ttft_router)
    return {
        "streams": args.streams, "tokens_per_stream": args.tokens,
        "router_cpu_s_per_1k_tokens": round(router_cpu / via_tokens * 1000, 4),
        "server_cpu_s_per_1k_tokens_direct": round(direct_cpu / direct_tokens * 1000, 4),
        "server_cpu_s_per_1k_tokens_routed": round(sim_cpu_routed / via_tokens * 1000, 4),
        "router_to_server_cpu_ratio": round(router_cpu / max(direct_cpu, 1e-9)
                                            * direct_tokens / via_tokens, 3),  # fmt: skip
        "ttft_p50_ms_direct": round(p50d * 1000, 2), "ttft_p50_ms_router": round(p50r * 1000, 2),
        "ttft_p50_ms_added": round((p50r - p50d) * 1000, 2),
        "held_streams": args.held, "router_rss_idle_mb": round(idle / 2**20, 1),
        "router_rss_per_stream_kb": round((loaded - idle) / args.held / 1024, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--itl-ms", type=float, default=2.0)
    parser.add_argument("--ttft-samples", type=int, default=50)
    parser.add_argument("--held", type=int, default=200)
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
