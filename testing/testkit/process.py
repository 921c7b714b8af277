"""Child processes that are always stopped: by PID and process group, never by name.

One helper for everything the tests and the benchmark start: the e2e control plane
(etcd, kube-apiserver, ...), the operator, Prometheus, the serving "pods" of the
autoscaling test, and the benchmark's servers and JSON-lines workers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from collections.abc import Collection
from pathlib import Path
from typing import IO

from .wait import eventually


class ManagedProcess:
    """One child process with its output in `log_dir/<name>.log` (appended, so a restarted
    process keeps its earlier lines).

    Each child leads its own process group (`start_new_session`), so stopping it also stops
    anything it spawned (vLLM's engine-core processes, for one), and nothing is found or
    killed by name. `cpus` pins the child (its threads and children inherit the mask);
    `nice` lowers the CPU priority of the child's whole session (`_lower_priority`);
    `pipes=True` gives the parent `proc.stdin`/`proc.stdout` (JSON-lines workers) and sends
    only stderr to the log.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        cpus: Collection[int] | None = None,
        nice: int = 0,
        pipes: bool = False,
    ):
        self.name = name
        self.argv = argv
        self.env = env
        self.cpus = set(cpus) if cpus else None
        self.nice = nice
        self.pipes = pipes
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        cpus, nice = self.cpus, self.nice

        def setup() -> None:  # in the child, after setsid
            if cpus:
                os.sched_setaffinity(0, cpus)
            if nice:
                _lower_priority(nice)

        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if self.pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.pipes else log,
                stderr=log if self.pipes else subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=setup if cpus or nice else None,
            )
        # Belt and braces: if the run dies before its fixtures' teardown, stop it anyway.
        atexit.register(self.stop)
        return self

    def started(self) -> subprocess.Popen:
        """The child, for what only a started one has (its pid for sure, signals); a
        RuntimeError before `start()`."""
        if self.proc is None:
            raise RuntimeError(f"{self.name}: not started")
        return self.proc

    def pipe_ends(self) -> tuple[IO[bytes], IO[bytes]]:
        """The child's stdin and stdout (`pipes=True`)."""
        proc = self.started()
        if proc.stdin is None or proc.stdout is None:
            raise RuntimeError(f"{self.name}: started without pipes=True")
        return proc.stdin, proc.stdout

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}; last log lines:\n{self.tail()}"
            )

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, wait `timeout`, then SIGKILL; then make sure nothing
        of the group is left (children can outlive their leader). Safe to call twice."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # the child leads its own session, so its pid is the group id
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Reap whatever else was left in the group (children that ignored SIGTERM), for up
        # to 2 s: a member its own parent has not reaped yet stays a zombie meanwhile, and
        # that is no reason to fail the caller.
        with contextlib.suppress(AssertionError):
            eventually(lambda: _group_gone(pgid), timeout=2, message=f"group {pgid} gone")
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _group_gone(pgid: int) -> bool:
    """SIGKILL to every member of the group; True once it has none left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return True
    return False


def _lower_priority(nice: int) -> None:
    """Lower the calling process's CPU priority, and its session's: with the kernel's
    autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`) CPU time is shared
    between sessions first, and a process's own nice only counts within its session."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup: the process's nice is all there is
