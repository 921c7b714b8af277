"""Loopback ports and HTTP readiness: the two things every suite that starts a server needs."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from typing import Protocol


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick). Another process can take it
    before the caller binds it; callers that can retry on "address in use" should."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Watched(Protocol):
    name: str

    def check_alive(self) -> None: ...

    def tail(self, lines: int = 30) -> str: ...


def wait_http(
    url: str,
    *,
    timeout: float,
    process: _Watched | None = None,
    interval: float = 0.2,
    context: ssl.SSLContext | None = None,
    what: str | None = None,
) -> None:
    """Poll GET `url` until it answers 200.

    Raises at once when `process` (a `testkit.process.ManagedProcess`) has exited (its
    `check_alive` error carries the last log lines), and `TimeoutError` after `timeout`
    seconds with the last connection error and the process's log tail. Anything but a 200
    (refused, reset, 500 while starting, 503 while not ready) counts as "not yet".
    """
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if process is not None:
            process.check_alive()
        try:
            with urllib.request.urlopen(url, context=context, timeout=2) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except Exception as e:  # not listening yet, or an error status while starting
            last = str(e)
        if time.monotonic() >= deadline:
            who = what or (process.name if process is not None else url)
            tail = f"\n{process.tail()}" if process is not None else ""
            raise TimeoutError(f"{who} not ready at {url} after {timeout:.0f} s: {last}{tail}")
        time.sleep(interval)
