"""Turn bench-results.json into the markdown tables, the plot and docs/benchmarks.md.

`python -m sluice_bench.report docs/bench-results.json` re-renders without rerunning.
docs/benchmarks.md keeps its hand-written method and reading guide: only the part between
the `<!-- bench:generated -->` markers is replaced.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from sluice_bench import docblock

BEGIN, END = "<!-- bench:generated:begin -->", "<!-- bench:generated:end -->"
SYSTEMS = ["engine", "vllm", "openai", "sse", "websocket"]
LABELS = {
    "engine": "bare engine (AsyncLLM.generate)",
    "vllm": "vLLM OpenAI server",
    "openai": "Sluice /v1/chat/completions",
    "sse": "Sluice /v1/stream (SSE)",
    "websocket": "Sluice /ws/stream (WebSocket)",
}
OURS = ["openai", "sse", "websocket"]
METRICS = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s",
           "front_cpu_us_per_token"]  # fmt: skip


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(rows: list[dict]) -> dict:
    """(system, concurrency) -> median over repeats of each metric, errors summed."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        agg = {m: _med([r.get(m) for r in rs]) for m in METRICS}
        agg["tokens_per_s_min"] = min(r["tokens_per_s"] for r in rs)
        agg["tokens_per_s_max"] = max(r["tokens_per_s"] for r in rs)
        agg["errors"] = sum(r["errors"] for r in rs)
        agg["requests"] = sum(r["requests"] for r in rs)
        agg["repeats"] = len(rs)
        out[key] = agg
    return out


def _f(v, digits=0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def matrix_table(agg: dict, concs: list[int], systems: list[str]) -> str:
    lines = [
        "| concurrency | system | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s (min-max) | front-end CPU us / token | errors / requests |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in concs:
        for s in systems:
            a = agg.get((s, c))
            if a is None:
                continue
            lines.append(
                f"| {c} | {LABELS[s]} | {_f(a['ttft_p50_ms'], 1)} | {_f(a['ttft_p99_ms'], 1)} | "
                f"{_f(a['itl_p50_ms'], 2)} | {_f(a['itl_p99_ms'], 2)} | "
                f"{_f(a['tokens_per_s'])} ({_f(a['tokens_per_s_min'])}-{_f(a['tokens_per_s_max'])}) | "
                f"{_f(a.get('front_cpu_us_per_token'))} | {a['errors']} / {a['requests']} |"
            )
    return "\n".join(lines)


# Front-end CPU per output token at the concurrencies where the serving layer's own cost
# matters, measured above the bare engine: every server on vLLM's AsyncLLM pays its front
# end (detokenizing, output objects, stat loggers: the bare engine's process, no HTTP), so
# the target is our cost above that floor against vLLM's server's cost above the same floor.
# The token protocols (SSE, WebSocket) carry less per token than OpenAI's chunk format, so
# they get the tighter bound.
CPU_TARGET = {"sse": 0.3, "websocket": 0.3, "openai": 0.5}
CPU_TARGET_CONCS = (32, 64)


def above_floor(ours: float | None, vllm: float | None, engine: float | None) -> float | None:
    """(ours - bare engine) / (vLLM's server - bare engine), CPU per token: the share of
    vLLM's serving-layer cost that ours costs. None when a number is missing or vLLM's
    server costs no more than the bare engine (nothing to compare against)."""
    if ours is None or vllm is None or engine is None or vllm <= engine:
        return None
    return (ours - engine) / (vllm - engine)


def ratio_rows(agg: dict, concs: list[int]) -> list[dict]:
    """Our routes against vLLM's server and the bare engine. The tok/s and TTFT ratios are
    information (the engine bounds both here); the target is front-end CPU per token above
    the bare engine."""
    rows = []
    for s in OURS:
        for c in concs:
            a, v, e = agg.get((s, c)), agg.get(("vllm", c)), agg.get(("engine", c))
            if a is None:
                continue
            tps_v = _ratio(a["tokens_per_s"], v and v["tokens_per_s"])
            tps_e = _ratio(a["tokens_per_s"], e and e["tokens_per_s"])
            ttft_v = _ratio(a["ttft_p50_ms"], v and v["ttft_p50_ms"])
            cpu_us, cpu_vllm = (
                a.get("front_cpu_us_per_token"),
                v and v.get("front_cpu_us_per_token"),
            )
            cpu_engine = e and e.get("front_cpu_us_per_token")
            cpu_v = _ratio(cpu_us, cpu_vllm)
            # The bare engine's share of vLLM's server's cost: the floor of the total ratio.
            floor = _ratio(cpu_engine, cpu_vllm)
            above = above_floor(cpu_us, cpu_vllm, cpu_engine)
            if c in CPU_TARGET_CONCS:
                need = CPU_TARGET[s]
                target = f"front-end CPU / token above the bare engine <= {need}x vLLM's, no errors"
                met = above is not None and above <= need and a["errors"] == 0
            else:
                target, met = "- (information)", None
            rows.append({"system": s, "concurrency": c, "tps_vs_vllm": tps_v,
                         "tps_vs_engine": tps_e, "ttft_p50_vs_vllm": ttft_v,
                         "cpu_vs_vllm": cpu_v, "cpu_us": cpu_us, "cpu_us_vllm": cpu_vllm,
                         "cpu_us_engine": cpu_engine, "cpu_above_engine_vs_vllm": above,
                         "cpu_floor_vs_vllm": floor, "target": target, "met": met})  # fmt: skip
    return rows


def ratio_table(rows: list[dict]) -> str:
    lines = [
        "| route | concurrency | tok/s vs vLLM server | tok/s vs bare engine | TTFT p50 vs vLLM server | front-end CPU per token vs vLLM server | the same above the bare engine | target | met |",
        "|---|---:|---:|---:|---:|---:|---:|---|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {LABELS[r['system']]} | {r['concurrency']} | {_f(r['tps_vs_vllm'], 2)}x | "
            f"{_f(r['tps_vs_engine'], 2)}x | {_f(r['ttft_p50_vs_vllm'], 2)}x | "
            f"{_f(r.get('cpu_vs_vllm'), 2)}x | {_f(r.get('cpu_above_engine_vs_vllm'), 2)}x | "
            f"{r['target']} | "
            f"{docblock.met_cell(r['met'])} |"
        )
    return "\n".join(lines)


# The two clients measure the same server on the same point: they "agree" when their
# medians of output tok/s are within 10% and of TTFT p50 within 20% (TTFT at c=32 is ~100 ms,
# where one engine step more or less before the first token is already ~10%).
AGREE_TPS, AGREE_TTFT = 0.10, 0.20


def crosscheck_table(cc: dict) -> str:
    rounds = cc.get("rounds", 1)
    lines = [
        f"Concurrency {cc['concurrency']}, {cc['num_requests']} requests, same prompts and "
        f"max_tokens; each round runs both clients against both servers back to back, "
        f"{rounds} round(s); cells are medians over rounds, with each round's tok/s and "
        "TTFT p99 in brackets:",
        "",
        "| server | client | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | failed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for system, t in cc["targets"].items():
        theirs = [r for r in _listify(t["vllm_bench"]) if "error" not in r]
        ours = _listify(t["ours"])
        if theirs:
            tps = [r["output_throughput"] for r in theirs]
            lines.append(
                f"| {LABELS[system]} | `vllm bench serve` | {_f(_med(tps))} "
                f"({', '.join(_f(x) for x in tps)}) | "
                f"{_f(_med([r['median_ttft_ms'] for r in theirs]), 1)} | "
                f"{_f(_med([r['p99_ttft_ms'] for r in theirs]), 1)} "
                f"({', '.join(_f(r['p99_ttft_ms'], 1) for r in theirs)}) | "
                f"{_f(_med([r['median_itl_ms'] for r in theirs]), 2)} | "
                f"{sum(r['failed'] for r in theirs)} |"
            )
        else:
            lines.append(
                f"| {LABELS[system]} | `vllm bench serve` | failed: see the run's logs | | | | |"
            )
        tps_o = [r["tokens_per_s"] for r in ours]
        lines.append(
            f"| {LABELS[system]} | ours (testing/sluice_bench/loadgen.py) | {_f(_med(tps_o))} "
            f"({', '.join(_f(x) for x in tps_o)}) | "
            f"{_f(_med([r['ttft_p50_ms'] for r in ours]), 1)} | "
            f"{_f(_med([r['ttft_p99_ms'] for r in ours]), 1)} "
            f"({', '.join(_f(r['ttft_p99_ms'], 1) for r in ours)}) | "
            f"{_f(_med([r['itl_p50_ms'] for r in ours]), 2)} | {sum(r['errors'] for r in ours)} |"
        )
        if theirs and _med(tps):
            d = _med(tps_o) / _med(tps) - 1
            ttft_t = _med([r["median_ttft_ms"] for r in theirs])
            ttft_o = _med([r["ttft_p50_ms"] for r in ours])
            d_ttft = ttft_o / ttft_t - 1 if ttft_t else None
            lines.append(
                f"| | ours / theirs - 1 (medians) | {d:+.1%} | "
                f"{'' if d_ttft is None else f'{d_ttft:+.1%}'} | | | |"
            )
            agree = abs(d) <= AGREE_TPS and d_ttft is not None and abs(d_ttft) <= AGREE_TTFT
            lines.append(
                f"| | agree (tok/s within {AGREE_TPS:.0%}, TTFT p50 within {AGREE_TTFT:.0%}) | "
                f"{'yes' if agree else '**no**'} | | | | |"
            )
    first = next(iter(cc["targets"].values()), None)
    if first:
        lines += ["", f"vLLM's client was run as `{first['command']}` (base URL per server)."]
    return "\n".join(lines)


def _listify(x):
    return x if isinstance(x, list) else [x]


def fanout_tables(fanout: list[dict]) -> str:
    parts = []
    for f in fanout:
        rate = 1000.0 / f["itl_ms"]
        workers = f.get("workers", 1)
        how = ""
        if f.get("search"):
            how = ", search" + (" (server and client pinned apart)" if f.get("pinned") else "")
        parts.append(
            f"**{f['protocol']}**, {workers} worker{'s' if workers > 1 else ''}{how}, "
            f"{rate:g} tokens/s per stream (simulator ITL {f['itl_ms']:g} ms): "
            f"largest concurrency with p99 lag < 50 ms and no errors: **{f['max_ok_streams']:,}**; "
            f"idle server RSS {f.get('baseline_rss_mb', 0):.0f} MB."
        )
        parts.append("")
        parts.append(
            "| streams | errors | tok/s (expected) | lag p50 ms | lag p99 ms | lag max ms | server RSS MB | KB / stream | KB / added stream | server cores | cores per 1k tok/s | machine busy |"
        )
        parts.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        prev = None
        for s in f["stages"]:
            busy = s.get("machine_busy_pct")
            # RSS growth over idle / streams includes one-time growth (allocator arenas,
            # first use of code paths); the slope between stages is what each stream adds.
            added = (
                (s["server_rss_mb"] - prev["server_rss_mb"])
                * 1024
                / (s["streams"] - prev["streams"])
                if prev and s["streams"] > prev["streams"]
                else None
            )
            prev = s
            parts.append(
                f"| {s['streams']:,} | {s['errors']} | {_f(s['tokens_per_s'])} ({_f(s['expected_tokens_per_s'])}) | "
                f"{_f(s['lag_p50_ms'], 1)} | {_f(s['lag_p99_ms'], 1)} | {_f(s['lag_max_ms'], 1)} | "
                f"{_f(s['server_rss_mb'])} | {_f(s['rss_per_stream_kb'], 1)} | {_f(added, 1)} | {_f(s['server_cores'], 2)} | "
                f"{_f(s['cores_per_1k_tps'], 3)} | {_f(busy)}{'%' if busy is not None else ''} |"
            )
        if f.get("error_samples"):
            parts.append("")
            parts.append("Errors seen: " + "; ".join(f"`{e}`" for e in f["error_samples"]))
        parts.append("")
    return "\n".join(parts)


# The pod the projection is for: its cores, one of them left to vLLM's engine core.
PROJECTED_POD_CORES = 8


def worker_scaling_table(fanout: list[dict]) -> str:
    """Per protocol and rate, every stage of every worker count: tokens/s delivered, lag,
    server cores, tokens/s per server core, and the scaling factor over one worker at the
    same offered load (stage). Then a projection for an 8-core pod from the measured
    per-core cost (the median over the stages of the run with the most workers), labelled
    as such."""
    rows = [
        "| protocol | tok/s per stream | streams | workers | tok/s (expected) | lag p99 ms "
        "| server cores | tok/s per core | scaling vs 1 worker |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    projections = []
    groups: dict[tuple, list[dict]] = {}
    for f in fanout:
        if f.get("search"):
            continue  # the search's stages are not the ramp's offered loads
        groups.setdefault((f["protocol"], f["itl_ms"]), []).append(f)
    for (proto, itl), runs in groups.items():
        by_stage: dict[int, dict[int, dict]] = {}
        for f in runs:
            for st in f["stages"]:
                by_stage.setdefault(st["streams"], {})[f.get("workers", 1)] = st
        for streams in sorted(by_stage):
            one = by_stage[streams].get(1)
            for w, st in sorted(by_stage[streams].items()):
                tps, cores = st["tokens_per_s"], st["server_cores"]
                per_core = tps / cores if cores else None
                scale = tps / one["tokens_per_s"] if one and one["tokens_per_s"] else None
                rows.append(
                    f"| {proto} | {1000 / itl:g} | {streams:,} | {w} | {_f(tps)} "
                    f"({_f(st['expected_tokens_per_s'])}) | {_f(st['lag_p99_ms'], 1)} | "
                    f"{_f(cores, 2)} | {_f(per_core)} | {_f(scale, 2)}{'x' if scale else ''} |"
                )
        most = max(runs, key=lambda f: f.get("workers", 1))
        costs = sorted(st["tokens_per_s"] / st["server_cores"] for st in most["stages"]
                       if st["server_cores"])  # fmt: skip
        if costs:
            per_core = costs[len(costs) // 2]
            workers = PROJECTED_POD_CORES - 1
            projections.append(
                f"- {proto}, {1000 / itl:g} tok/s per stream: {workers} workers x "
                f"{_f(per_core)} tok/s per core (median of the {most.get('workers', 1)}-worker "
                f"stages) = **{_f(workers * per_core)} tok/s**, about "
                f"{_f(workers * per_core / (1000 / itl))} streams at that rate"
            )
    text = "\n".join(rows)
    if projections:
        text += (
            f"\n\n**Projection, not measured**: a {PROJECTED_POD_CORES}-core pod, one core "
            f"left to vLLM's engine core and {PROJECTED_POD_CORES - 1} front-end workers, "
            "if each worker's cost per token stays what it was here and nothing else (the "
            "engine, the network) limits first. Here the client and other work shared the "
            "same 2 cores, so the server got only part of them:\n\n" + "\n".join(projections)
        )
    return text + "\n"


# The regression check: this run's routes against the results file it replaces (run.py
# embeds that file's medians as results["baseline"], read before it overwrites it). The
# runs may land on different machines or loads (both are shared), which moves every system
# alike: the verdict compares each route's ratio to vLLM's server (unchanged between the
# runs) now and then, and a normalised ratio inside these bounds counts as noise. The raw
# ratios are shown too.
REGRESSION_TPS_MIN, REGRESSION_TTFT_MAX = 0.90, 1.20


def baseline_from(results: dict, source: str) -> dict | None:
    """The medians the regression check needs from another results file."""
    if not results.get("matrix"):
        return None
    points = [
        {"system": s, "concurrency": c, "tokens_per_s": a["tokens_per_s"],
         "ttft_p50_ms": a["ttft_p50_ms"]}
        for (s, c), a in sorted(aggregate(results["matrix"]).items())
    ]  # fmt: skip
    return {
        "source": source,
        "command": results.get("command"),
        "load_avg_at_start": results.get("machine", {}).get("load_avg_at_start"),
        "cpu": results.get("machine", {}).get("cpu"),
        "points": points,
    }


def regression_rows(agg: dict, baseline: dict) -> list[dict]:
    base = {(b["system"], b["concurrency"]): b for b in baseline["points"]}
    rows = []
    for s in OURS:
        for c in sorted({k[1] for k in agg}):
            a, b = agg.get((s, c)), base.get((s, c))
            if a is None or b is None:
                continue
            tps = _ratio(a["tokens_per_s"], b["tokens_per_s"])
            ttft = _ratio(a["ttft_p50_ms"], b["ttft_p50_ms"])
            v, vb = agg.get(("vllm", c)), base.get(("vllm", c))
            vtps = _ratio(v and v["tokens_per_s"], vb and vb["tokens_per_s"])
            vttft = _ratio(v and v["ttft_p50_ms"], vb and vb["ttft_p50_ms"])
            tps_n, ttft_n = _ratio(tps, vtps), _ratio(ttft, vttft)
            rows.append({
                "system": s, "concurrency": c, "tps": a["tokens_per_s"],
                "tps_before": b["tokens_per_s"], "tps_ratio": tps, "ttft": a["ttft_p50_ms"],
                "ttft_before": b["ttft_p50_ms"], "ttft_ratio": ttft,
                "vllm_tps_ratio": vtps, "vllm_ttft_ratio": vttft,
                "tps_norm": tps_n, "ttft_norm": ttft_n,
                "met": tps_n is not None and tps_n >= REGRESSION_TPS_MIN and ttft_n is not None
                and ttft_n <= REGRESSION_TTFT_MAX and a["errors"] == 0,
            })  # fmt: skip
    return rows


def regression_table(rows: list[dict], baseline: dict) -> str:
    lines = [
        f"Against {baseline['source']} (`{baseline.get('command')}`), same server flags "
        "(`--api-workers 1`). Now / before, raw and normalised by "
        "vLLM's server (unchanged between the runs, so its own ratio is how much the machine "
        "moved): a point is not worse when the normalised tok/s ratio is >= "
        f"{REGRESSION_TPS_MIN:.2f}x and the normalised TTFT p50 ratio <= "
        f"{REGRESSION_TTFT_MAX:.2f}x (noise on a shared machine).",
        "",
        "| route | concurrency | tok/s now (before) | tok/s ratio (vLLM's) | tok/s normalised "
        "| TTFT p50 ms now (before) | TTFT p50 ratio (vLLM's) | TTFT p50 normalised "
        "| not worse |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {LABELS[r['system']]} | {r['concurrency']} | {_f(r['tps'])} ({_f(r['tps_before'])}) "
            f"| {_f(r['tps_ratio'], 2)}x ({_f(r['vllm_tps_ratio'], 2)}x) | {_f(r['tps_norm'], 2)}x "
            f"| {_f(r['ttft'], 1)} ({_f(r['ttft_before'], 1)}) | {_f(r['ttft_ratio'], 2)}x "
            f"({_f(r['vllm_ttft_ratio'], 2)}x) | {_f(r['ttft_norm'], 2)}x | {docblock.met_cell(r['met'])} |"
        )
    return "\n".join(lines)


# Fan-out target: the largest offered load at 20 tokens/s per stream (simulator ITL 50 ms)
# with p99 lag under 50 ms and no errors, found by a search with the server (one worker) and
# the load generator pinned to cores of their own, per server core: 2,000 streams on a
# 2-core pod's worth of front end is 20,000 tok/s per core. Memory per stream at that load.
FANOUT_SEARCH_ITL_MS, FANOUT_LAG_MS, FANOUT_KB = 50.0, 50.0, 50.0
FANOUT_TPS_PER_CORE = 20_000.0
# TTFT p99 at this concurrency, per cross-check round, against vLLM's server.
TTFT_P99_CONC, TTFT_P99_MAX = 64, 1.2


def _stage(ramp: dict | None, streams: int) -> dict | None:
    return next((s for s in (ramp or {}).get("stages", []) if s["streams"] == streams), None)


def fanout_search_rows(fanout: list[dict]) -> list[tuple[str, str, bool | None]]:
    """One target row per protocol's fan-out search."""
    rows: list[tuple[str, str, bool | None]] = []
    for f in fanout:
        if not f.get("search") or f["itl_ms"] != FANOUT_SEARCH_ITL_MS:
            continue
        goal = (f"Fan-out search, {f['protocol']}: largest offered load at "
                f"{1000 / FANOUT_SEARCH_ITL_MS:g} tok/s per stream with p99 lag < "
                f"{FANOUT_LAG_MS:g} ms and 0 errors, >= {FANOUT_TPS_PER_CORE:,.0f} tok/s per "
                f"server core, < {FANOUT_KB:g} KB / stream")  # fmt: skip
        st = _stage(f, f["max_ok_streams"])
        if st is None:
            rows.append((goal, "no load passed", False))
            continue
        # Pinned, the server has one core; unpinned, divide by the cores it used.
        cores = 1.0 if f.get("pinned") else st["server_cores"]
        per_core = st["expected_tokens_per_s"] / cores if cores else None
        fails = [s["streams"] for s in f["stages"] if s["streams"] > f["max_ok_streams"]]
        where = ("server and load generator pinned apart" if f.get("pinned")
                 else f"not pinned: {_f(cores, 2)} server cores used")  # fmt: skip
        measured = (
            f"{f['max_ok_streams']:,} streams = {_f(st['expected_tokens_per_s'])} tok/s offered, "
            f"{_f(st['tokens_per_s'])} delivered, p99 lag {_f(st['lag_p99_ms'], 1)} ms, "
            f"{_f(st['rss_per_stream_kb'], 1)} KB / stream; "
            f"{_f(per_core)} tok/s per server core ({where}; machine busy "
            f"{_f(st.get('machine_busy_pct'))}%)"
            + (f"; the next step up ({min(fails):,} streams) failed" if fails
               else "; no step failed: the search stopped at its cap")
        )  # fmt: skip
        met = (per_core is not None and per_core >= FANOUT_TPS_PER_CORE
               and st["rss_per_stream_kb"] < FANOUT_KB)  # fmt: skip
        rows.append((goal, measured, met))
    return rows


def target_rows(results: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target the benchmark checks."""
    rows: list[tuple[str, str, bool | None]] = []
    if results.get("matrix"):
        agg = aggregate(results["matrix"])
        for r in ratio_rows(agg, results["settings"]["concurrency"]):
            if r["met"] is None:
                continue
            rows.append((
                f"Front-end CPU / output token above the bare engine, {LABELS[r['system']]}, "
                f"c={r['concurrency']}: <= {CPU_TARGET[r['system']]}x vLLM's server's",
                f"({_f(r['cpu_us'])} - {_f(r['cpu_us_engine'])}) us vs "
                f"({_f(r['cpu_us_vllm'])} - {_f(r['cpu_us_engine'])}) us = "
                f"{_f(r['cpu_above_engine_vs_vllm'], 2)}x (in all: {_f(r['cpu_vs_vllm'], 2)}x; "
                f"the bare engine, no HTTP: {_f(r['cpu_floor_vs_vllm'], 2)}x)",
                r["met"],
            ))  # fmt: skip
    rows += fanout_search_rows(results.get("fanout", []))
    base = results.get("baseline")
    if results.get("matrix") and base:
        reg = regression_rows(aggregate(results["matrix"]), base)
        if reg:
            worst_tps = min(reg, key=lambda r: r["tps_norm"] or 0)
            worst_ttft = max(reg, key=lambda r: r["ttft_norm"] or 0)
            rows.append((
                "Tokens/s and TTFT p50, our routes, c=1-64, `--api-workers 1`: not worse than "
                f"the previous committed results (normalised by vLLM's server: tok/s >= "
                f"{REGRESSION_TPS_MIN:.2f}x, TTFT p50 <= {REGRESSION_TTFT_MAX:.2f}x)",
                f"{sum(r['met'] for r in reg)} of {len(reg)} points not worse; lowest tok/s "
                f"{_f(worst_tps['tps_norm'], 2)}x ({worst_tps['system']} c="
                f"{worst_tps['concurrency']}), highest TTFT p50 "
                f"{_f(worst_ttft['ttft_norm'], 2)}x ({worst_ttft['system']} c="
                f"{worst_ttft['concurrency']}); raw tok/s ratios "
                f"{_f(min(r['tps_ratio'] for r in reg), 2)}-"
                f"{_f(max(r['tps_ratio'] for r in reg), 2)}x, vLLM's server's "
                f"{_f(min(r['vllm_tps_ratio'] or 0 for r in reg), 2)}-"
                f"{_f(max(r['vllm_tps_ratio'] or 0 for r in reg), 2)}x",
                all(r["met"] for r in reg),
            ))  # fmt: skip
    cc = results.get("crosscheck")
    if cc and {"vllm", "openai"} <= set(cc.get("targets", {})):
        theirs_v = _listify(cc["targets"]["vllm"]["vllm_bench"])
        theirs_o = _listify(cc["targets"]["openai"]["vllm_bench"])
        for i, (v, o) in enumerate(zip(theirs_v, theirs_o, strict=False), 1):
            goal = (f"TTFT p99 at c={cc['concurrency']}, round {i} of {len(theirs_v)} "
                    f"(vLLM's client): Sluice /v1/chat/completions <= {TTFT_P99_MAX}x vLLM's "
                    "server")  # fmt: skip
            if "error" in v or "error" in o:
                rows.append((goal, "vLLM's client failed: see the run's logs", False))
                continue
            ratio = _ratio(o["p99_ttft_ms"], v["p99_ttft_ms"])
            ok = (ratio is not None and ratio <= TTFT_P99_MAX and not v["failed"] and not o["failed"]
                  and cc["concurrency"] == TTFT_P99_CONC)  # fmt: skip
            note = "" if cc["concurrency"] == TTFT_P99_CONC else f" (not c={TTFT_P99_CONC})"
            rows.append((goal, f"{_f(o['p99_ttft_ms'], 1)} ms vs {_f(v['p99_ttft_ms'], 1)} ms "
                               f"= {_f(ratio, 2)}x{note}", ok))  # fmt: skip
    return rows


def targets_table(results: dict) -> str:
    return docblock.targets_table(target_rows(results))


def plot(agg: dict, concs: list[int], systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in systems:
        xs = [c for c in concs if (s, c) in agg]
        if not xs:
            continue
        style = "--" if s in ("engine", "vllm") else "-"
        ax1.plot(xs, [agg[(s, c)]["ttft_p50_ms"] for c in xs], style, marker="o", label=LABELS[s])
        ax2.plot(xs, [agg[(s, c)]["tokens_per_s"] for c in xs], style, marker="o", label=LABELS[s])
    for ax, title, ylabel in ((ax1, "Time to first token (p50)", "ms"),
                              (ax2, "Output throughput", "tokens/s")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle("tiny Llama on vLLM CPU, 2 cores (median of repeats)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layout_line(st: dict) -> str:
    layout = st.get("cpu_layout") or {}
    where = (
        f"vLLM engine processes (engine core and worker) on CPU {layout['engine_cpus']}, "
        f"servers' front ends, the bare-engine process and the clients on CPU "
        f"{layout['front_cpus']}"
        if layout
        else "no CPU separation (one core)"
    )
    return f"Layout: {where}; {st.get('settle_s', 0):g} s idle before each point (see Method)."


def lora_table(lora: dict) -> str:
    """The LoRA adapter next to the base (lora_ratio.py's result): TTFT p50 and tokens/s of
    each on the same engine, and the adapter/base ratios."""
    lines = [
        "| streams | TTFT p50 base (ms) | TTFT p50 adapter (ms) | TTFT ratio "
        "| tok/s base | tok/s adapter | tok/s ratio | errors | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in lora["rows"]:
        load = r.get("load_1m")
        lines.append(
            f"| {r['concurrency']} | {r['base_ttft_p50_ms']:.1f} | {r['adapter_ttft_p50_ms']:.1f}"
            f" | {r['ttft_ratio']:.2f} | {r['base_tokens_per_s']:.0f} "
            f"| {r['adapter_tokens_per_s']:.0f} | {r['tokens_per_s_ratio']:.2f} | {r['errors']} "
            f"| {'' if load is None else f'{load:.1f}'} |"
        )
    return "\n".join(lines)


def lora_lines(lora: dict) -> list[str]:
    """The generated section's LoRA part: what ran (its own command when `make bench-lora`
    measured it apart from the rest), then the table."""
    a = lora["adapter"]
    command = lora.get("command")
    source = f"Measured by `{command}`" if command else "Measured by the run above"
    return [
        "### A LoRA adapter next to the base (same engine, same load)",
        "",
        f"{source}: one rank-{a['rank']} adapter on every projection ({a['targets']}) of the "
        f"tiny model, OpenAI streamed chat, {lora['max_tokens']} tokens per request, base and "
        f"adapter alternately, medians of {lora['repeats']} runs per point. Ratio = adapter / "
        "base (TTFT: above 1 is slower; tok/s: below 1 is slower).",
        "",
        lora_table(lora),
        "",
    ]


def generated_section(results: dict, out_dir: Path) -> str:
    m, v, st = results["machine"], results["versions"], results["settings"]
    lines = [
        BEGIN,
        "<!-- Written by testing/sluice_bench/run.py from docs/bench-results.json; edits here are overwritten. -->",
        "",
        f"Command: `{results['command'].strip()}` (what `make bench` runs), "
        f"{results['phases_s'].get('total', 0) / 60:.1f} minutes in all "
        "("
        + ", ".join(f"{k} {val:.0f} s" for k, val in results["phases_s"].items() if k != "total")
        + ").",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']} "
        "(compare ratios within one run: see Noise; bench-results.json has the load average "
        "at every point).",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "### Targets",
        "",
        targets_table(results),
        "",
    ]
    if "matrix" in results:
        concs = st["concurrency"]
        agg = aggregate(results["matrix"])
        systems = [s for s in SYSTEMS if any(k[0] == s for k in agg)]
        lines += [
            f"Engine arguments (all three vLLM systems): `{' '.join(st['engine_args'])}`; "
            f"max_tokens {st['max_tokens']} with ignore_eos, temperature 0, "
            f"{st['prompts']} chat prompts; {st['repeats']} repeats per point, systems "
            "interleaved; requests per point: "
            + ", ".join(f"c={c}: {n}" for c, n in st["requests_per_point"].items())
            + ". Cells are medians over repeats (tok/s also min-max).",
            "",
            _layout_line(st),
            "",
            "### Results",
            "",
            matrix_table(agg, concs, systems),
            "",
            "![TTFT and throughput against concurrency](bench-throughput.png)",
            "",
            "### Our routes against vLLM's server and the bare engine",
            "",
            ratio_table(ratio_rows(agg, concs)),
            "",
        ]
        if results.get("baseline"):
            lines += [
                "### Against the previous committed results",
                "",
                regression_table(regression_rows(agg, results["baseline"]), results["baseline"]),
                "",
            ]
    if "crosscheck" in results:
        lines += [
            "### Cross-check with vLLM's benchmark client",
            "",
            crosscheck_table(results["crosscheck"]),
            "",
        ]
    if "fanout" in results:
        lines += [
            "### Fan-out (simulator engine; one process, or several front-end workers)",
            "",
            fanout_tables(results["fanout"]),
            "",
            "### Front-end workers (`--api-workers`): scaling with cores",
            "",
            worker_scaling_table(results["fanout"]),  # ends with a blank line
        ]
    if "lora" in results:
        lines += lora_lines(results["lora"])
    lines += [END]
    return "\n".join(lines)


def write_all(results: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    if "matrix" in results:
        agg = aggregate(results["matrix"])
        concs = results["settings"]["concurrency"]
        systems = [s for s in SYSTEMS if any(k[0] == s for k in agg)]
        plot(agg, concs, systems, out_dir / "bench-throughput.png")
        (out_dir / "bench-results.md").write_text(
            "# Benchmark results (generated)\n\n"
            + targets_table(results)
            + "\n\n"
            + matrix_table(agg, concs, systems)
            + "\n\n"
            + ratio_table(ratio_rows(agg, concs))
            + "\n"
        )
    if "fanout" in results:
        (out_dir / "bench-fanout.md").write_text(
            "# Fan-out results (generated)\n\n"
            + fanout_tables(results["fanout"])
            + "\n## Front-end workers\n\n"
            + worker_scaling_table(results["fanout"])
        )
    write_section(results, out_dir)


def write_section(results: dict, out_dir: Path) -> None:
    """docs/benchmarks.md's generated section alone (between the markers)."""
    note = Path(out_dir) / "benchmarks.md"
    section = generated_section(results, out_dir)
    if note.exists() and BEGIN in note.read_text():
        text = note.read_text()
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1] if END in rest else ""
        note.write_text(head + section + tail)
    else:
        note.write_text("# Benchmarks\n\n" + section + "\n")


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench-results.json")
    write_all(json.loads(src.read_text()), src.parent)
