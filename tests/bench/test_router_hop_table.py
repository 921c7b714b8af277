"""sluice_bench.router_hop's targets table: each router cost target with met / not met,
and the docs block it writes (pure: no servers)."""

from __future__ import annotations

from sluice_bench import docblock, router_hop

RESULT = {
    "streams": 16, "tokens_per_stream": 500, "router_cpu_s_per_1k_tokens": 0.03,
    "server_cpu_s_per_1k_tokens_direct": 0.06, "router_to_server_cpu_ratio": 0.5,
    "ttft_p50_ms_direct": 20.0, "ttft_p50_ms_router": 21.0, "ttft_p50_ms_added": 1.0,
    "held_streams": 200, "router_rss_per_stream_kb": 15.0,
    "tokenizing": {"chat_tokens": 1500, "tokenize_p50_ms_whole_text": 5.0,
                   "tokenize_p50_ms_warm": 0.5, "tokenize_p50_ms_cold": 5.0},
}  # fmt: skip


def test_each_target_says_whether_it_is_met():
    rows = router_hop.target_rows(RESULT)
    assert [met for _, _, met in rows] == [False, True, False, True]
    warm = rows[1][1]
    assert "hop 1.0 ms + tokenizing 0.5 ms = 1.5 ms" in warm
    cheaper = {**RESULT, "router_to_server_cpu_ratio": 0.2, "router_rss_per_stream_kb": 25.0}
    assert [met for _, _, met in router_hop.target_rows(cheaper)] == [True, True, False, False]


def test_the_table_goes_between_its_markers(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    begin, end = docblock.markers("router-hop")
    doc.write_text(f"before\n{begin}\nOLD-TABLE\n{end}\nafter\n")
    router_hop.write(router_hop.table(RESULT), doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "OLD-TABLE" not in text
    assert "| target | measured | met |" in text and "**no**" in text
