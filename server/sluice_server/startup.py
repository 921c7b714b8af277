"""The server's own start-up phases, each the seconds since its process started, for the
cold-start breakdown (docs/autoscaling.md): exported as `sluice_startup_phase_seconds` and
logged once when the server starts serving.

The clock starts at the kernel's start time of the process (`/proc/self/stat`), not at this
module's import, so the interpreter's start and the imports count. A front-end worker of a
pod with several (`--api-workers`) counts from its supervisor's start: the container's.
Each phase is marked once, the first time the code passes its point; a phase a start-up
path never passes (vLLM's import on the simulator) is absent, never zero.
"""

from __future__ import annotations

import multiprocessing
import os
import time

# In the order a start-up passes them; what each covers is in `PHASES`' values.
PHASES: dict[str, str] = {
    "process_started": "the process started (0: the origin of every other phase)",
    "imports_done": "the server's own modules imported and its settings read (the engine's "
    "modules come later)",
    "weights_located": "the model's weights found in a local folder (a hub name is "
    "downloaded by vLLM's engine core, inside `engine_ready`; the simulator marks it when its "
    "model is a folder, which it never reads)",
    "engine_imported": "vLLM imported and its arguments parsed",
    "engine_ready": "the engine answers: vLLM's engine core has loaded the weights, profiled "
    "memory and allocated its KV cache (or a worker is connected to the pod's engine core); "
    "the simulator is constructed",
    "serving": "the listener accepts connections and /ready answers 200",
}

_CLOCK = time.CLOCK_BOOTTIME if hasattr(time, "CLOCK_BOOTTIME") else None


def _started_ago(pid: int) -> float | None:
    """Seconds since process `pid` started, from its start time in clock ticks since boot
    (`/proc/<pid>/stat`, field 22); None where there is no /proc."""
    if _CLOCK is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its last ")".
    ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
    return time.clock_gettime(_CLOCK) - ticks / os.sysconf("SC_CLK_TCK")


class StartupPhases:
    """Marks on a monotonic clock whose zero is the process's start (or its supervisor's)."""

    def __init__(self) -> None:
        parent = multiprocessing.parent_process()
        ago = _started_ago(parent.pid) if parent is not None and parent.pid else None
        if ago is None:
            ago = _started_ago(os.getpid())
        self._zero = time.monotonic() - (ago or 0.0)
        self.marks: dict[str, float] = {"process_started": 0.0}

    def mark(self, phase: str) -> None:
        """Record `phase` now, unless it was recorded before."""
        assert phase in PHASES, phase
        self.marks.setdefault(phase, time.monotonic() - self._zero)

    def ordered(self) -> list[tuple[str, float]]:
        """The phases passed, in `PHASES` order."""
        return [(p, self.marks[p]) for p in PHASES if p in self.marks]

    def summary(self) -> str:
        return " ".join(f"{p}={s:.2f}" for p, s in self.ordered())


phases = StartupPhases()  # this process's
