"""The shared helpers keep their contracts: a stopped process leaves nothing of its group
behind, a niced one is niced with its whole session, readiness waits fail fast when the
process dies, virtual time does not sleep."""

from __future__ import annotations

import asyncio
import http.server
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from testkit.clock import run_in_virtual_time, virtual_time
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state in /proc says it is gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_kills_children_that_outlive_their_leader(tmp_path):
    # The leader starts a child in its group, prints its pid and exits at once.
    code = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"
    proc = ManagedProcess("leader", [sys.executable, "-c", code], tmp_path).start()
    proc.proc.wait(10)
    child = int(proc.log_path.read_text().split()[0])
    assert _alive(child)
    proc.stop(timeout=2)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    proc.stop()  # twice is fine


def test_nice_lowers_the_priority_of_the_childs_session(tmp_path):
    code = (
        "import os, pathlib; g = pathlib.Path('/proc/self/autogroup'); "
        "print(os.nice(0), g.read_text() if g.exists() else '', flush=True)"
    )
    ours = os.nice(0)
    for nice in (0, 10):  # the control first: our own priority, inherited as is
        proc = ManagedProcess(f"nice{nice}", [sys.executable, "-c", code], tmp_path, nice=nice)
        proc.start().proc.wait(10)
        out = proc.log_path.read_text()
        assert out.startswith(f"{min(ours + nice, 19)} "), out
        if Path("/proc/self/autogroup").exists():  # the session's share, not only its own
            assert out.rstrip().endswith(f"nice {nice}"), out


def test_wait_http_waits_for_200_and_fails_fast_when_the_process_exits(tmp_path):
    answers = [503, 503, 200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_http(f"http://127.0.0.1:{server.server_address[1]}/", timeout=10, interval=0.01)
        assert answers == [200]
    finally:
        server.shutdown()
        server.server_close()

    dead = ManagedProcess("dead", [sys.executable, "-c", "print('bye')"], tmp_path).start()
    dead.proc.wait(10)
    with pytest.raises(RuntimeError, match="bye"):
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout=30, process=dead)
    with pytest.raises(TimeoutError):
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout=0.2, interval=0.05)


def test_virtual_time_runs_timers_without_sleeping():
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(30)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(10)
        return loop.time(), loop.wall_time() - loop.wall_epoch

    started = time.monotonic()
    assert run_in_virtual_time(main()) == (35.0, 35.0)
    assert time.monotonic() - started < 5


@virtual_time
async def test_virtual_time_decorator_runs_an_async_test():
    await asyncio.sleep(3600)
    assert asyncio.get_running_loop().time() == 3600
