"""`python -m sluice_server.demo` (`make demo`): the whole path on a laptop CPU.

Makes the tiny local model, starts `sluice-server --model tiny` as a child process on a
free loopback port, waits for `/ready`, streams one chat answer over SSE and one over
WebSocket to the terminal as tokens arrive (printing TTFT and tokens/s for each), then
stops the server with SIGTERM (its graceful drain) and reports its exit code. It prints the
browser playground's URL; with `--keep` (`make demo KEEP=1`) the server stays up for a
person to open it, until Ctrl-C.

The tiny model's weights are random: the answer is gibberish, the streaming is real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

QUESTION = "Tell me a short story about a river."
READY_TIMEOUT_S = 300.0  # engine start is 20-35 s on 2 idle cores; minutes on a busy one


@dataclass
class Result:
    ttft: float  # request sent -> first token printed
    total: float  # request sent -> final message
    tokens: int  # completion tokens (from the server's usage)

    def line(self) -> str:
        decode = self.total - self.ttft
        rate = (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else float("nan")
        return (
            f"TTFT {self.ttft * 1e3:.0f} ms, {self.tokens} tokens in {self.total:.2f} s, "
            f"{rate:.0f} tokens/s after the first"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, scratch: Path, log_path: Path, max_tokens: int) -> subprocess.Popen:
    env = dict(os.environ)
    # Engine sockets on loopback; ZMQ socket files and caches in our scratch folder.
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CACHE_ROOT", str(scratch / "vllm-cache"))
    env["TMPDIR"] = str(scratch)
    cmd = [
        sys.executable,
        "-m",
        "sluice_server",
        "--model",
        "tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max(512, max_tokens + 128)),
        "--log-level",
        "warning",
    ]
    log = log_path.open("wb")
    try:
        # Own process group: a forced stop also takes vLLM's engine-core and worker children.
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    finally:
        log.close()  # the child holds its own descriptor


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=2) as client:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
            try:
                if (await client.get(base + "/ready")).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s")


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


async def stream_sse(base: str, body: dict) -> Result:
    """A minimal SSE reader (one `data:` line per event in our stream)."""
    import httpx

    first, event = None, "message"
    async with httpx.AsyncClient(timeout=60) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", base + "/v1/stream", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if event == "error":
                    raise RuntimeError(f"stream error: {data}")
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg["finished"]:
                    return Result(
                        first or 0.0, time.perf_counter() - t0, msg["usage"]["completion_tokens"]
                    )
                _emit(msg["token"])
                first = first or time.perf_counter() - t0
    raise RuntimeError("SSE stream ended without a final event")


async def stream_ws(base: str, body: dict) -> Result:
    import websockets

    first = None
    params = {k: v for k, v in body.items() if k != "messages"}
    async with websockets.connect(base.replace("http", "ws", 1) + "/ws/stream") as ws:
        t0 = time.perf_counter()
        await ws.send(json.dumps({"id": "demo", "messages": body["messages"], "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if msg.get("type") == "error":
                raise RuntimeError(f"stream error: {msg}")
            if msg["finished"]:
                return Result(
                    first or 0.0, time.perf_counter() - t0, msg["usage"]["completion_tokens"]
                )
            _emit(msg["token"])
            first = first or time.perf_counter() - t0


def stop_server(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM = graceful drain; the server exits 0 once drained. Past `timeout_s` (or
    while it is still starting and cannot drain) the whole process group is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return proc.returncode


async def run(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> None:
    took = await wait_ready(base, proc, args.ready_timeout)
    print(f"server ready in {took:.1f} s at {base}")
    body = {
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    print(f"\nuser> {args.prompt}\n\n--- SSE (POST /v1/stream) ---")
    sse = await stream_sse(base, body)
    print(f"\n[SSE] {sse.line()}\n\n--- WebSocket (/ws/stream) ---")
    ws = await stream_ws(base, body)
    print(f"\n[WebSocket] {ws.line()}")
    print(f"\nplayground (chat in a browser): {base}/playground")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice_server.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--prompt", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the server running (open the playground) until Ctrl-C",
    )
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    args = parser.parse_args(argv)

    from .engine.tiny_model import ensure_tiny_model

    t0 = time.perf_counter()
    print(f"tiny model: {ensure_tiny_model()} ({time.perf_counter() - t0:.1f} s)")
    # vLLM puts ZMQ socket files here; their paths must fit in 107 bytes (sun_path).
    base = tempfile.gettempdir()
    scratch = Path(tempfile.mkdtemp(prefix="sluice-demo-", dir=base if len(base) <= 40 else "/tmp"))
    log_path = scratch / "server.log"
    port = args.port or free_port()
    print(f"starting sluice-server --model tiny on 127.0.0.1:{port} (log: {log_path})")
    proc = start_server(port, scratch, log_path, args.max_tokens)
    ok = False
    try:
        asyncio.run(run(args, f"http://127.0.0.1:{port}", proc))
        ok = True
        if args.keep:
            print("server kept running (--keep); Ctrl-C stops it", flush=True)
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
    except (Exception, KeyboardInterrupt) as e:
        print(
            f"\ndemo failed: {type(e).__name__}: {e}\n--- server log (tail) ---\n{tail(log_path)}",
            file=sys.stderr,
        )
    finally:
        code = stop_server(proc, timeout_s=60 if ok else 15)
        print(f"server stopped (SIGTERM, graceful drain), exit code {code}")
        if ok and code == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"server log kept: {log_path}", file=sys.stderr)
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
