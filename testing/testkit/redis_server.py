"""A real `redis-server` (Debian package) on a free loopback port, for tests.

No persistence (`--save "" --appendonly no`), so a restart starts empty, like a Redis that
lost its state. The process runs in its own process group and is stopped by PID; `stop()`,
`start()` (same port again) and `pause()`/`resume()` (SIGSTOP: a Redis that accepts
connections and never answers) let tests break it mid-way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from .net import free_port
from .wait import eventually

BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"
MISSING = "redis-server is not installed (tests/scripts/install-tools.sh installs it)"


def available() -> bool:
    return os.access(BINARY, os.X_OK)


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        eventually(lambda: self._answers(proc), timeout=10, message="redis-server to answer PING")
        return self

    def _answers(self, proc: subprocess.Popen) -> bool:
        if proc.poll() is not None:  # not retried: fails at once
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        return self._ping()

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            assert s.recv(16).startswith(b"+OK")
