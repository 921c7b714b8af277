"""`make bench` end to end in its short form (`run.py --quick`): every phase (vLLM's server,
our server and the bare engine on the tiny model, the matrix, the cross-check with vLLM's
own benchmark client, both fan-out ramps with one and two front-end workers and the fan-out
search with server and client pinned apart, a LoRA adapter
next to the base, fairness between tenants on the simulator) runs on a fresh machine and
writes its outputs.
No speed is asserted here (numbers live in docs/benchmarks.md); errors are, because a
benchmark request that fails is a bug, not noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.repo import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_quick_bench_runs_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sluice_bench.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench-results.json").read_text())

    matrix = results["matrix"]
    assert {r["system"] for r in matrix} == {"engine", "vllm", "openai", "sse", "websocket"}
    max_tokens = results["settings"]["max_tokens"]
    assert results["settings"]["ignore_eos"] and max_tokens > 1
    for row in matrix:
        assert row["errors"] == 0 and row["ok"] == row["requests"] > 0, row
        assert row["output_tokens"] == row["requests"] * max_tokens, row  # with ignore_eos
        assert row["front_cpu_us_per_token"] > 0, row
    assert results["settings"]["cpu_layout"], "engine processes were not separated"

    for target in results["crosscheck"]["targets"].values():
        for theirs in target["vllm_bench"]:
            assert "error" not in theirs and theirs["failed"] == 0, theirs
        assert all(r["errors"] == 0 for r in target["ours"])

    ramps = [r for r in results["fanout"] if not r.get("search")]
    for ramp in ramps:
        assert ramp["stages"] and all(s["errors"] == 0 for s in ramp["stages"]), ramp
    assert {r["workers"] for r in ramps} == {1, 2}  # one process, and a pod of 2
    # The search pushes until a stage fails: only the load it reports must be clean.
    searches = [r for r in results["fanout"] if r.get("search")]
    assert {r["protocol"] for r in searches} == {"sse", "websocket"}
    for search in searches:
        best = [s for s in search["stages"] if s["streams"] == search["max_ok_streams"]]
        assert best and best[0]["new_errors"] == 0, search

    for row in results["lora"]["rows"]:
        assert row["errors"] == 0 and row["ttft_ratio"] > 0 and row["tokens_per_s_ratio"] > 0
    for name in (
        "bench-results.md",
        "bench-throughput.png",
        "bench-fanout.md",
        "benchmarks.md",
        "bench-lora.md",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    note = (tmp_path / "benchmarks.md").read_text()
    assert "### Targets" in note and "| target | measured | met |" in note
    assert "### Cross-check with vLLM's benchmark client" in note
    assert "### Front-end workers (`--api-workers`): scaling with cores" in note

    fair = json.loads((tmp_path / "bench-fairness.json").read_text())["simulator"]
    for label, r in fair["ttft"].items():  # the steady tenant is served under every policy
        assert r["B"]["requests"] > 0, label  # but today's (no queue: 429s)
        assert r["B"]["ok"] + r["B"]["refused_429"] == r["B"]["requests"], (label, r)
    assert fair["ttft"]["queue + slot shares"]["B"]["refused_429"] == 0
    assert fair["shares"]["A"]["tokens"] > 0 and fair["shares"]["B"]["tokens"] > 0
    assert fair["priority"]["interactive"]["refused_429"] == 0
    assert "<!-- bench:fairness:begin -->" in note and "Both backlogged" in note


def test_quick_balance_bench_runs_and_reads_the_servers_counts():
    """sluice_bench.balance --direct in a short form: four runs through nginx, no request
    fails, and every replica's own active-streams count was read (no speed asserted)."""
    if not any(
        Path(p).exists()
        for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/bin/nginx")
    ):  # nginx_proxy's places
        pytest.skip("nginx not installed (apt-get install nginx)")
    proc = subprocess.run(
        [sys.executable, "-m", "sluice_bench.balance", "--direct", "--requests", "24",
         "--rate", "12"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _phases(proc.stdout)
    assert [(r["mix"], r["balance"]) for r in rows] == [
        ("random", "round-robin"), ("random", "least-loaded"),
        ("every 3rd", "round-robin"), ("every 3rd", "least-loaded"),
    ]  # fmt: skip
    for row in rows:
        assert row["failed"] == 0 and len(row["active_means"]) == 3, row
        assert sum(row["active_means"]) > 0, row


def _phases(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.e2e
def test_live_balance_bench_runs_on_pods_through_the_ingress(tmp_path):
    """sluice_bench.balance on live pods (what `make bench-balance` runs) in a short form:
    the operator's three pods behind the e2e ingress, the model patched between phases and
    each phase run on the method its annotation asks for, no request fails, every pod's own
    active-streams count was read (no speed asserted)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sluice_bench.balance", "--requests", "12", "--rate",
         "6", "--ttft-ms", "20", "--ttft-per-stream-ms", "20", "--itl-ms", "5",
         "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "live pods skipped:" in proc.stdout:
        pytest.skip(proc.stdout.split("live pods skipped:", 1)[1].splitlines()[0].strip())
    rows = _phases(proc.stdout)
    assert [(r["mix"], r["balance"], r["method"]) for r in rows] == [
        ("random", "round-robin", "round_robin"), ("random", "least-loaded", "least_conn"),
        ("every 3rd", "round-robin", "round_robin"), ("every 3rd", "least-loaded", "least_conn"),
    ]  # fmt: skip
    for row in rows:
        assert row["failed"] == 0 and len(row["active_means"]) == 3, row
        assert sum(row["active_means"]) > 0, row
    assert "live pods of one StreamingModel" in proc.stdout  # the table says where it ran
