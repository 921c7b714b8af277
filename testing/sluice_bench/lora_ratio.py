"""`make bench` (phase 5) and `make bench-lora`: what a LoRA adapter costs next to the base.

One server process (`--model tiny`, LoRA on: `--max-loras 2 --max-lora-rank 8`) with one
adapter made at test time (rank 8 on every projection, testing/testkit/lora.py); the
same load generator as the matrix, OpenAI streamed chat, the same prompts and max_tokens.
For each repeat and concurrency, base then adapter (order alternating per repeat), on the
same engine: TTFT p50 and output tokens/s of each, and the adapter/base ratios. Cheap: one
engine start, a few hundred requests.

`python -m sluice_bench.lora_ratio [--out docs] [--repeats 3] [--concurrency 1 8]` alone;
writes docs/bench-lora.md and docs/bench-lora.json, and, where --out holds the last
`make bench`'s bench-results.json, puts the result in it as its `lora` part (with this
command) and regenerates docs/benchmarks.md's generated section from it (report.py), so
the page shows the newest ratio without rerunning the whole benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from testkit.lora import make_adapter, write_adapters
from testkit.net import free_port
from testkit.repo import ROOT

from sluice_bench.procs import PY, ProcGroup, Server, Worker, engine_env, separate_engines
from sluice_bench.report import lora_table, write_section

ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20),
               "--max-num-seqs", "128", "--max-model-len", "1024"]  # fmt: skip
ADAPTER = "tiny-lora"


def lora_flags(scratch: Path) -> list[str]:
    """Our server's flags for LoRA with the one test adapter (made in `scratch`)."""
    from sluice_server.engine.tiny_model import ensure_tiny_model

    folder = make_adapter(scratch / "adapter", ensure_tiny_model(), rank=8, scale=0.5, seed=1)
    config = scratch / "adapters.json"
    write_adapters(config, {ADAPTER: folder})
    return ["--adapters-file", str(config), "--max-loras", "2", "--max-lora-rank", "8"]


def run_lora(group: ProcGroup, env: dict, logs: Path, scratch: Path, *, concurrency=(1, 8),
             repeats: int = 3, max_tokens: int = 64, prompts: list[str],
             server: Server | None = None, cpu_layout: dict | None = None) -> dict:  # fmt: skip
    """The ratios on `server` (started with `lora_flags`, its engine already kept apart as
    `cpu_layout` says) or, by default, on a server of its own, stopped at the end."""
    own = server is None
    if server is None:
        port = free_port()
        server = group.add(Server(
            "sluice-lora",
            [PY, "-m", "sluice_server", "--model", "tiny", "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(port), "--max-concurrent-streams", "1000",
             "--log-level", "warning", *lora_flags(scratch), "--", *ENGINE_ARGS],
            env, logs, port, "/ready",
        ))  # fmt: skip
        server.wait_ready(600)
        # The matrix's layout: the engine on its cores, the server and the load generator
        # on the others (procs.separate_engines says why).
        cpu_layout = separate_engines([server])
    layout = cpu_layout or {}
    front = set(layout.get("front_cpus", ())) or None
    loadgen = group.add(Worker("loadgen-lora", [PY, "-m", "sluice_bench.loadgen"], env, logs,
                               cpus=front))  # fmt: skip

    def point(model: str, c: int) -> dict:
        time.sleep(1.0)  # let the engine's busy-poll from the last point end
        got = loadgen.call({"concurrency": c, "num_requests": max(8, 4 * c),
                            "max_tokens": max_tokens, "prompts": prompts, "model": model,
                            "point_timeout_s": 180, "base_url": server.base_url,
                            "protocol": "openai"}, timeout=240)  # fmt: skip
        return {**got, "load_1m": os.getloadavg()[0]}

    point("tiny", 2), point(ADAPTER, 2)  # warm-up, not recorded
    rows = []
    for c in concurrency:
        runs: dict[str, list[dict]] = {"tiny": [], ADAPTER: []}
        for r in range(repeats):
            order = ("tiny", ADAPTER) if r % 2 == 0 else (ADAPTER, "tiny")
            for model in order:
                runs[model].append(point(model, c))
        errors = sum(p["errors"] for ps in runs.values() for p in ps)

        row = {"concurrency": c, "errors": errors, "load_1m": _median(
            [p for ps in runs.values() for p in ps], "load_1m")}  # fmt: skip
        for label, model in (("base", "tiny"), ("adapter", ADAPTER)):
            row[f"{label}_ttft_p50_ms"] = _median(runs[model], "ttft_p50_ms")
            row[f"{label}_tokens_per_s"] = _median(runs[model], "tokens_per_s")
        row["ttft_ratio"] = row["adapter_ttft_p50_ms"] / row["base_ttft_p50_ms"]
        row["tokens_per_s_ratio"] = row["adapter_tokens_per_s"] / row["base_tokens_per_s"]
        rows.append(row)
    group.stop(loadgen)
    if own:
        group.stop(server)
    return {"adapter": {"rank": 8, "targets": "q,k,v,o,gate,up,down"}, "repeats": repeats,
            "max_tokens": max_tokens, "engine_args": ENGINE_ARGS, "cpu_layout": layout,
            "rows": rows}  # fmt: skip


def _median(points: list[dict], key: str) -> float:
    return statistics.median(p[key] for p in points if p[key] is not None)


def markdown(result: dict) -> str:
    lines = [
        "<!-- generated by testing/sluice_bench/lora_ratio.py (make bench / make bench-lora); "
        "do not edit -->",
        "# LoRA adapter next to the base: same engine, same load",
        "",
        f"One rank-{result['adapter']['rank']} adapter on every projection of the tiny "
        f"model, OpenAI streamed chat, {result['max_tokens']} tokens per request, medians of "
        f"{result['repeats']} runs per point. Ratio = adapter / base (TTFT: above 1 is "
        "slower; tokens/s: below 1 is slower).",
        "",
        lora_table(result),
    ]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    (out / "bench-lora.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench-lora.md").write_text(markdown(result))


def merge_into_results(result: dict, out: Path) -> None:
    """The last full run's results with this LoRA part, and benchmarks.md's section again."""
    path = out / "bench-results.json"
    if not path.exists():
        return
    results = json.loads(path.read_text())
    results["lora"] = result
    path.write_text(json.dumps(results, indent=1))
    write_section(results, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    from sluice_bench.run import prompts

    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    logs = scratch / "logs"
    logs.mkdir()
    with ProcGroup() as group:
        result = run_lora(group, engine_env(scratch), logs, scratch, concurrency=args.concurrency,
                          repeats=args.repeats, max_tokens=args.max_tokens,
                          prompts=prompts())  # fmt: skip
    given = shlex.join(argv if argv is not None else sys.argv[1:])
    result["command"] = f"python -m sluice_bench.lora_ratio {given}".strip()
    write(result, args.out)
    merge_into_results(result, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
