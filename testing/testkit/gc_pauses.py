"""pytest plugin: the test process's garbage-collector pauses, kept short and shown.

A full run imports vLLM, torch, transformers, schemathesis and every test module into one
process: about a million objects that live until the end. Each full (generation 2)
collection walks all of them, which took up to 1.06 s here, and longer while a pod under
test keeps both cores busy. During such a pause the test's event loop is stopped: its reads
fall behind, its timeouts fire late, a disconnect it means to make happens late.

So, once collection has imported everything, those objects are moved out of the
collector's sight (`gc.freeze()`, as vLLM's own server does after start-up), and every
pause over `SLOW_S` is listed at the end of the run with the test it stopped.
"""

from __future__ import annotations

import gc
import os
import time

SLOW_S = 0.25

_started: list[float] = []
_slow: list[tuple[float, int, str]] = []  # (seconds, generation, test)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        took = time.perf_counter() - _started[0]
        if took > SLOW_S:
            test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)")
            _slow.append((took, info["generation"], test))


def pytest_configure(config) -> None:
    gc.callbacks.append(_on_gc)


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter) -> None:
    if not _slow:
        return
    worst = sorted(_slow, reverse=True)[:5]
    terminalreporter.section(f"test process GC pauses over {SLOW_S:.2f} s")
    for took, generation, test in worst:
        terminalreporter.line(f"{took:6.2f}s gen {generation}  {test}")
    terminalreporter.line(f"{len(_slow)} pauses in all")
