"""The server's start-up phases (`sluice_server/startup.py`): a real `sluice-server` process
on the simulator exports every phase it passed as `sluice_startup_phase_seconds`, in order,
and logs the same numbers once when it starts serving; the clock's zero is the process's
start, not the import of the module that keeps it."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from pod_helpers import startup_phases
from sluice_server.startup import StartupPhases
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

LOG_LINE = re.compile(
    r" INFO sluice_server start-up phases \(seconds since the process started\): (.*)$"
)


@pytest.mark.parametrize("folder", [False, True], ids=["model-name", "model-folder"])
def test_simulator_server_exports_and_logs_its_phases_in_order(tmp_path, folder):
    """With a folder for its model (the weights cache's mount) the simulator also marks
    `weights_located`; with a name (the negative control) it has no weights to locate."""
    port = free_port()
    model = str(tmp_path / "weights") if folder else "sim"
    if folder:
        (tmp_path / "weights").mkdir()
    argv = [sys.executable, "-m", "sluice_server", "--engine", "simulator", "--model", model,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = ManagedProcess("server", argv, tmp_path).start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", timeout=60, process=proc)
        page = httpx.get(f"{url}/metrics").text
    finally:
        proc.stop()
    exported = startup_phases(page)
    # The simulator has no vLLM (and no weights without a folder): absent, not zero.
    located = ["weights_located"] if folder else []
    assert list(exported) == ["process_started", "imports_done", *located, "engine_ready",
                              "serving"]  # fmt: skip
    values = list(exported.values())
    assert values[0] == 0.0
    assert values == sorted(values), exported
    assert values[1] > 0  # the interpreter's start and the imports count
    logged = [m.group(1) for line in proc.log_path.read_text().splitlines()
              if (m := LOG_LINE.search(line))]  # fmt: skip
    assert len(logged) == 1, proc.tail()
    assert logged[0] == " ".join(f"{p}={s:.2f}" for p, s in exported.items())


def test_the_clock_starts_with_the_process():
    """A process that sleeps before it imports the clock: its first mark is after the sleep
    (negative control: a clock started at import would read about 0)."""
    code = (
        "import time; time.sleep(0.5); "
        "from sluice_server.startup import phases; phases.mark('imports_done'); "
        "print(phases.marks['imports_done'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) >= 0.5


def test_each_phase_is_marked_once_and_reported_in_start_up_order():
    clock = StartupPhases()
    clock.mark("serving")
    clock.mark("imports_done")
    first = clock.marks["serving"]
    clock.mark("serving")
    assert clock.marks["serving"] == first
    assert [p for p, _ in clock.ordered()] == ["process_started", "imports_done", "serving"]
