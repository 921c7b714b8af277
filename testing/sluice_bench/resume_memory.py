"""Extra memory per resumable token stream: `python -m sluice_bench.resume_memory`.

The same N dropped streams on the simulator engine (one server in this process), once with
resume off (each aborted at once) and once with a long grace window (each detached and
fully generated into its buffer, waiting for a reconnect); the difference in traced
Python memory after both settle, per stream, is what a resumable stream costs.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc

import httpx
from sluice_server.engine.simulator import SimulatorEngine
from testkit.repo import ROOT

# The server suite's `serve_simulator`: the app on a free port, configured as the tests run it
# (tests/server is on sys.path from here on, not on mypy's path).
sys.path.insert(0, str(ROOT / "tests" / "server"))
from app_helpers import serve_simulator  # type: ignore[import-not-found]  # noqa: E402

N, TOKENS = 200, 200


async def drop_after(url: str, n: int) -> None:
    c = httpx.AsyncClient(base_url=url, timeout=60)
    body = {"prompt": "p", "max_tokens": TOKENS, "ignore_eos": True}
    async with c.stream("POST", "/v1/stream", json=body) as r:
        got = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                got += 1
                if got >= n:
                    break
        await c.aclose()


async def held_bytes(grace: float) -> int:
    eng = SimulatorEngine(model_name="sim", ttft_ms=1, itl_ms=2, ttft_per_stream_ms=0, jitter=0)
    async with serve_simulator(eng, resume_grace_seconds=grace,
                               max_concurrent_streams=1000) as url:  # fmt: skip
        await drop_after(url, 3)
        await asyncio.sleep(1.0)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        await asyncio.gather(*(drop_after(url, 5) for _ in range(N)))
        await asyncio.sleep(TOKENS * 0.002 + 2.0)  # every answer fully generated meanwhile
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    await eng.shutdown()
    return held


async def main() -> None:
    tracemalloc.start()
    off, on = await held_bytes(0), await held_bytes(120)
    print(f"{N} dropped streams of {TOKENS} tokens: resume off {off / N:.0f} B/stream held, "
          f"resume on {on / N:.0f} B/stream; extra per resumable stream "
          f"{(on - off) / N / 1024:.1f} KiB")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
