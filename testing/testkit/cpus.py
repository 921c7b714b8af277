"""Keep vLLM's CPU engine processes off the cores the HTTP servers and their clients use.

vLLM's CPU build binds each engine's model worker (`VLLM::Worker`) to its compute cores
(`VLLM_CPU_OMP_THREADS_BIND`, "auto": every core but the last) but leaves the engine-core
process (`VLLM::EngineCore`) free to run anywhere, and that process busy-polls the worker's
shared-memory queue (`sched_yield` for 1 s after every message, vLLM's `SpinCondition`). On
a 2-core machine it then shares the second core with the API server and the client and
starves them: a timestamping proxy saw a server write a response's start at +2 ms and the
rest of a 300-token stream in one write at +770 ms (its access log said TTFT 11 ms), and a
load generator waited up to 1.5 s in the run queue while tokens piled up server-side
(bursts after ~0.3-3 s, then ITL 0: TTFTs clustered around 1 s).
Moving every engine-core process next to its worker and every front end (API servers, the
bare-engine process, load generators, the test process itself) onto the other cores
removes the stalls. The benchmark (sluice_bench) uses this layout for every system it
measures, and the tests whose verdict depends on when bytes arrive use it too.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system, all threads, exited ones too) of one process, not of its
    children, to the nanosecond: the process's CPU-time clock, the id glibc's
    clock_getcpuclockid makes. /proc/PID/stat (and psutil) count whole clock ticks (10 ms),
    and a short measurement can spend less than one."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def process_tree(proc: psutil.Process) -> list[psutil.Process]:
    """A process and every process below it (a server's workers, an engine's core and
    model worker)."""
    import psutil

    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [proc]


def tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system) of a process and every process below it."""
    import psutil

    total = 0.0
    for p in process_tree(proc):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves only that one thread);
    threads and processes started later inherit the mask of the thread that starts them."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


def engine_processes(parent: int, recursive: bool = True) -> tuple[list[int], set[int]]:
    """The engine-core pids among `parent`'s children (all descendants, or only its own
    children with `recursive=False`) and the CPUs their model workers are bound to."""
    import psutil

    cores: list[int] = []
    worker_cpus: set[int] = set()
    for child in psutil.Process(parent).children(recursive=recursive):
        if "EngineCore" not in child.name():
            continue
        cores.append(child.pid)
        for worker in child.children(recursive=True):
            if "Worker" in worker.name():
                worker_cpus |= set(worker.cpu_affinity())
    return cores, worker_cpus


def separate(engine_cores: Iterable[int], engine_cpus: set[int], fronts: Iterable[int]) -> dict:
    """Pin `engine_cores` onto `engine_cpus` and every thread of `fronts` onto the other CPUs
    this process may use. Returns the layout ({} when there is nothing to separate: no
    engine, or no CPU left for the front ends)."""
    front_cpus = set(os.sched_getaffinity(0)) - engine_cpus
    if not engine_cpus or not front_cpus:
        return {}
    for pid in engine_cores:
        pin_threads(pid, engine_cpus)
    for pid in fronts:
        pin_threads(pid, front_cpus)
    return {"engine_cpus": sorted(engine_cpus), "front_cpus": sorted(front_cpus)}


@contextlib.contextmanager
def engine_apart_from_this_process() -> Iterator[dict]:
    """The layout above for an engine that runs inside this process (its engine core is a
    child of ours), with this process (server and client alike) as the front end; processes
    started inside the block (nginx, a browser) inherit the front's cores. On the way out
    every thread of ours and the engine cores get back the mask they had. Yields the layout
    ({} when there is nothing to separate)."""
    me = os.getpid()
    cores, cpus = engine_processes(me, recursive=False)
    before = {pid: os.sched_getaffinity(pid) for pid in (me, *cores)}
    try:
        yield separate(cores, cpus, [me])
    finally:
        for pid, mask in before.items():
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                pin_threads(pid, mask)
