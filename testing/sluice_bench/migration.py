"""Streams that outlive their pod, measured: `--streams` token streams of `--tokens` tokens
through `sluice-server router` (a process) on pod A, one of two simulator server processes
the router finds through a fake API server in this process; mid-stream pod A is killed
(SIGKILL) or frozen (SIGSTOP: a silent partition), and the router continues every stream on
pod B.

    python -m sluice_bench.migration [--streams 20] [--tokens 2000] [--write]

For each fault, and for the negative control (the model without `migration`, SIGKILL):
streams cut (no final event), streams whose event ids are not contiguous 0..n, and the
seam's added gap (p50, p99, max) as the router logged it (`the seam's gap was ... s`: the
broken stream's last bytes to its continuation's first). Prints the table of targets with
met / not met; `--write` puts it into docs/benchmarks.md (the `bench:migration` block).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn
from testkit.fake_pods_api import FakePodsApi
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

from sluice_bench import docblock

PY = sys.executable
MASTER = b"bench-continuation-master-key-0123456789"
LABELS = {"app": "chat"}
GAP = re.compile(r"the seam's gap was ([0-9.]+) s")


def model_key(master: bytes, namespace: str, name: str) -> bytes:
    from sluice_server.core.auth.routerkey import model_key as derive

    return derive(master, namespace, name)


class Started:
    """Counts the streams that have had their first token; `all` is set at `expected`."""

    def __init__(self, expected: int) -> None:
        self.expected, self.count, self.all = expected, 0, asyncio.Event()

    def one(self) -> None:
        self.count += 1
        if self.count >= self.expected:
            self.all.set()


async def one_stream(c: httpx.AsyncClient, url: str, tokens: int, started: Started) -> dict:
    """A token stream through the router: its event indexes, whether it ended whole."""
    indexes: list[int] = []
    done = False
    async with c.stream("POST", url + "/v1/stream", headers={"X-Sluice-Model": "bench/chat"},
                        json={"prompt": "hello river", "max_tokens": tokens}) as r:  # fmt: skip
        async for line in r.aiter_lines():
            if line.startswith('data: {"id"'):
                data = json.loads(line[6:])
                if "index" in data:
                    indexes.append(data["index"])
                    if len(indexes) == 1:
                        started.one()
                if data.get("finished"):
                    done = True
    return {"whole": done and indexes == list(range(len(indexes))), "done": done,
            "contiguous": indexes == list(range(len(indexes))), "events": len(indexes)}  # fmt: skip


async def scenario(args: argparse.Namespace, fault: str, migration: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"migration-{fault}-"))
    master, pod_key = work / "master", work / "pod-key"
    master.write_bytes(MASTER + b"\n")
    pod_key.write_bytes(model_key(MASTER, "bench", "chat") + b"\n")
    api = FakePodsApi()
    api_port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=api_port,
                                           log_level="warning", lifespan="off"))  # fmt: skip
    api_task = asyncio.create_task(server.serve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = free_port()
    procs: list[ManagedProcess] = []
    try:
        pods = {}
        for name, ip in (("pod-a", "127.0.0.1"), ("pod-b", "127.0.0.2")):
            pods[name] = ManagedProcess(name, [
                PY, "-m", "sluice_server", "--model", "sim", "--engine", "simulator",
                "--host", ip, "--port", str(port), "--sim-ttft-ms", "5",
                "--sim-itl-ms", str(args.itl_ms), "--heartbeat-seconds", "1",
                "--max-concurrent-streams", str(args.streams * 2), "--continuation-key-file", str(pod_key),
                "--log-level", "warning", "--access-log", "false"], work, env).start()  # fmt: skip
            procs.append(pods[name])
        for name, ip in (("pod-a", "127.0.0.1"), ("pod-b", "127.0.0.2")):
            await asyncio.to_thread(wait_http, f"http://{ip}:{port}/ready", timeout=60,
                                    process=pods[name])  # fmt: skip
        api.put("pod-a", "127.0.0.1", LABELS, namespace="bench")
        api.put("pod-b", "127.0.0.2", LABELS, namespace="bench", ready=False)
        entry = {"host": "chat.bench.invalid", "keepaliveSeconds": 15, "holdTimeoutSeconds": 60,
                 "pods": {"namespace": "bench", "selector": LABELS, "port": port}}  # fmt: skip
        if migration:
            entry["migration"] = {"maxMigrations": 3, "stallSeconds": args.stall_seconds}
        (work / "models.json").write_text(json.dumps({"bench/chat": entry}))
        (work / "sa").mkdir()
        (work / "sa" / "token").write_text("bench")
        rport = free_port()
        router = ManagedProcess("router", [
            PY, "-m", "sluice_server", "router", "--models-file", str(work / "models.json"),
            "--host", "127.0.0.1", "--port", str(rport), "--kube-api-url",
            f"http://127.0.0.1:{api_port}", "--service-account-dir", str(work / "sa"),
            "--continuation-key-file", str(master), "--log-level", "info"], work, env).start()  # fmt: skip
        procs.append(router)
        url = f"http://127.0.0.1:{rport}"
        await asyncio.to_thread(wait_http, url + "/ready", timeout=60, process=router)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        started = Started(args.streams)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            await one_stream(c, url, 4, Started(1))  # warm: the router knows pod A
            tasks = [asyncio.ensure_future(one_stream(c, url, args.tokens, started))
                     for _ in range(args.streams)]  # fmt: skip
            await asyncio.wait_for(started.all.wait(), 120)
            await asyncio.sleep(args.tokens * args.itl_ms / 1000 / 4)  # a quarter in
            api.ready("pod-b", True, namespace="bench")
            await asyncio.sleep(1.5)  # the router's watch sees it
            pid = pods["pod-a"].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
            broke_at = time.monotonic()
            results = await asyncio.gather(*tasks)
            ended = time.monotonic() - broke_at
            if fault == "SIGSTOP":
                os.kill(pid, signal.SIGKILL)
        log = router.log_path.read_text(errors="replace")
        gaps = sorted(float(g) for g in GAP.findall(log))
    finally:
        for p in procs:
            p.stop()
        server.should_exit = True
        await api_task
    return {
        "fault": fault, "migration": migration, "streams": args.streams,
        "tokens": args.tokens, "cut": sum(not r["done"] for r in results),
        "not_contiguous": sum(not r["contiguous"] for r in results),
        "whole": sum(r["whole"] for r in results), "seams": len(gaps),
        "gap_p50_s": round(statistics.median(gaps), 3) if gaps else None,
        "gap_p99_s": round(gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 3) if gaps else None,
        "gap_max_s": round(gaps[-1], 3) if gaps else None,
        "after_break_s": round(ended, 1),
    }  # fmt: skip


def target_rows(runs: list[dict]) -> list[tuple[str, str, bool]]:
    rows = []
    for r in runs:
        if not r["migration"]:
            continue
        what = "killed (SIGKILL)" if r["fault"] == "SIGKILL" else "frozen (SIGSTOP)"
        rows.append((
            f"{r['streams']} streams of {r['tokens']} tokens on a pod {what} mid-stream: "
            "0 streams cut, every stream's event ids contiguous, one final event",
            f"{r['cut']} cut, {r['not_contiguous']} not contiguous, {r['whole']} whole; "
            f"seam's gap p50 {r['gap_p50_s']} s, p99 {r['gap_p99_s']} s, max {r['gap_max_s']} s "
            f"({r['seams']} seams)",
            # ... and the fault hit streams in flight (a run too short for it proves nothing)
            r["cut"] == 0 and r["not_contiguous"] == 0 and r["whole"] == r["streams"]
            and r["seams"] > 0,
        ))  # fmt: skip
    return rows


def table(runs: list[dict]) -> str:
    text = docblock.targets_table(target_rows(runs))
    control = [r for r in runs if not r["migration"]]
    notes = ""
    if control:
        c = control[0]
        notes = (
            f"\n\nNegative control, the same SIGKILL on a model without `migration`: "
            f"{c['cut']} of {c['streams']} streams cut.\n"
        )
    return text + notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--itl-ms", type=float, default=4.0)
    parser.add_argument("--stall-seconds", type=float, default=3.0)
    parser.add_argument("--write", action="store_true", help="write the table into docs/")
    args = parser.parse_args()
    runs = []
    for fault, migration in (("SIGKILL", True), ("SIGSTOP", True), ("SIGKILL", False)):
        runs.append(asyncio.run(scenario(args, fault, migration)))
        print(json.dumps(runs[-1]), flush=True)
    text = table(runs)
    print(text)
    if args.write:
        docblock.write("migration", "testing/sluice_bench/migration.py --write", text)


if __name__ == "__main__":
    main()
