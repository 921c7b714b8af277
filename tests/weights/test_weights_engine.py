"""End to end on the real engine: the tiny model fetched from the fake Hub into the cache's
layout, then served by `sluice-server` (vLLM, CPU) from the commit's folder with the Hub off
(`HF_HUB_OFFLINE=1`, as a model pod of a cache starts): it answers, and the Hub stand-in
sees no request from it."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from sluice_bench.procs import engine_env
from sluice_server.engine.tiny_model import ensure_tiny_model
from testkit.fake_hub import FakeHub
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

from .weights_helpers import run

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_a_fetched_folder_serves_with_the_hub_off(hub: FakeHub, root: Path, tmp_path: Path) -> None:
    tiny = ensure_tiny_model()
    hub.add_folder("acme/tiny", tiny)
    result, _ = run(hub, root, repo="acme/tiny")
    assert result.outcome == "ready"
    folder = root / "acme" / "tiny" / str(result.commit)
    assert {p.name for p in folder.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    served_before = len(hub.requests)
    port = free_port()
    # A short scratch folder: vLLM's ZMQ ipc sockets live there, and a socket path has at
    # most 107 characters (pytest's tmp_path under CI's base folder is longer).
    scratch = Path(tempfile.mkdtemp(prefix="sluice-weights-"))
    env = {k: v for k, v in engine_env(scratch).items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_ENDPOINT=hub.url)  # the Hub stand-in, to count requests
    argv = [sys.executable, "-m", "sluice_server", "--model", str(folder), "--served-model-name",
            "tiny", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
            "--max-num-seqs", "4", "--", "--enforce-eager", "--kv-cache-memory-bytes",
            str(256 * 2**20)]  # fmt: skip
    proc = ManagedProcess("server", argv, tmp_path, env=env).start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", timeout=900, process=proc)  # engine start: minutes when busy
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "the river", "max_tokens": 8, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    finally:
        proc.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    assert hub.requests[served_before:] == []
