"""The LoRA part of docs/benchmarks.md's generated section: the adapter/base table from a
run's `lora` result, with the command that measured it when `make bench-lora` ran apart from
the rest, and only the section between the markers rewritten (synthetic results, no engine)."""

from __future__ import annotations

from sluice_bench import report

LORA = {
    "adapter": {"rank": 8, "targets": "q,k,v,o,gate,up,down"},
    "repeats": 3,
    "max_tokens": 64,
    "rows": [{"concurrency": 8, "errors": 0, "base_ttft_p50_ms": 30.0,
              "adapter_ttft_p50_ms": 45.0, "ttft_ratio": 1.5, "base_tokens_per_s": 1200.0,
              "adapter_tokens_per_s": 600.0, "tokens_per_s_ratio": 0.5, "load_1m": 2.5}],
}  # fmt: skip
RESULTS = {
    "command": "python -m sluice_bench.run",
    "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 24, "os": "linux"},
    "versions": {"vllm": "0.32.0"},
    "settings": {},
    "phases_s": {"total": 60.0},
}


def test_the_section_shows_the_ratio_and_who_measured_it(tmp_path):
    note = tmp_path / "benchmarks.md"
    note.write_text(f"# Benchmarks\n\nhand-written\n\n{report.BEGIN}\nold\n{report.END}\ntail\n")
    report.write_section({**RESULTS, "lora": {**LORA, "command": "python -m sluice_bench."
                                             "lora_ratio --repeats 2"}}, tmp_path)  # fmt: skip
    text = note.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n\n") and text.endswith("\ntail\n")
    assert "old" not in text
    assert "### A LoRA adapter next to the base" in text
    assert "Measured by `python -m sluice_bench.lora_ratio --repeats 2`" in text
    assert "| 8 | 30.0 | 45.0 | 1.50 | 1200 | 600 | 0.50 | 0 | 2.5 |" in text


def test_from_the_whole_run_and_absent_without_one(tmp_path):
    with_lora = report.generated_section({**RESULTS, "lora": LORA}, tmp_path)
    assert "Measured by the run above" in with_lora
    assert "LoRA" not in report.generated_section(RESULTS, tmp_path)
