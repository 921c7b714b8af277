"""One engine over two "nodes" on this machine: two `sluice-server` processes, the leader
(`--node-rank 0`, the HTTP API) and a headless worker (`--node-rank 1`), joined by vLLM's
multiprocessing multi-node backend over loopback, the tiny model split across them: by
pipeline parallelism 2 (the cross-node layout of the two-node sample: a stage per node) and
by tensor parallelism 2, one rank per process.

- The leader serves nothing before its worker joined: vLLM opens the engine only once the
  whole group is up (the leader's log says when), and the app starts after it.
- With the worker joined: `/ready` 200, `sluice_engine_nodes` 2, `sluice_engine_group_up`
  1, and streams through the leader on the token SSE and OpenAI routes.
- The worker killed: vLLM's leader notices a lost worker node at its next step, not while
  idle (its worker monitor watches local processes only), so the next request ends in an
  error event and from then on `/ready` is 503 and the gauge 0. With tensor parallelism the
  step fails at once (the leader's own rank loses its peer); with pipeline parallelism the
  step's output comes from the last stage, the lost node, and the leader waits for it up to
  `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (vLLM's default 300 s; 120 s here). On Kubernetes the
  LeaderWorkerSet's RecreateGroupOnPodRestart replaces the group as soon as the worker's pod
  fails.

Pipeline parallelism needs `--no-enforce-eager` on vLLM 0.32's CPU build. With
`--enforce-eager` (the server's CPU default) the CPU worker skips its warm-up, so the last
stage's intermediate-tensor buffer (allocated in `_dummy_run`) is never made and its first
`execute_model` fails (`assert self.intermediate_tensors is not None` in
`sync_and_gather_intermediate_tensors`); the engine's batch queue checks `execute_model`'s
result only when `sample_tokens` returns None, so it hands the stage's empty output to the
scheduler instead: `KeyError` in `update_from_output`. With torch.compile on, the warm-up
runs and allocates it (start-up is slower by the compile). Tensor parallelism needs no
such buffer and runs eager.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime

import httpx
import pytest
from pod_helpers import metric
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.engine, pytest.mark.slow]

if not os.environ.get("SLUICE_TEST_MULTINODE"):
    pytest.skip(
        "two engine processes take 5-7 min per layout here: `make test-multinode` runs them",
        allow_module_level=True,
    )
if (os.cpu_count() or 1) < 2:
    pytest.skip("two engine ranks need two CPUs", allow_module_level=True)
pytest.importorskip("vllm")

START_S = 600  # two engine processes loading on a busy 2-core machine
STEP_TIMEOUT_S = 120  # vLLM's wait for a step's output from the last pipeline stage
FAIL_S = 300  # a request after the worker's death ends (in an error event) within this


def _ready(url: str) -> int | None:
    """The status of GET /ready, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


LAYOUTS = {
    "pipeline": ["--pipeline-parallel-size", "2", "--", "--no-enforce-eager"],
    "tensor": ["--tensor-parallel-size", "2"],
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def group(request, tmp_path_factory, tiny_model_path):
    log_dir = tmp_path_factory.mktemp("group")
    scratch = tempfile.mkdtemp(prefix="sluice-group-")
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "TMPDIR": scratch,
           "VLLM_CACHE_ROOT": os.path.join(scratch, "vllm"),
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S)}  # fmt: skip
    port, master = free_port(), free_port()
    common = [sys.executable, "-m", "sluice_server", "--model", "tiny", "--engine", "vllm",
              "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]  # fmt: skip
    engine = LAYOUTS[request.param]  # `--` and vLLM's own arguments last
    leader = ManagedProcess(
        "leader", [*common, "--node-rank", "0", "--host", "127.0.0.1", "--port", str(port), *engine],
        log_dir, env=env, nice=10,
    ).start()  # fmt: skip
    worker = ManagedProcess(
        "worker", [*common, "--node-rank", "1", *engine], log_dir, env=env, nice=10
    )
    url = f"http://127.0.0.1:{port}"
    try:
        yield leader, worker, url
    finally:
        worker.stop(timeout=20)
        leader.stop(timeout=60)


async def _logged(proc: ManagedProcess, text: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while text not in proc.log_path.read_text(errors="replace"):
        proc.check_alive()
        assert time.monotonic() < deadline, f"{proc.name} never logged {text!r}:\n{proc.tail()}"
        await asyncio.sleep(0.5)


def _engine_ready_at(proc: ManagedProcess) -> float:
    """When the leader's log says its engine opened (the server's own timestamp)."""
    (line,) = [
        x
        for x in proc.log_path.read_text().splitlines()
        if "INFO sluice_server.app engine ready" in x
    ]
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


async def test_group_serves_only_with_its_worker_and_fails_fast_without_it(group):
    leader, worker, url = group
    # The leader's engine core is up and waits for the group: nothing serves yet.
    await _logged(leader, "Initializing a V1 LLM engine", START_S)
    assert _ready(url) is None
    joined_after = time.time()
    worker.start()
    wait_http(f"{url}/ready", timeout=START_S, process=leader)
    assert _engine_ready_at(leader) > joined_after  # opened only once the worker existed
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        page = (await c.get("/metrics")).text
        assert metric(page, "sluice_engine_nodes") == 2
        assert metric(page, "sluice_engine_node_rank") == 0
        assert metric(page, "sluice_engine_group_up") == 1

        body = {"prompt": "two nodes", "max_tokens": 12, "ignore_eos": True}
        r = await c.post("/v1/stream", json=body)
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert r.status_code == 200 and events[-1]["usage"]["completion_tokens"] == 12
        assert len([e for e in events if not e.get("finished")]) == 12

        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        r = await c.post("/v1/chat/completions", json=chat)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert chunks[-1]["usage"]["completion_tokens"] == 8

        # The worker node is lost.
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(timeout=30)
        # Heartbeats keep the stream's reads alive: bound the whole request (a hang fails).
        r = await asyncio.wait_for(c.post("/v1/stream", json=body), FAIL_S)
        assert r.status_code in (200, 503)  # an error event after the 200, or a refusal
        assert "EngineDeadError" in r.text or "Engine failed" in r.text, r.text[:500]
        ready = await c.get("/ready")
        assert ready.status_code == 503 and "engine unhealthy" in ready.text
        assert metric((await c.get("/metrics")).text, "sluice_engine_group_up") == 0
