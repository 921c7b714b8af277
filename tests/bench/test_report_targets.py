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


def _search(best, lag_p99, pinned=True, kb=20.0):
    """A fan-out search that passed at `best` streams and failed one step up."""
    return {
        "protocol": "sse",
        "itl_ms": 50.0,
        "workers": 1,
        "search": True,
        "pinned": pinned,
        "max_ok_streams": best,
        "stages": [
            _stage(best, lag_p99, kb, best * 20.0, 0.9),
            _stage(best * 2, 400.0, kb, best * 30.0, 1.0),
        ],  # fmt: skip
    }


def _results(sse_cpu, lag_p99, sluice_p99s, best=1200):
    matrix = [_point("vllm", 64, 5000, 150, 100.0), _point("sse", 64, 5000, 150, sse_cpu),
              _point("engine", 64, 6000, 120, 45.0)]  # fmt: skip
    bench = lambda p99: {"p99_ttft_ms": p99, "failed": 0}  # noqa: E731
    return {
        "settings": {"concurrency": [64]},
        "matrix": matrix,
        "baseline": report.baseline_from({"matrix": matrix}, "before.json"),
        "fanout": [
            # A ramp: its stages are information, not a target.
            {
                "protocol": "sse",
                "itl_ms": 50.0,
                "workers": 2,
                "max_ok_streams": 0,
                "stages": [_stage(2000, 300.0, 20.0, 40000, 1.6)],
            },
            _search(best, lag_p99),
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
    rows = report.target_rows(_results(sse_cpu=55.0, lag_p99=30.0, sluice_p99s=[210, 230]))
    assert [met for _, _, met in rows] == [True] * 5, rows
    fanout = next(m for g, m, _ in rows if g.startswith("Fan-out search"))
    assert fanout.startswith("1,200 streams = 24,000 tok/s offered"), fanout
    assert "24,000 tok/s per server core (server and load generator pinned apart" in fanout
    assert "the next step up (2,400 streams) failed" in fanout


def test_the_cpu_rows_are_judged_above_the_bare_engine_with_the_floor_beside():
    rows = report.target_rows(_results(sse_cpu=60.0, lag_p99=30.0, sluice_p99s=[200, 200]))
    goal, cpu, met = next(r for r in rows if r[0].startswith("Front-end CPU"))
    assert "<= 0.3x vLLM's server's" in goal
    assert cpu == (
        "(60 - 45) us vs (100 - 45) us = 0.27x (in all: 0.60x; the bare engine, no HTTP: 0.45x)"
    ), cpu
    assert met is True


def test_above_floor_is_undefined_without_a_serving_layer_to_compare():
    assert report.above_floor(60.0, 100.0, 45.0) == (60.0 - 45.0) / (100.0 - 45.0)
    assert report.above_floor(60.0, 40.0, 45.0) is None
    assert report.above_floor(None, 100.0, 45.0) is None


def test_a_number_past_its_bound_is_not_met():
    met = _met(_results(sse_cpu=70.0, lag_p99=30.0, sluice_p99s=[210, 250], best=800))
    assert (
        met["Front-end CPU / output token above the bare engine, Sluice /v1/stream (SSE), c=64"]
        is False
    )
    assert met["Fan-out search, sse"] is False  # 800 x 20 = 16,000 tok/s per core
    assert [m for g, m in met.items() if g.startswith("TTFT p99")] == [True, False]


def test_an_unpinned_search_divides_by_the_cores_the_server_used():
    results = _results(sse_cpu=55.0, lag_p99=30.0, sluice_p99s=[200, 200])
    results["fanout"] = [_search(1200, 30.0, pinned=False)]
    row = next(m for g, m, _ in report.target_rows(results) if g.startswith("Fan-out"))
    assert "26,667 tok/s per server core (not pinned: 0.90 server cores used" in row, row


def test_a_search_that_found_nothing_is_not_met():
    results = _results(sse_cpu=55.0, lag_p99=30.0, sluice_p99s=[200, 200])
    results["fanout"] = [{**_search(1200, 30.0), "max_ok_streams": 0}]
    rows = [r for r in report.target_rows(results) if r[0].startswith("Fan-out")]
    assert rows == [(rows[0][0], "no load passed", False)]


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
