"""The shared helpers keep their contracts: a stopped process leaves nothing of its group
behind, a niced one is niced with its whole session, readiness waits fail fast when the
process dies, virtual time does not sleep, `eventually` tries until the deadline and says
what it last saw."""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.clock import run_in_virtual_time, virtual_time
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.wait import eventually, eventually_async


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
    eventually(lambda: not _alive(child), timeout=5, message=f"child {child} to be gone")
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
    with pytest.raises(AssertionError, match=r"ready at http://127.0.0.1:\d+/: not within 0.2 s"):
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


class FakeClock:
    """`time.monotonic` and `time.sleep` for `testkit.wait`: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    import testkit.wait

    fake = FakeClock()
    monkeypatch.setattr(testkit.wait, "time", fake)
    return fake


def test_eventually_returns_the_first_truthy_value(clock):
    answers = iter([None, 0, [], {"ready": True}])
    assert eventually(lambda: next(answers), timeout=10, interval=0.5) == {"ready": True}
    assert clock.sleeps == [0.5, 0.5, 0.5]


def test_eventually_retries_assertions_and_tries_once_more_at_the_deadline(clock):
    seen: list[float] = []

    def ready() -> bool:
        seen.append(clock.now)
        assert clock.now >= 1.0, f"not yet at {clock.now:.1f}"
        return True

    assert eventually(ready, timeout=1.0, interval=0.3) is True
    assert seen == pytest.approx([0.0, 0.3, 0.6, 0.9, 1.0])  # the last try at the deadline


def test_eventually_fails_with_the_message_and_the_last_exception(clock):
    def status() -> dict:
        now = clock.now
        assert now > 99, f"phase Pending at {now:.1f}"
        return {}

    with pytest.raises(AssertionError) as failed:
        eventually(status, timeout=2, interval=1, message="the model to be Ready")
    assert str(failed.value) == (
        "the model to be Ready: not within 2 s (3 tries); "
        "last: AssertionError: phase Pending at 2.0\nassert 2.0 > 99"
    )
    assert isinstance(failed.value.__cause__, AssertionError)  # the traceback shows the cause
    assert clock.now == 2


def test_eventually_fails_with_the_last_value_and_a_message_built_late(clock):
    tries: list[int] = []

    def count() -> int:
        tries.append(len(tries))
        return 0

    with pytest.raises(AssertionError, match=r"^3 polls: not within 1 s \(3 tries\); last: 0$"):
        eventually(count, timeout=1, interval=0.5, message=lambda: f"{len(tries)} polls")
    with pytest.raises(AssertionError) as failed:  # the first line, the verdict, the rest
        eventually(count, timeout=0, message="server ready\nlog line 1\nlog line 2")
    assert (
        str(failed.value) == "server ready: not within 0 s (1 try); last: 0\nlog line 1\nlog line 2"
    )
    with pytest.raises(
        AssertionError, match=r"^test_eventually.*\.nothing: not within 0 s \(1 try\)"
    ):

        def nothing() -> None:
            return None

        eventually(nothing, timeout=0)  # one try even with no time at all; named after fn


def test_eventually_fails_fast_on_an_exception_it_does_not_retry(clock):
    calls: list[int] = []

    def dead() -> bool:
        calls.append(1)
        raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="the server exited"):
        eventually(dead, timeout=60)
    assert calls == [1] and clock.now == 0
    # ... and retries the ones it is told to, reporting the last.
    with pytest.raises(AssertionError, match="last: ConnectionRefusedError: refused"):
        eventually(lambda: (_ for _ in ()).throw(ConnectionRefusedError("refused")),
                   timeout=1, retry_on=(OSError,))  # fmt: skip


@virtual_time
async def test_eventually_async_awaits_and_keeps_to_the_loops_clock():
    loop = asyncio.get_running_loop()
    seen: list[float] = []

    async def ready() -> str | None:
        seen.append(loop.time())
        await asyncio.sleep(0.1)  # an attempt takes time of its own
        return "up" if loop.time() >= 1.0 else None

    assert await eventually_async(ready, timeout=1.0, interval=0.25) == "up"
    assert seen == pytest.approx([0.0, 0.35, 0.7, 1.0])  # last try at the deadline
    assert await eventually_async(lambda: loop.time() >= 1.5, timeout=1, interval=0.2) is True

    with pytest.raises(AssertionError, match=r"^never: not within 0.5 s \(3 tries\); last: False$"):
        await eventually_async(lambda: False, timeout=0.5, interval=0.25, message="never")
    with pytest.raises(KeyError):  # not retried: fails at once
        await eventually_async(lambda: {}["status"], timeout=30)
    assert loop.time() == pytest.approx(2.0)


FAKE_ENGINE = """
import os, subprocess, sys, setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
worker = subprocess.Popen([sys.executable, "-c",
    "import os, setproctitle, sys; setproctitle.setproctitle('VLLM::Worker'); "
    "os.sched_setaffinity(0, {0}); print('up', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
worker.stdout.readline()
print("up", flush=True)
sys.stdin.read()
worker.stdin.close()
worker.wait()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to separate")
def test_engine_apart_moves_the_engine_core_beside_its_worker_and_us_away():
    """vLLM's layout faked by two processes named as vLLM names its own: an engine core (our
    child) and its model worker bound to CPU 0, as vLLM's auto binding leaves them. In a fresh
    interpreter: in the whole suite this process already has the session's real engine as a
    child, which the negative control (no engine, nothing moved) would see."""
    import subprocess

    tests = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", "from harness.test_testkit import check_layout; check_layout()"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def check_layout() -> None:
    """The test above, in its own process (no engine of ours yet)."""
    import subprocess

    from testkit.cpus import engine_apart_from_this_process

    ours = os.sched_getaffinity(0)
    with engine_apart_from_this_process() as layout:
        assert layout == {}  # the negative control: no engine, nothing moved
        assert os.sched_getaffinity(0) == ours
    core = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert core.stdout.readline() == b"up\n"
        core_mask = os.sched_getaffinity(core.pid)
        with engine_apart_from_this_process() as layout:
            front = ours - {0}
            assert layout == {"engine_cpus": [0], "front_cpus": sorted(front)}
            assert os.sched_getaffinity(core.pid) == {0}
            tids = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
            assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset(front)}
            started_inside = subprocess.run(
                [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                capture_output=True,
                text=True,
                check=True,
            )  # nginx, a browser: started meanwhile, on the front's cores
            assert started_inside.stdout.strip() == str(sorted(front))
        assert os.sched_getaffinity(0) == ours  # every mask back as it was
        assert os.sched_getaffinity(core.pid) == core_mask
    finally:
        core.stdin.close()
        core.wait(10)


# Spends CPU in a thread that exits, when told to, then says so: no whole clock tick needed.
BURN = """
import sys, threading, time
def burn():
    end = time.thread_time() + float(sys.argv[1])
    while time.thread_time() < end:
        pass
print("ready", flush=True)
sys.stdin.readline()
t = threading.Thread(target=burn); t.start(); t.join()
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("seconds", [0.003, 0.05])
def test_a_process_cpu_time_counts_exited_threads_below_one_clock_tick(seconds):
    from testkit.cpus import process_cpu_s

    with subprocess.Popen([sys.executable, "-c", BURN, str(seconds)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout.readline() == "ready\n"
        before = process_cpu_s(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        spent = process_cpu_s(proc.pid) - before
        proc.stdin.close()
    assert spent >= seconds  # reading the lines costs a little more, never less
