"""Loopback ports and HTTP readiness: the two things every suite that starts a server needs."""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.request
from typing import Protocol

from testkit.wait import eventually


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
    """Poll GET `url` until it answers 200 (`testkit.wait.eventually`).

    Raises at once when `process` (a `testkit.process.ManagedProcess`) has exited (its
    `check_alive` error carries the last log lines), and `AssertionError` after `timeout`
    seconds with the last answer or connection error and the process's log tail. Anything
    but a 200 (refused, reset, 500 while starting, 503 while not ready) counts as "not yet".
    """

    def ready() -> bool:
        if process is not None:
            process.check_alive()  # not retried: an exited process fails at once
        with urllib.request.urlopen(url, context=context, timeout=2) as r:  # 4xx/5xx raise
            assert r.status == 200, f"HTTP {r.status}"
        return True

    def why() -> str:
        who = what or (process.name if process is not None else url)
        tail = f"\n{process.tail()}" if process is not None else ""
        return f"{who} ready at {url}{tail}"  # the log tail goes after the verdict

    not_yet = (AssertionError, OSError, http.client.HTTPException)  # OSError: refused, 503...
    eventually(ready, timeout=timeout, interval=interval, message=why, retry_on=not_yet)
