"""Rotation without restart: the key file and the JWKS file (and the activator's models file)
are reloaded when they change.

Kubernetes updates a mounted Secret or ConfigMap by writing a new timestamped directory and
swapping the `..data` symlink to it in one rename; the file's path stays, what it resolves
to changes. So a cheap poll is exact: `os.stat` (following the links) every few seconds,
and a reload when device, inode, mtime or size differ. A file that cannot be used (missing,
unparsable, no keys) leaves the credentials loaded before in place, and says why in the
log and in `sluice_credential_reloads_total{result="error"}`; the next change is tried
again. Swapping the credentials is one attribute assignment in the event loop: requests
that were admitted, and streams in flight, keep the principal they were admitted as.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

Stamp = tuple[int, int, int, int] | None


def stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass
class Source(Generic[T]):
    name: str  # metric label and log word: api_keys, jwks
    path: Path
    load: Callable[[], T]  # raises OSError/ValueError when the file cannot be used
    apply: Callable[[T], None]
    describe: Callable[[T], str] = lambda value: "loaded"
    seen: Stamp = None


class Reloader:
    def __init__(
        self, sources: list[Source[Any]], record: Callable[[str, str], None], interval: float
    ) -> None:
        """`record(source name, "ok" | "error")` counts each reload (a metric)."""
        self.sources, self.record, self.interval = sources, record, interval
        for source in sources:
            source.seen = stamp(source.path)  # what the app was built from (or newer)

    def check(self) -> None:
        for source in self.sources:
            now = stamp(source.path)
            if now == source.seen:
                continue
            source.seen = now
            try:
                value = source.load()
            except (OSError, ValueError) as e:
                # The messages name line numbers and key indices, never a key or token.
                self.record(source.name, "error")
                log.warning(
                    "%s: %s changed but cannot be used (%s: %s); keeping what was loaded before",
                    source.name,
                    source.path,
                    type(e).__name__,
                    e,
                )
                continue
            source.apply(value)
            self.record(source.name, "ok")
            log.info("%s: reloaded %s (%s)", source.name, source.path, source.describe(value))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
