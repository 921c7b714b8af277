"""Processes the benchmark starts: servers, the bare-engine worker, the load generator.

Each runs in its own session (process group) so stopping it also stops the engine-core
processes vLLM spawns; `ProcGroup` stops everything it started, newest first, on exit.
Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PY = sys.executable
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(scratch: Path) -> dict[str, str]:
    """vLLM on this CPU machine: loopback sockets, scratch for ZMQ files and caches."""
    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        TMPDIR=str(scratch),
        VLLM_CACHE_ROOT=str(scratch / "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


class Proc:
    """A child process in its own session, output to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path, **popen) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        popen.setdefault("stdout", self._log)
        self.p = subprocess.Popen(argv, env=env, stderr=self._log, start_new_session=True, **popen)

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (engine-core children): make sure it is gone.
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Server(Proc):
    def __init__(self, name, argv, env, log_dir, port: int, ready_path: str) -> None:
        super().__init__(name, argv, env, log_dir)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")


class Worker(Proc):
    """JSON lines over stdin/stdout (loadgen.py, bare_engine.py, fanout.py)."""

    def __init__(self, name, argv, env, log_dir) -> None:
        super().__init__(name, argv, env, log_dir, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()

    def call(self, cmd: dict, timeout: float = 600.0) -> dict:
        with self._lock:
            self.p.stdin.write((json.dumps(cmd) + "\n").encode())
            self.p.stdin.flush()
            box: list[bytes] = []
            reader = threading.Thread(target=lambda: box.append(self.p.stdout.readline()))
            reader.daemon = True
            reader.start()
            reader.join(timeout)
            if not box:
                raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s")
            if not box[0]:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            result = json.loads(box[0])
        if "fatal" in result:
            raise RuntimeError(f"{self.name}: {result['fatal']}")
        return result

    def stop(self, grace: float = 15.0) -> None:
        try:
            if self.p.stdin:
                self.p.stdin.close()
            self.p.wait(3)
        except (OSError, subprocess.TimeoutExpired):
            pass
        super().stop(grace)


class ProcGroup:
    """Stops every process it started, newest first, however the run ends."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
