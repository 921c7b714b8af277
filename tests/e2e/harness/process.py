"""Child processes that are always stopped: by PID, process group first, then a hard kill."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from pathlib import Path


class ManagedProcess:
    """One long-running binary with its output in a log file.

    Each child gets its own process group (`start_new_session`) so stopping it also stops
    anything it spawned, and nothing is found or killed by name.
    """

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        # Belt and braces: if the test run dies before its fixtures' teardown, stop it anyway.
        atexit.register(self.stop)
        return self

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
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL; safe to call twice."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # the child leads its own session, so its pid is the group id
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Reap whatever else was left in the group (children that ignored SIGTERM).
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.05)
