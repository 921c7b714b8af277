"""One converge at a time per StreamingModel (`ModelLocks`): the lock every pass of a model
runs under, whoever started it (its own handler, a child event, the resync)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # passes running or waiting for the lock
        self.dirty = False  # an event came in while a pass ran: run once more


class ModelLocks:
    """One converge at a time per StreamingModel, bursts collapsed, memory bounded.

    Child events arrive in bursts (a rollout touches the Deployment, its pods and the
    ReplicaSet-driven status many times a second). An event for a model whose pass is running
    or waiting only marks it dirty and returns at once; the pass, once done, runs once more
    if it was marked (it reads memory, so that one pass sees everything the burst changed).
    N events during a pass cost one more pass, not N, and hold no worker thread. The model's
    own handlers (create, update, resume) never skip: kopf retries them on failure, which a
    skipped pass would lose; they wait for the lock. An entry lives only while a pass runs or
    waits, so the table does not grow with every model ever seen (a deleted model leaves
    nothing behind).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    def run(
        self, key: tuple[str, str], converge_once: Callable[[], None], collapsible: bool = False
    ) -> bool:
        """Run `converge_once` under the model's lock, again while events marked it dirty.
        False: collapsed into the pass already running or waiting (nothing was run)."""
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            elif collapsible:
                entry.dirty = True
                return False
            entry.users += 1
        try:
            with entry.lock:
                while True:
                    with self._guard:
                        entry.dirty = False
                    converge_once()
                    with self._guard:
                        # A pass waiting for the lock reads everything after us anyway.
                        if not entry.dirty or entry.users > 1:
                            break
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]
        return True
