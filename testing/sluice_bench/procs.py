"""Processes the benchmark starts: servers, the bare-engine worker, the load generator.

Each is a `testkit.process.ManagedProcess` (its own session and process group), so stopping
it also stops the engine-core processes vLLM spawns; `ProcGroup` stops everything it
started, newest first, on exit. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TypeVar

from testkit.cpus import engine_processes, separate
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

PY = sys.executable
P = TypeVar("P", bound=ManagedProcess)
# How long a server or worker may take to exit on SIGTERM (vLLM shuts its engine down).
STOP_GRACE_S = 15.0


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


def separate_engines(fronts: list[ManagedProcess]) -> dict:
    """Keep vLLM's engine processes off the cores the HTTP servers and clients use
    (`testkit.cpus`: why, and what it removes): every engine-core process under `fronts`
    next to its model worker, every front onto the other cores. Returns the layout used
    ({} if there is nothing to separate, e.g. one core)."""
    cores: list[int] = []
    engine_cpus: set[int] = set()
    for front in fronts:
        found, cpus = engine_processes(front.started().pid)
        cores += found
        engine_cpus |= cpus
    return separate(cores, engine_cpus, [front.started().pid for front in fronts])


class Server(ManagedProcess):
    """An HTTP server, started at once; `wait_ready` polls `ready_path` for a 200.

    Its port is picked before it binds (`free_port`), and another process may take it
    meanwhile (vLLM's engines take loopback ports of their own as they start): a server
    that exits because its address is in use starts again on a fresh port (`argv`'s
    `--port` value), up to `BIND_TRIES` times; `port` and `base_url` follow."""

    BIND_TRIES = 3

    def __init__(self, name, argv, env, log_dir, port: int, ready_path: str, cpus=None) -> None:
        super().__init__(name, argv, log_dir, env, cpus=cpus)
        self._use(port)
        self.ready_path = ready_path
        self.start()

    def _use(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def start(self) -> Server:
        self._log_mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        super().start()
        return self

    def _lost_its_port(self) -> bool:
        if self.alive():
            return False
        with self.log_path.open("rb") as log:
            log.seek(self._log_mark)
            return b"address already in use" in log.read().lower()

    def wait_ready(self, timeout: float) -> None:
        for attempt in range(1, self.BIND_TRIES + 1):
            try:
                wait_http(self.base_url + self.ready_path, timeout=timeout, process=self,
                          interval=0.5)  # fmt: skip
                return
            except RuntimeError:
                if attempt == self.BIND_TRIES or not self._lost_its_port():
                    raise
            self._use(free_port())
            self.argv[self.argv.index("--port") + 1] = str(self.port)
            self.start()


class Worker(ManagedProcess):
    """JSON lines over stdin/stdout (loadgen.py, bare_engine.py, fanout.py), started at once
    (on `cpus` when given)."""

    def __init__(self, name, argv, env, log_dir, cpus=None) -> None:
        super().__init__(name, argv, log_dir, env, cpus=cpus, pipes=True)
        self._lock = threading.Lock()
        self.start()

    def call(self, cmd: dict, timeout: float = 600.0) -> dict:
        with self._lock:
            stdin, stdout = self.pipe_ends()
            stdin.write((json.dumps(cmd) + "\n").encode())
            stdin.flush()
            box: list[bytes] = []
            reader = threading.Thread(target=lambda: box.append(stdout.readline()))
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

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Close stdin first (a worker's clean exit), then stop the group."""
        try:
            if self.proc is not None and self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
                self.proc.wait(3)
        except (OSError, subprocess.TimeoutExpired):
            pass
        super().stop(timeout)


class ProcGroup:
    """Stops every process it started, newest first, however the run ends."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []

    def add(self, proc: P) -> P:
        self.procs.append(proc)
        return proc

    def stop(self, proc: ManagedProcess) -> None:
        proc.stop(STOP_GRACE_S)
        if proc in self.procs:
            self.procs.remove(proc)

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.stop(STOP_GRACE_S)
        self.procs.clear()
