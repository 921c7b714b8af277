"""Front-end CPU per output token on the real engine: this checkout's server (B) against
another checkout's (A), with vLLM's own server beside them for the ratio the targets use.

`stack_cost.py ab` measures our stack in-process on the simulator, with a send that drops
the bytes: it cannot see what the socket writes cost, nor vLLM's AsyncLLM front end (its
detokenizer, output objects and stat loggers, which run in our server's process). This one
runs the real thing: both servers on the tiny model (`--model tiny`, the matrix's engine
arguments and CPU layout: engines on their cores, servers and the load generator on the
others), the matrix's load generator, and the CPU time of each server's main process over
the tokens it streamed. Points alternate A and B (the order flipping every pair) per
protocol, so the machine's drift lands on both; it prints every pair, the medians and B/A.
On a shared 2-core machine single pairs spread by +-20% (how many tokens a write carries moves
with how busy the front end is), so a change of a few percent needs many pairs.
`--max-tokens 1` makes it the CPU each request costs to start (a token each).

    git worktree add --detach /tmp/sluice-main main
    python -m sluice_bench.engine_ab --against /tmp/sluice-main --pairs 4
    make bench-ab-engine BASE=/tmp/sluice-main
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from testkit.net import free_port
from testkit.repo import ROOT

from sluice_bench.procs import PY, ProcGroup, Server, Worker, engine_env, separate_engines
from sluice_bench.run import point_runner, prompts, sluice_server_argv, vllm_server_argv


def start(group: ProcGroup, name: str, checkout: Path | None, model: Path, scratch: Path,
          logs: Path) -> Server:  # fmt: skip
    """Our server from `checkout`, or (None) vLLM's own."""
    env = engine_env(scratch / name)
    port = free_port()
    if checkout is None:
        return group.add(Server(name, vllm_server_argv(model, port), env, logs, port, "/health"))
    env["PYTHONPATH"] = os.pathsep.join([str(checkout / "server"), str(ROOT / "testing")])
    return group.add(Server(name, sluice_server_argv(port), env, logs, port, "/ready"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, type=Path, help="the other checkout (A)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--protocols", default="sse,websocket,openai")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's server (no ratios)")
    a = p.parse_args(argv)
    from sluice_server.engine.tiny_model import ensure_tiny_model

    cache = Path(os.environ.get("SLUICE_CACHE") or ROOT / ".cache")
    model = ensure_tiny_model(cache)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ab-", dir=cache))
    logs = scratch / "logs"
    logs.mkdir()
    protocols = a.protocols.split(",")
    n = max(8, a.concurrency * 3 // 2)
    print(f"A = {a.against.resolve()}, B = {ROOT}; c={a.concurrency}, {n} requests of "
          f"{a.max_tokens} tokens a point; "
          f"logs in {logs}", flush=True)  # fmt: skip
    with ProcGroup() as group:
        servers = {"A": start(group, "A", a.against.resolve(), model, scratch, logs),
                   "B": start(group, "B", ROOT, model, scratch, logs)}  # fmt: skip
        if not a.no_vllm:
            servers["vllm"] = start(group, "vllm", None, model, scratch, logs)
        for server in servers.values():
            server.wait_ready(300)
        layout = separate_engines(list(servers.values()))
        cpus = set(layout.get("front_cpus", ())) or None
        loadgen = group.add(Worker("loadgen", [PY, "-m", "sluice_bench.loadgen"], engine_env(scratch),
                                   logs, cpus=cpus))  # fmt: skip

        # The matrix's point: our routes are systems of the "sluice" process, vLLM's
        # server the "vllm" system.
        runs = {name: point_runner({"vllm" if name == "vllm" else "sluice": server}, loadgen,
                                   a.max_tokens, prompts(), 1.5)
                for name, server in servers.items()}  # fmt: skip

        def point(name: str, protocol: str, concurrency: int, requests: int) -> float:
            res = runs[name]("vllm" if name == "vllm" else protocol, concurrency, requests)
            if res["errors"] or not res.get("output_tokens"):
                raise SystemExit(f"{name} {protocol}: {res['errors']} errors: {res}")
            return res["front_cpu_us_per_token"]

        for name in servers:  # warm-up, not recorded
            for protocol in protocols if name != "vllm" else ["openai"]:
                point(name, protocol, 4, 8)
        us: dict[tuple[str, str], list[float]] = {}
        for i in range(a.pairs):
            for protocol in protocols:
                for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                    us.setdefault((name, protocol), []).append(point(name, protocol,
                                                                     a.concurrency, n))  # fmt: skip
            if "vllm" in servers:
                us.setdefault(("vllm", "openai"), []).append(point("vllm", "openai",
                                                                   a.concurrency, n))  # fmt: skip
            print(f"pair {i + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}"
                                                for k, v in us.items()), flush=True)  # fmt: skip
    print(f"\nus front-end CPU per token, c={a.concurrency}, medians of {a.pairs} pairs "
          f"(load average {os.getloadavg()[0]:.1f}):")  # fmt: skip
    vllm = statistics.median(us[("vllm", "openai")]) if ("vllm", "openai") in us else None
    for protocol in protocols:
        ma, mb = statistics.median(us[("A", protocol)]), statistics.median(us[("B", protocol)])
        pairs = [b / x for x, b in zip(us[("A", protocol)], us[("B", protocol)], strict=True)]
        line = (f"{protocol}: A {ma:.1f}, B {mb:.1f}, B/A {statistics.median(pairs):.2f} "
                f"(pairs {', '.join(f'{r:.2f}' for r in pairs)})")  # fmt: skip
        if vllm:
            line += f"; vs vLLM's server ({vllm:.1f}): A {ma / vllm:.2f}x, B {mb / vllm:.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
