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


def _pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves only that one thread);
    threads started later inherit the mask of the thread that starts them."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass  # a thread that just ended


def separate_engines(fronts: list[Proc]) -> dict:
    """Keep vLLM's engine processes off the cores the HTTP servers and clients use.

    vLLM's CPU build pins each engine's model worker (`VLLM::Worker`) to its compute cores
    but leaves the engine-core process (`VLLM::EngineCore`) free to run anywhere, and that
    process busy-polls the worker's shared-memory queue (`sched_yield` for 1 s after every
    message, vLLM's `SpinCondition`). On a 2-core machine it then shares the second core
    with the API server and the load generator and starves them: the load generator
    waited up to 1.5 s in the run queue while tokens piled up server-side (bursts after
    ~0.3-3 s, then ITL 0; the "1-second TTFT clusters" of earlier runs). Moving every
    engine-core process next to its worker, and every front end (servers' main processes,
    the bare-engine process, load generators) onto the other cores, gives every system the
    same layout and removes the stalls. Returns the layout used ({} if there is nothing to
    separate, e.g. one core)."""
    import psutil

    engine_cores: list = []
    engine_cpus: set[int] = set()
    for front in fronts:
        for child in psutil.Process(front.pid).children(recursive=True):
            name = child.name()
            if "Worker" in name:
                engine_cpus |= set(child.cpu_affinity())
            elif "EngineCore" in name:
                engine_cores.append(child.pid)
    front_cpus = set(os.sched_getaffinity(0)) - engine_cpus
    if not engine_cpus or not front_cpus:
        return {}
    for pid in engine_cores:
        _pin_threads(pid, engine_cpus)
    for front in fronts:
        _pin_threads(front.pid, front_cpus)
    return {"engine_cpus": sorted(engine_cpus), "front_cpus": sorted(front_cpus)}


class Proc:
    """A child process in its own session, output to a log file (started on `cpus` when
    given: its threads and children inherit them)."""

    def __init__(
        self, name: str, argv: list[str], env: dict, log_dir: Path, cpus=None, **popen
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        popen.setdefault("stdout", self._log)
        if cpus:
            popen["preexec_fn"] = lambda: os.sched_setaffinity(0, cpus)
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

    def __init__(self, name, argv, env, log_dir, cpus=None) -> None:
        super().__init__(
            name, argv, env, log_dir, cpus, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
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
