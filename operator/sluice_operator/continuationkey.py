"""The router's master continuation key as the operator reads it (`run
--continuation-key-file`; the operator chart mounts the router's Secret there).

Read at every pass, never cached: the kubelet refreshes a mounted Secret within about a
minute of a change, and the next pass of each model derives its key from the new master
(builders/continuation.py), so a rotation needs no restart. `watch` makes that next pass
come soon: the resync (every model, from memory) runs once the file's content changed.

The key is never logged; an unreadable or empty file is one warning per distinct reason,
and reads as no key (the router models' condition StreamMigration says so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from .models.resource import OperatorDefaults

log = logging.getLogger("sluice_operator.continuationkey")

# How often `watch` looks at the file (one read of a small file on tmpfs).
WATCH_SECONDS = 10.0


class ContinuationKeyFile:
    """The master key's file; `read` is its first line (stripped), or None."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._warned: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> bytes | None:
        try:
            key = self.path.read_bytes().split(b"\n", 1)[0].strip()
        except OSError as exc:
            self._warn(f"cannot be read ({exc.strerror or exc})")
            return None
        if not key:
            self._warn("is empty")
            return None
        self._warned = None
        return key

    def _warn(self, why: str) -> None:
        if why != self._warned:
            self._warned = why
            log.warning(
                f"the continuation key file {self.path} {why}: no stream is migrated "
                "(condition StreamMigration)"
            )

    def defaults(self, base: OperatorDefaults) -> OperatorDefaults:
        """`base` with the key as read now."""
        return dataclasses.replace(base, continuation_key=self.read())

    def watch(self, changed: Callable[[], None], seconds: float = WATCH_SECONDS) -> None:
        """Call `changed` (from a thread of its own) whenever the key's content changes."""

        def fingerprint() -> str:
            key = self.read()
            return hashlib.sha256(key).hexdigest() if key is not None else ""

        last = fingerprint()

        def loop() -> None:
            nonlocal last
            while not self._stop.wait(seconds):
                now = fingerprint()
                if now != last:
                    last = now
                    log.info("the continuation key changed: converging every model")
                    changed()

        self._thread = threading.Thread(target=loop, name="sluice-continuation-key", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
