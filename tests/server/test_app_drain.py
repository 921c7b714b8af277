"""SIGTERM drain with a real `sluice-server --model tiny` process: /ready turns 503 at once,
a new request is refused, the in-flight stream completes, and the process exits 0. Its
start-up phases on vLLM come first: every one exported, in order."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from pod_helpers import startup_phases
from sluice_server.startup import PHASES
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine, pytest.mark.slow]


def server_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("sluice-server")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sluice_server"]


async def ready_is(c: httpx.AsyncClient, status: int) -> bool:
    return (await c.get("/ready")).status_code == status


async def test_sigterm_drains_then_exits_zero(tiny_model_path):
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="sluice-drain-")
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "TMPDIR": scratch,
           "VLLM_CACHE_ROOT": os.path.join(scratch, "vllm"),
           "SLUICE_DRAIN_TIMEOUT_SECONDS": "60"}  # fmt: skip
    proc, log = start_server(port, env, os.path.join(scratch, "server.log"))
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:

            async def ready() -> bool:
                assert proc.poll() is None, _tail(log)  # not retried: fails at once
                return (await c.get("/ready")).status_code == 200

            # engine start: ~30 s alone, minutes on a busy box
            await eventually_async(ready, timeout=420, interval=0.5, retry_on=(httpx.TransportError,),
                                   message=lambda: "the server ready\n" + _tail(log))  # fmt: skip

            phases = startup_phases((await c.get("/metrics")).text)
            assert list(phases) == list(PHASES), phases  # the tiny model is a local folder
            assert list(phases.values()) == sorted(phases.values()), phases

            events: list[str] = []
            first = asyncio.Event()

            async def in_flight() -> None:
                body = {"prompt": "drain me", "max_tokens": 400}
                async with c.stream("POST", "/v1/stream", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line[5:].strip())
                            first.set()

            reader = asyncio.create_task(in_flight())
            await asyncio.wait_for(first.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            # /ready turns 503 at once
            await eventually_async(lambda: ready_is(c, 503), timeout=5, interval=0.02, retry_on=(),
                                   message="/ready to turn 503")  # fmt: skip
            refused = await c.post("/v1/stream", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "draining"
            assert not reader.done(), "the in-flight stream should still be running"
            await asyncio.wait_for(reader, 120)
        final = json.loads(events[-2])
        assert events[-1] == "[DONE]"
        assert final["finished"] is True and final["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == 400
        assert proc.wait(timeout=60) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def start_server(port: int, env: dict, log_path: str):
    log = open(log_path, "w+b")  # noqa: SIM115 - closed by the test
    proc = subprocess.Popen(
        [*server_cmd(), "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, log


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]
