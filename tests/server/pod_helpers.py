"""A pod with several front-end workers (`--api-workers N`) as a real process tree for the
tests: the supervisor started with testkit's `ManagedProcess`, its worker pids, and the
pod's `/metrics` as numbers."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import psutil
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

# The supervisor with per-worker limits: the negative control of the shared-limit tests.
PER_WORKER_LIMITS = (
    "import sys; from sluice_server.settings import parse_settings; "
    "from sluice_server.supervisor import run_pod; "
    "sys.exit(run_pod(parse_settings(sys.argv[1:]), share_limits=False))"
)


def start_pod(log_dir: Path, *flags: str, workers: int = 2, shared: bool = True,
              env: dict | None = None, timeout: float = 60) -> tuple[ManagedProcess, str]:  # fmt: skip
    """Start the supervisor (`python -m sluice_server`) on a free port and wait for /ready."""
    port = free_port()
    head = ["-m", "sluice_server"] if shared else ["-c", PER_WORKER_LIMITS]
    argv = [sys.executable, *head, "--host", "127.0.0.1", "--port", str(port),
            "--api-workers", str(workers), *flags]  # fmt: skip
    name = f"pod-{port}"
    proc = ManagedProcess(name, argv, log_dir, env=env).start()
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


async def scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return r.text


def client(url: str) -> httpx.AsyncClient:
    """A new connection per request: a kept-alive one would stay with its worker."""
    return httpx.AsyncClient(base_url=url, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))  # fmt: skip


async def read_stream(c: httpx.AsyncClient, max_tokens: int, key: str | None = None) -> dict:
    """One /v1/stream read to its end: status, worker, token events, last payload."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "fan out", "max_tokens": max_tokens, "ignore_eos": True}
    out = {"tokens": 0, "last": None, "done": False}
    async with c.stream("POST", "/v1/stream", json=body, headers=headers) as r:
        out["status"], out["worker"] = r.status_code, r.headers.get("x-sluice-worker")
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
    return out
