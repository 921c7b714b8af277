"""sluice_bench.disagg (`make bench-disagg`): its targets table (pure), and the benchmark
end to end in a short form: both fleets (mixed, and prefill + decode pools behind the
router's two steps) serve every request, and the decode pool received the prompts' KV
instead of computing them (negative control: the mixed fleet hands nothing over). No speed
is asserted (numbers live in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from sluice_bench import disagg, docblock
from testkit.repo import ROOT

MIXED = {"side": "mixed", "pods": "4 mixed", "requests": 100, "long": 20, "errors": 0,
         "itl_p50_ms": 15.0, "itl_p99_ms": 97.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0,
         "ttft_p50_chat_ms": 80.0, "ttft_p50_long_ms": 500.0, "cached_prompt_share": 0.0}  # fmt: skip
DISAGG = {**MIXED, "side": "disaggregated", "pods": "2 prefill + 2 decode",
          "itl_p99_ms": 16.0, "ttft_p50_ms": 115.0, "cached_prompt_share": 0.99}  # fmt: skip


def test_each_target_says_whether_it_is_met():
    rows = disagg.target_rows(MIXED, DISAGG)
    assert [met for _, _, met in rows] == [True, True]
    assert "6.06x" in rows[0][1] and "1.15x" in rows[1][1]
    slower = {**DISAGG, "ttft_p50_ms": 130.0, "itl_p99_ms": 60.0}
    assert [met for _, _, met in disagg.target_rows(MIXED, slower)] == [False, False]
    failing = {**DISAGG, "errors": 1}  # a fleet that dropped a request meets nothing
    assert [met for _, _, met in disagg.target_rows(MIXED, failing)] == [False, False]


def test_the_table_goes_between_its_markers(tmp_path):
    doc = tmp_path / "benchmarks.md"
    begin, end = docblock.markers("disagg")
    doc.write_text(f"before\n{begin}\nOLD\n{end}\nafter\n")
    args = argparse.Namespace(
        rate=6.0, seconds=30.0, long_share=0.2, long_words=8000, chat_words=1000, max_tokens=200
    )
    docblock.write("disagg", "test", disagg.table(MIXED, DISAGG, args), doc)
    text = doc.read_text()
    assert "OLD" not in text and "| target | measured | met |" in text
    assert "| 2 prefill + 2 decode | 100 (20) | 0 |" in text and "99%" in text


@pytest.mark.slow
def test_short_bench_runs_both_fleets():
    proc = subprocess.run(
        [sys.executable, "-m", "sluice_bench.disagg", "--replicas", "2", "--prefill", "1",
         "--seconds", "1", "--rate", "4", "--long-words", "2000", "--chat-words", "200",
         "--max-tokens", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sides = {r["side"]: r for r in map(json.loads, proc.stdout.splitlines()[:2])}
    for side in sides.values():
        assert side["requests"] > 0 and side["errors"] == 0, side
    assert sides["mixed"]["cached_prompt_share"] == 0
    assert sides["disaggregated"]["cached_prompt_share"] > 0.9  # prompts' blocks handed over
    assert "| target | measured | met |" in proc.stdout
