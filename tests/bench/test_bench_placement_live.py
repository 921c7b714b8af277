"""The live placement benchmark's report (sluice_bench.placement_live, written by
tests/e2e/test_router_placement_live.py): the targets against round robin and least-loaded
from the phases' counters, the table, and the generated block of docs/benchmarks.md it
replaces (docblock), leaving the hand-written text around it."""

from __future__ import annotations

import pytest
from sluice_bench import docblock
from sluice_bench import placement_live as bench


def phase(name: str, pods: int, counters: dict[str, tuple[float, float]], **picks) -> bench.Phase:
    return bench.Phase(name, pods, sent=90, ok=90, per_pod=counters, picks=picks)


def test_targets_and_section_from_the_phases_counters(tmp_path):
    def count(text: str) -> int:
        return len(text.split())

    w = bench.workload(count, tag="t", groups=3, per_group=2, block=8, prefix_blocks=2)
    prefix = phase("prefix", 3, {"a": (60, 100), "b": (30, 50), "c": (0, 50)}, prefix=70, load=20)
    rr = phase("round robin", 3, {"a": (10, 70), "b": (10, 70), "c": (10, 60)},
               **{"round-robin": 90})  # fmt: skip
    least = phase("least-loaded", 3, {"a": (20, 70), "b": (20, 70), "c": (10, 60)}, load=90)
    single = phase("one pod", 1, {"a": (50, 200)}, load=90)
    found = bench.targets(prefix, rr, least, single)
    assert [(t.text, round(t.value, 3), t.met) for t in found] == [
        ("prefix / one pod >= 0.9", 1.8, True),  # 0.45 / 0.25
        ("prefix - round robin > 0", 0.3, True),  # 0.45 - 0.15
        ("prefix - least-loaded > 0", 0.2, True),  # 0.45 - 0.25
    ]
    # Negative control: round robin as good as prefix placement is not met.
    tie = bench.targets(prefix, prefix, least, single)
    assert [t.met for t in tie] == [True, False, True]
    text = bench.section([prefix, rr, least, single], found, w, block=8, cache_blocks=4,
                         prefix_blocks=2)  # fmt: skip
    assert "3 pods, each with a KV cache of 4 blocks of 8 tokens" in text
    assert "| router picks (prefix / load / round-robin) |" in text
    assert "| round robin | 3 | 90/90 | 3 | 200 | 30 | 0.150 | 0 / 0 / 90 |" in text
    assert "| prefix - round robin > 0 | 0.300 | met |" in text

    doc = tmp_path / "benchmarks.md"
    begin, end = docblock.markers("placement-live")
    doc.write_text(f"# Benchmarks\n\nby hand\n\n{begin}\nold table\n{end}\n\nafter\n")
    docblock.write("placement-live", "the test", text, doc)
    page = doc.read_text()
    assert "old table" not in page and "| prefix - round robin > 0 |" in page
    assert page.startswith("# Benchmarks\n\nby hand\n\n" + begin)
    assert page.endswith(f"{end}\n\nafter\n")
    assert "<!-- Written by the test; edits here are overwritten. -->" in page
    docblock.write("placement-live", "the test", text, doc)  # again: the same page
    assert doc.read_text() == page
    with pytest.raises(SystemExit, match="no <!-- bench:balance:begin -->"):
        docblock.write("balance", "the test", text, doc)
