"""The targets table in docs/benchmarks.md: each target is judged from the numbers it shows,
and a number on the wrong side of its bound reads "not met" (synthetic results, no engine)."""

from __future__ import annotations

from sluice_bench import report


def _point(system, conc, tps, ttft, cpu, errors=0):
    return {"system": system, "concurrency": conc, "tokens_per_s": tps, "ttft_p50_ms": ttft,
            "ttft_p99_ms": ttft * 2, "itl_p50_ms": 5.0, "itl_p99_ms": 9.0,
            "front_cpu_us_per_token": cpu, "errors": errors, "requests": 10}  # fmt: skip


def _stage(streams, lag_p99, kb, tps, cores, errors=0):
    return {"streams": streams, "errors": errors, "lag_p99_ms": lag_p99,
            "rss_per_stream_kb": kb, "tokens_per_s": tps, "server_cores": cores,
            "expected_tokens_per_s": streams * 20.0}  # fmt: skip


def _results(sse_cpu, lag_p99, sluice_p99s):
    matrix = [_point("vllm", 64, 5000, 150, 100.0), _point("sse", 64, 5000, 150, sse_cpu),
              _point("engine", 64, 6000, 120, 45.0)]  # fmt: skip
    bench = lambda p99: {"p99_ttft_ms": p99, "failed": 0}  # noqa: E731
    return {
        "settings": {"concurrency": [64]},
        "matrix": matrix,
        "baseline": report.baseline_from({"matrix": matrix}, "before.json"),
        "fanout": [
            {
                "protocol": "sse",
                "itl_ms": 50.0,
                "workers": 1,
                "stages": [_stage(2000, 30.0, 20.0, 40000, 1.0)],
            },
            {
                "protocol": "sse",
                "itl_ms": 50.0,
                "workers": 2,
                "stages": [_stage(2000, lag_p99, 20.0, 40000, 1.6)],
            },
        ],  # fmt: skip
        "crosscheck": {
            "concurrency": 64,
            "targets": {
                "vllm": {"vllm_bench": [bench(200.0), bench(200.0)]},
                "openai": {"vllm_bench": [bench(p) for p in sluice_p99s]},
            },
        },  # fmt: skip
    }


def _met(results) -> dict[str, bool]:
    return {goal.split(":")[0]: met for goal, _, met in report.target_rows(results)}


def test_every_target_met_when_the_numbers_are_inside_their_bounds():
    rows = report.target_rows(_results(sse_cpu=40.0, lag_p99=30.0, sluice_p99s=[210, 230]))
    assert [met for _, _, met in rows] == [True] * 5, rows
    fanout = next(m for g, m, _ in rows if g.startswith("Fan-out"))
    assert "1 worker 40,000, 2 workers 25,000" in fanout and "1.00x" in fanout


def test_the_cpu_rows_show_the_floor_no_http_server_goes_below():
    rows = report.target_rows(_results(sse_cpu=60.0, lag_p99=30.0, sluice_p99s=[200, 200]))
    cpu = next(m for g, m, _ in rows if g.startswith("Front-end CPU"))
    assert cpu == "60 us vs 100 us = 0.60x (the bare engine, no HTTP: 0.45x)", cpu


def test_a_number_past_its_bound_is_not_met():
    met = _met(_results(sse_cpu=60.0, lag_p99=80.0, sluice_p99s=[210, 250]))
    assert met["Front-end CPU / output token, Sluice /v1/stream (SSE), c=64"] is False
    assert met["Fan-out, sse, 2 workers"] is False
    assert [m for g, m in met.items() if g.startswith("TTFT p99")] == [True, False]


def test_regression_against_the_earlier_run():
    results = _results(sse_cpu=40.0, lag_p99=30.0, sluice_p99s=[200, 200])
    agg = report.aggregate(results["matrix"])
    assert all(r["met"] for r in report.regression_rows(agg, results["baseline"]))
    slower = {**results, "matrix": [_point("vllm", 64, 5000, 150, 100.0),
                                    _point("sse", 64, 4000, 150, 40.0)]}  # fmt: skip
    rows = report.regression_rows(report.aggregate(slower["matrix"]), results["baseline"])
    assert [(r["system"], round(r["tps_norm"], 2), r["met"]) for r in rows] == [("sse", 0.8, False)]
    # A slower machine moves vLLM's server alike: normalised, nothing regressed.
    machine = {**results, "matrix": [_point("vllm", 64, 2500, 300, 100.0),
                                     _point("sse", 64, 2500, 300, 40.0)]}  # fmt: skip
    rows = report.regression_rows(report.aggregate(machine["matrix"]), results["baseline"])
    assert [(round(r["tps_ratio"], 2), round(r["tps_norm"], 2), r["met"]) for r in rows] == [
        (0.5, 1.0, True)
    ]
