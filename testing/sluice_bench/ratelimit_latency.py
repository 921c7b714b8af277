"""What the Redis rate-limit backend adds to each request, against the memory backend.

A real redis-server on loopback (started here, no persistence) and two measurements:

* `limiter`: the limiter's own calls, in-process: one `admit` (before the stream starts,
  on the request's path) and one `charge` (after it ends, off the path), N times, for
  `memory` and `redis`. This is the added latency without HTTP noise.
* `http`: a simulator server process per backend (one key, limits far above the load),
  N sequential `POST /v1/stream` with `max_tokens=1`; time to the response headers (the
  admission happens before them), p50/p99 per backend and the difference.

    python -m sluice_bench.ratelimit_latency            # both, N=2000 / 1000
    python -m sluice_bench.ratelimit_latency --n 500 --http-n 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.redis_server import MISSING, RedisServer, available

KEY = "sk-bench-0123456789"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(name: str, ms: list[float]) -> str:
    return (f"{name:<22} p50 {pct(ms, 0.5):7.3f} ms   p99 {pct(ms, 0.99):7.3f} ms   "
            f"mean {statistics.fmean(ms):7.3f} ms   (n={len(ms)})")  # fmt: skip


async def bench_limiter(url: str, n: int) -> dict[str, dict[str, list[float]]]:
    from sluice_server.core.auth.identity import Plan
    from sluice_server.core.limits.ratelimit import MemoryLimiter, RedisLimiter
    from sluice_server.core.telemetry.metrics import Metrics

    plan = Plan(rpm=10**9, tpm=10**12)
    out = {}
    for name, limiter in (("memory", MemoryLimiter()),
                          ("redis", RedisLimiter(url, "bench", Metrics("bench"), "closed", 1.0))):  # fmt: skip
        await limiter.admit("warm", plan)
        admit, charge = [], []
        for i in range(n):
            who = f"p{i % 50}"
            t = time.perf_counter()
            await limiter.admit(who, plan)
            admit.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await limiter.charge(who, plan, 100)
            charge.append((time.perf_counter() - t) * 1000)
        await limiter.close()
        out[name] = {"admit": admit, "charge": charge}
    return out


def start_server(port: int, key_file: Path, backend: str, redis_url: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "sluice_server", "--engine", "simulator", "--model", "sim",
            "--host", "127.0.0.1", "--port", str(port), "--api-key-file", str(key_file),
            "--rate-limit-rpm", "1000000000", "--rate-limit-tpm", "1000000000000",
            "--rate-limit-backend", backend, "--sim-ttft-ms", "0", "--sim-itl-ms", "0",
            "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(argv, env={**os.environ, "SLUICE_REDIS_URL": redis_url},
                            start_new_session=True)  # fmt: skip


async def bench_http(url: str, key_file: Path, n: int) -> dict[str, list[float]]:
    import httpx

    from sluice_bench.procs import free_port

    out = {}
    for backend in ("memory", "redis"):
        port = free_port()
        proc = start_server(port, key_file, backend, url)
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                for _ in range(600):
                    try:
                        if (await c.get("/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
                headers = {"Authorization": f"Bearer {KEY}"}
                body = {"prompt": "hi", "max_tokens": 1}
                times = []
                for i in range(n + 50):
                    t = time.perf_counter()
                    async with c.stream("POST", "/v1/stream", json=body, headers=headers) as r:
                        took = (time.perf_counter() - t) * 1000
                        assert r.status_code == 200, r.status_code
                        await r.aread()
                    if i >= 50:  # warm-up
                        times.append(took)
                out[backend] = times
        finally:
            proc.terminate()
            proc.wait(15)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="limiter calls per backend")
    parser.add_argument("--http-n", type=int, default=1000, help="HTTP requests per backend")
    args = parser.parse_args()
    if not available():
        sys.exit(MISSING)
    with tempfile.TemporaryDirectory(prefix="sluice-rl-bench-") as tmp:
        key_file = Path(tmp) / "keys"
        key_file.write_text(KEY + "\n")
        redis = RedisServer(Path(tmp) / "redis").start()
        try:
            lim = await bench_limiter(redis.url, args.n)
            print("limiter calls (in-process):")
            for backend, calls in lim.items():
                for op, ms in calls.items():
                    print("  " + summary(f"{backend} {op}", ms))
            if args.http_n:
                http = await bench_http(redis.url, key_file, args.http_n)
                print("HTTP, time to response headers (sequential, simulator engine):")
                for backend, ms in http.items():
                    print("  " + summary(backend, ms))
                for q in (0.5, 0.99):
                    added = pct(http["redis"], q) - pct(http["memory"], q)
                    print(f"  added by redis at p{int(q * 100)}: {added:+.3f} ms")
        finally:
            redis.stop()


if __name__ == "__main__":
    asyncio.run(main())
