"""Rate limits shared by every replica through a real redis-server, on the simulator engine.

Two server processes share one key: with `--rate-limit-backend redis` the requests and
tokens admitted across both match the key's limits (token-bucket arithmetic, measured
window); with `memory` the same load gets twice as much through (the negative control).
Then Redis is paused and stopped mid-way: each failure mode does what its flag says, no
request waits longer than the Redis timeout, and limiting resumes once Redis is back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from app_helpers import serve_simulator
from sluice_server.core.auth.identity import Plan
from sluice_server.core.errors import ApiError
from sluice_server.core.limits.ratelimit import RedisLimiter
from sluice_server.core.telemetry.metrics import Metrics
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.external]  # Redis

KEY = "sk-shared-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "two words"  # the simulator counts words: 2 prompt tokens
MAX_TOKENS = 8
PER_REQUEST = 2 + MAX_TOKENS
WINDOW_S = 6.0
WINDOW_LIMIT_S = 90.0  # a window that never reaches the limit fails after this


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(KEY + "\n")
    return path


# -- the limiter itself against Redis: the memory backend's arithmetic ----------------------


async def test_redis_buckets_match_the_memory_semantics(redis_server):
    rl = RedisLimiter(redis_server.url, "m", Metrics("m"), "open", 0.5)
    try:
        plan = Plan(rpm=3)
        for _ in range(3):
            await rl.admit("k", plan)
        with pytest.raises(ApiError) as e:
            await rl.admit("k", plan)
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "20"
        assert "requests per minute" in e.value.message
        await rl.admit("other", plan)  # per principal

        tokens = Plan(tpm=600)  # 10 tokens/s
        await rl.admit("t", tokens)
        await rl.charge("t", tokens, 650)  # 50 in debt
        with pytest.raises(ApiError) as e:
            await rl.admit("t", tokens)
        assert e.value.headers["Retry-After"] == "6"  # (50 + 1) / 10 -> 5.1 s -> 6
        assert "tokens per minute" in e.value.message
    finally:
        await rl.close()


# -- two server processes, one key --------------------------------------------------------


def start_server(port: int, key_file, backend: str, redis_url: str, **limits) -> subprocess.Popen:
    argv = [sys.executable, "-m", "sluice_server", "--engine", "simulator", "--model", "sim",
            "--host", "127.0.0.1", "--port", str(port), "--api-key-file", str(key_file),
            "--rate-limit-backend", backend, "--sim-ttft-ms", "0", "--sim-itl-ms", "0",
            "--log-level", "warning"]  # fmt: skip
    for name, value in limits.items():
        argv += [f"--rate-limit-{name}", str(value)]
    # As in a pod: the URL in a file (the operator mounts the Secret's key there).
    url_file = Path(key_file).parent / "redis-url"
    url_file.write_text(redis_url + "\n")
    argv += ["--redis-url-file", str(url_file)]
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    return subprocess.Popen(argv, env=env, start_new_session=True)


async def wait_ready(c: httpx.AsyncClient, url: str, proc: subprocess.Popen) -> None:
    async def ready() -> bool:
        if proc.poll() is not None:  # not retried: fails at once
            raise RuntimeError(f"server exited with {proc.returncode}")
        return (await c.get(url + "/ready")).status_code == 200

    await eventually_async(ready, timeout=60, interval=0.1, retry_on=(httpx.TransportError,),
                           message=f"server at {url} ready")  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def two_servers(redis_server, key_file):
    """`await start(backend, rpm=..., tpm=...) -> [url_a, url_b]`; stopped by PID."""
    procs: list[subprocess.Popen] = []

    async def start(backend: str, **limits) -> list[str]:
        urls = []
        async with httpx.AsyncClient(timeout=5) as c:
            for _ in range(2):
                port = free_port()
                proc = start_server(port, key_file, backend, redis_server.url, **limits)
                procs.append(proc)
                urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(urls, procs[-2:], strict=True):
                await wait_ready(c, url, proc)
        return urls

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Window:
    """When requests went out and came back, to bound the refill the buckets granted: at
    least what refilled between the first answer and the last refused request, at most
    what refilled between the first request and the last answer."""

    def __init__(self) -> None:
        self.first_sent = self.first_done = self.last_refused = self.last_done = None

    async def send(self, c: httpx.AsyncClient, url: str) -> int | None:
        """Tokens charged for an admitted request (prompt + completion), None if refused."""
        sent = time.monotonic()
        self.first_sent = self.first_sent or sent
        r = await c.post(url + "/v1/stream", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS},
                         headers=AUTH)  # fmt: skip
        self.last_done = time.monotonic()
        self.first_done = self.first_done or self.last_done
        if r.status_code == 429:
            self.last_refused = max(self.last_refused or sent, sent)
            return None
        assert r.status_code == 200, r.text
        final = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")][-1]
        usage = json.loads(final)["usage"]
        return usage["prompt_tokens"] + usage["completion_tokens"]

    def done(self) -> bool:
        """The window is over: WINDOW_S long, and the limit was reached in it (a request was
        refused). A loaded machine sends fewer requests a second, so that may take longer;
        the refill bounds are taken from the window's own times either way."""
        return (self.last_refused is not None and self.first_sent is not None
                and time.monotonic() - self.first_sent >= WINDOW_S)  # fmt: skip

    def refill(self, per_minute: int) -> tuple[float, float]:
        assert self.last_refused is not None, "the load never reached the limit"
        low = max(0.0, self.last_refused - self.first_done) * per_minute / 60
        return low, (self.last_done - self.first_sent) * per_minute / 60


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, replicas_limited_alone", [("redis", 1), ("memory", 2)])
async def test_requests_per_minute_across_two_replicas(two_servers, backend,
                                                       replicas_limited_alone):  # fmt: skip
    rpm, n = 120, replicas_limited_alone
    urls = await two_servers(backend, rpm=rpm)
    admitted, w = 0, Window()
    async with httpx.AsyncClient(timeout=10) as c:

        async def both_at_once() -> bool:  # both replicas at once, far over the limit
            nonlocal admitted
            results = await asyncio.gather(*(w.send(c, u) for u in urls))
            admitted += sum(r is not None for r in results)
            return w.done()

        await eventually_async(both_at_once, timeout=WINDOW_LIMIT_S, interval=0, retry_on=(),
                               message="the load to reach the limit")  # fmt: skip
    low, high = w.refill(rpm)
    print(f"{backend}: {admitted} requests admitted; the bucket arithmetic says "
          f"{n} x ({rpm} + {low:.2f}..{high:.2f})")  # fmt: skip
    assert n * (rpm + low - 1) <= admitted <= n * (rpm + high + 1), (admitted, low, high)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, replicas_limited_alone", [("redis", 1), ("memory", 2)])
async def test_tokens_per_minute_across_two_replicas(two_servers, backend,
                                                     replicas_limited_alone):  # fmt: skip
    tpm, n = 300, replicas_limited_alone
    urls = await two_servers(backend, tpm=tpm)
    charged, w, i = 0, Window(), 0
    async with httpx.AsyncClient(timeout=10) as c:

        async def one_stream() -> bool:  # one stream at a time, alternating replicas
            nonlocal charged, i
            charged += await w.send(c, urls[i % 2]) or 0
            i += 1
            return w.done()

        await eventually_async(one_stream, timeout=WINDOW_LIMIT_S, interval=0, retry_on=(),
                               message="the load to reach the limit")  # fmt: skip
    low, high = w.refill(tpm)
    print(f"{backend}: {charged} tokens charged; the bucket arithmetic says "
          f"{n} x ({tpm} + {low:.2f}..{high:.2f}), requests of {PER_REQUEST} tokens")  # fmt: skip
    # Admitted while the bucket holds a token, so the last admitted request may overdraw it
    # by up to one request's tokens.
    assert n * (tpm + low - 1) <= charged <= n * (tpm + high + PER_REQUEST), (charged, low, high)


# -- Redis goes away mid-way ---------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=0, itl_ms=0)
    yield engine
    await engine.shutdown()


async def timed(c: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
    t = time.monotonic()
    r = await c.post("/v1/stream", json={"prompt": PROMPT, "max_tokens": 1}, headers=AUTH)
    return r.status_code, time.monotonic() - t, r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_redis_outage_follows_the_failure_mode(sim, redis_server, key_file, mode, caplog):
    caplog.set_level(logging.INFO)
    timeout = 0.25
    async with serve_simulator(sim, api_key_file=key_file, rate_limit_rpm=3,
                               rate_limit_backend="redis", redis_url=redis_server.url,
                               rate_limit_failure_mode=mode,
                               redis_timeout_seconds=timeout) as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert [(await timed(c))[0] for _ in range(4)] == [200, 200, 200, 429]

            outage = 503 if mode == "closed" else 200
            # A Redis that accepts connections and never answers, then one that is gone.
            for phase in ("paused", "stopped"):
                if phase == "paused":
                    redis_server.pause()
                else:
                    redis_server.stop()
                for _ in range(5):
                    status, took, r = await timed(c)
                    assert status == outage, r.text
                    assert took < 3 * timeout + 0.5, f"{phase}: waited {took:.2f} s on Redis"
                    if status == 503:
                        assert int(r.headers["retry-after"]) >= 1
                        assert r.json()["error"]["code"] == "rate_limit_unavailable"
                if phase == "paused":
                    redis_server.resume()

            redis_server.start()  # same port, empty: the key's bucket starts full again
            await asyncio.sleep(1.2)  # the limiter leaves Redis alone for 1 s after a failure
            assert [(await timed(c))[0] for _ in range(4)] == [200, 200, 200, 429]
            metrics = (await c.get("/metrics")).text

    errors = [ln for ln in metrics.splitlines()
              if ln.startswith('sluice_rate_limit_backend_errors_total{model="sim",op="admit"}')]  # fmt: skip
    assert errors and float(errors[0].split()[-1]) >= 10, errors
    if mode == "closed":
        assert 'protocol="sse",reason="limiter_unavailable"} 10.0' in metrics
    lines = [
        r.getMessage() for r in caplog.records if r.name == "sluice_server.core.limits.ratelimit"
    ]
    assert len(lines) == 2, lines  # one line for the whole outage (rate limited), one after
    assert f"failing {mode}" in lines[0] and "reachable again" in lines[1]
