"""The pod's supervisor process with `--api-workers N` (N > 1): N front-end workers on one
listening socket and one engine, stopped together and failing together.

What it does, in order:

1. a fresh `PROMETHEUS_MULTIPROC_DIR` (every worker's metrics are files there; one scrape
   of any worker sums them: `core/telemetry/metrics.py`), and the pod's shared memory (stream slots,
   rate-limit buckets, one readiness flag per worker: `core/limits/shared_memory.py`);
2. the listening socket and the workers: on vLLM with vLLM's own multi-API-server
   machinery (`engine/vllm_pod.py`: one engine core, N front-end clients of it), on the
   simulator N spawned processes, each with its own simulator;
3. waits. A worker that dies (any non-zero exit: a crash, the OOM killer, SIGKILL) or a
   dead engine core marks every readiness flag down (`/ready` 503 from any worker at
   once), stops the other workers (they drain), and the supervisor exits 1, so the
   kubelet restarts the container (vLLM's `wait_for_completion_or_failure` semantics);
4. on SIGTERM (or SIGINT) forwards SIGTERM to every worker, which drains as one process
   does (`serve.py`), waits up to the drain timeout plus a margin, and exits 0 when every
   worker did. A second signal kills the workers at once (exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import connection

from .core.limits.shared_memory import PodState, QueueShape
from .serve import configure_logging, serve_worker
from .settings import Settings

log = logging.getLogger("sluice_server.supervisor")

# Past the drain timeout: error events (5 s), uvicorn's graceful shutdown (5 s), engine exit.
STOP_MARGIN_SECONDS = 20.0


@dataclass
class Workers:
    """The running workers, however they were launched (`engine/vllm_pod.py` yields the
    same three): `wait()` returns when all exited 0 and raises RuntimeError when one died;
    `shutdown(timeout)` SIGTERMs the rest, waits, then kills."""

    processes: list
    wait: Callable[[], None]
    shutdown: Callable[[float], None]


@dataclass
class _Signals:
    stopping: bool = False
    forced: bool = False
    processes: list = field(default_factory=list)

    def handle(self, signum: int, frame) -> None:
        if not self.stopping:
            self.stopping = True
            log.info("signal %d: stopping %d workers (each drains)", signum, len(self.processes))
            raise SystemExit  # leaves the wait; the shutdown forwards SIGTERM
        if not self.forced:
            self.forced = True
            log.warning("second signal (%d): killing the workers", signum)
            for p in self.processes:
                if p.is_alive():
                    p.kill()


def run_pod(settings: Settings, share_limits: bool = True) -> int:
    """Run the pod's workers until they stop; the process's exit code. `share_limits`
    False (the tests' negative control only) gives each worker limits of its own."""
    configure_logging(settings)
    signals = _Signals()
    signal.signal(signal.SIGTERM, signals.handle)
    signal.signal(signal.SIGINT, signals.handle)
    state = PodState(settings.api_workers, share_limits=share_limits, queue=QueueShape.of(settings))
    target = partial(serve_worker, settings, state)
    failed = False
    with _metrics_dir() as metrics_dir:
        try:
            with _launch(settings, target) as workers:
                signals.processes = workers.processes
                try:
                    workers.wait()
                except RuntimeError as e:  # a worker (or the engine core) died
                    failed = True
                    log.error("%s: the pod is not ready and stops", e)
                except SystemExit:
                    pass  # our first signal
                finally:
                    signals.stopping = True  # a signal from here on kills, never interrupts
                    state.not_ready()
                    workers.shutdown(settings.drain_timeout_seconds + STOP_MARGIN_SECONDS)
                    _mark_dead(workers.processes, metrics_dir)
        except SystemExit:
            return 0  # a signal before the workers were up
        codes = [p.exitcode for p in workers.processes]
    if failed or signals.forced or any(c != 0 for c in codes):
        log.error("workers exited with %s", codes)
        return 1
    log.info("all %d workers drained and exited", len(codes))
    return 0


def _launch(settings: Settings, target: Callable):
    if settings.engine == "simulator":
        return simulator_workers(settings, target)
    from .engine import resolve_model
    from .engine.vllm_pod import vllm_workers

    return vllm_workers(settings, resolve_model(settings.model), target)


@contextlib.contextmanager
def _metrics_dir() -> Iterator[str]:
    """prometheus_client's multiprocess folder, empty at start (stale files from an earlier
    run would add to the totals). Set before any worker starts: prometheus_client picks
    its mode when it is imported. One we made is removed at the end."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = given or tempfile.mkdtemp(prefix="sluice-metrics-")
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.unlink(os.path.join(path, name))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def _mark_dead(processes: list, path: str) -> None:
    """Drop dead workers' live gauges (`sluice_active_streams` is summed over live ones)."""
    from prometheus_client import multiprocess

    for p in processes:
        if p.pid is not None and not p.is_alive():
            multiprocess.mark_process_dead(p.pid, path)


def listen_socket(host: str, port: int) -> socket.socket:
    """One listening socket for every worker (what vLLM's `create_server_socket` makes; the
    simulator path must not import vLLM)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@contextlib.contextmanager
def simulator_workers(settings: Settings, target: Callable) -> Iterator[Workers]:
    """N spawned workers, each with its own simulator, on one socket."""
    sock = listen_socket(settings.host, settings.port)
    ctx = multiprocessing.get_context("spawn")
    n = settings.api_workers
    address = f"http://{settings.host}:{settings.port}"
    procs = []
    try:
        for i in range(n):
            config = {"client_index": i, "client_count": n}
            p = ctx.Process(
                target=target, name=f"ApiServer_{i}", args=(address, sock, None, config)
            )
            p.start()
            procs.append(p)
        log.info("started %d simulator workers on %s", n, address)
        yield Workers(procs, partial(_wait_for_failure, procs), partial(_stop, procs))
    finally:
        _stop(procs, 5.0)
        sock.close()


def _wait_for_failure(procs: list) -> None:
    """vLLM's `wait_for_completion_or_failure` for processes alone: returns when every
    process exited 0, raises when one exited otherwise."""
    pending = {p.sentinel: p for p in procs}
    while pending:
        for sentinel in connection.wait(list(pending)):
            p = pending.pop(sentinel)
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(
                    f"Worker {p.name} (pid {p.pid}) died with exit code {p.exitcode}"
                )


def _stop(procs: list, timeout: float) -> None:
    """SIGTERM every live worker, wait up to `timeout` in all, then SIGKILL."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.warning("worker %s (pid %s) did not stop in time; killing it", p.name, p.pid)
            p.kill()
            p.join(5)
