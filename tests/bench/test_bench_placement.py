"""`make bench-placement` in small sizes: the fleet model runs every workload under every
router, and the negative controls hold (prefix scoring off loses on the shared-prefix
workload: fewer prompt tokens cached, a higher TTFT)."""

from __future__ import annotations

from sluice_bench.placement import run, table


def test_placement_model_negative_controls():
    report = run(n=300, seed=3)
    rows = report["rows"]
    shared = rows["shared-prefix"]
    assert shared["prefix"].cached_share > shared["least-loaded"].cached_share + 0.05
    assert shared["prefix"].ttft_p50 < shared["least-loaded"].ttft_p50
    assert shared["prefix"].ttft_p50 < shared["round-robin"].ttft_p50
    # Nothing to share: prefix scoring costs nothing.
    unique = rows["unique"]
    assert unique["prefix"].ttft_p99 <= 1.1 * unique["least-loaded"].ttft_p99
    # One prompt for all still spreads.
    assert rows["one-prompt"]["prefix"].busiest_over_mean < 1.5
    assert "| target |" in table(report)
