"""The resync: one background thread that converges models from memory, on its own period
(`run --resync-seconds`), at once for a replica that just became the leader (`kick`), and
for the few models the rollout pacer or the scale-to-zero poller name (`converge_soon`).

No kopf timers: they would put a finalizer on every StreamingModel (deletion would then
hang whenever the operator is down). The pass itself is handed in (`converge`); this module
only decides when, in which context and for which models.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

from .cluster_view import ClusterView

Logger = logging.Logger | logging.LoggerAdapter[Any]
# (namespace, name, why): one pass nobody retries; it logs its errors, never raises them.
Converge = Callable[[str, str, str], None]


class Resync:
    """Every `seconds` (0: never), one collapsible pass per known model, from memory: a
    settled model costs no API call; a model whose last event-driven pass failed is
    converged again. `kick()` runs a round now: a replica that just became the leader.
    `converge_soon(keys)` converges just those models now: the pacer's waiting models when
    a rollout slot frees."""

    def __init__(
        self,
        memory: ClusterView,
        seconds: float,
        logger: Logger,
        converge: Converge,
        leading: Callable[[], bool] = lambda: True,
        after_round: Callable[[], None] | None = None,
    ) -> None:
        self.memory, self.seconds, self.logger = memory, seconds, logger
        self.converge, self.leading = converge, leading
        # Run after each round of the period (the weights clean-ups of deleted models
        # that wait for a download: `Passes.retry_releases`).
        self.after_round = after_round
        self.passes = 0
        self._soon: set[tuple[str, str]] = set()
        self._soon_guard = threading.Lock()
        self._context: contextvars.Context | None = None
        self._missed = False  # a round was due before kopf's listings were complete
        self._all_due = False  # kick(): the next wake-up converges every model
        self._stop = threading.Event()
        self._kicked = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sluice-resync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._kicked.set()
        self._thread.join(timeout=5)

    def kick(self) -> None:
        self._all_due = True
        self._kicked.set()

    def converge_soon(self, keys: list[tuple[str, str]]) -> None:
        with self._soon_guard:
            self._soon.update(keys)
        self._kicked.set()

    def _converge(self, namespace: str, name: str, why: str) -> None:
        assert self._context is not None
        self._context.copy().run(self.converge, namespace, name, why)
        self.passes += 1

    def adopt_context(self) -> None:
        """Keep a copy of a handler's context: kopf.event (the pass's Events) needs the
        operator's event queue, which kopf only puts into the context of its handlers.
        kopf runs handlers only once every listing is complete, so from then on memory is
        whole; a round asked for before that (a Lease won during start-up) runs now."""
        if self._context is None:
            self._context = contextvars.copy_context()
            if self._missed:
                self.kick()

    def run_once(self) -> None:
        self.memory.prune()
        models = self.memory.models()
        if self._context is None:
            self._missed = True
            return  # no handler has run yet: kopf is still listing, nothing to resync
        done = 0
        for namespace, name in models:
            if self._stop.is_set() or not self.leading():
                break
            self._converge(namespace, name, "resync")
            done += 1
        if done:
            self.logger.info(f"resync: {done} models converged from memory")
        if self.after_round is not None and self.leading() and not self._stop.is_set():
            assert self._context is not None
            self._context.copy().run(self.after_round)

    def _loop(self) -> None:
        timeout = self.seconds if self.seconds > 0 else None
        while not self._stop.is_set():
            woken = self._kicked.wait(timeout)
            self._kicked.clear()
            if self._stop.is_set():
                return
            every, self._all_due = self._all_due or not woken, False
            with self._soon_guard:
                soon, self._soon = sorted(self._soon), set()
            if not self.leading():
                continue
            try:
                if every:
                    self.run_once()
                elif soon and self._context is not None:
                    for namespace, name in soon:
                        self._converge(namespace, name, "a free rollout slot or a scale signal")
            except Exception:  # a bug in one pass must not end every later resync
                self.logger.exception("resync failed")
