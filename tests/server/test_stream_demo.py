"""`make demo` (`python -m sluice_server.demo`) end to end: its own server process on the
tiny model, one chat answer over SSE and one over WebSocket, TTFT and tokens/s printed,
then a graceful SIGTERM stop with exit code 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_demo_streams_over_sse_and_websocket(tiny_model_path):
    env = {**os.environ, "SLUICE_CACHE": str(tiny_model_path.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "sluice_server.demo", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=420, env=env,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr[-3000:]}"
    for label in ("SSE", "WebSocket"):
        m = re.search(rf"\[{label}\] TTFT (\d+) ms, 24 tokens in [\d.]+ s, (\d+|nan) tokens/s", out)
        assert m, f"no {label} summary in:\n{out}"
    assert "exit code 0" in out
    assert re.search(
        r"playground \(chat in a browser\): http://127\.0\.0\.1:\d+/playground", out
    ), out
    # Both protocols streamed the same seeded answer.
    answers = re.findall(r"---\n(.*?)\n\[(?:SSE|WebSocket)\]", out, re.DOTALL)
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0].strip()
