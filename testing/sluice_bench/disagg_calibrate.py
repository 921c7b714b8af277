"""`make bench-disagg-calibrate`: what a long prompt's prefill costs the streams decoding
beside it on the real engine, the numbers the simulator's interference model is set from.

    python -m sluice_bench.disagg_calibrate [--streams 8] [--lengths 256 1024 2048 3584]
        [--repeats 3] [--budget 2048] [--json FILE]

vLLM's CPU build on the tiny model, in this process (`AsyncLLM`, no HTTP), its engine
processes pinned apart from this one (`testkit.cpus`: otherwise the engine starves the
process that timestamps the tokens). Prefix caching is off and every prompt is fresh random
token ids, so a prompt of L tokens is L tokens computed. `--budget` is vLLM's
`--max-num-batched-tokens`: the most tokens (prompt and decode together) one engine step
computes, so a prompt longer than it is prefilled in chunks over several steps.

1. Alone: each prompt length with nothing else running, `max_tokens` 1: its time to the
   first token, and that over L (prefill time per prompt token).
2. Beside `--streams` running streams (short prompts, `ignore_eos`; a slot whose stream
   ends starts another): for each repeat and length, a quiet window, then the prompt. Each
   window's ITL is the running streams' mean time per token (window length over tokens per
   stream); the ratio is the prompt's window over the quiet window just before it, so the
   machine's drift between trials cancels. The decode time lost to the prefill is the
   window's length minus the tokens each stream produced in it times the quiet ITL; over L
   it is the interference per prompt token (what `--sim-prefill-interference-us-per-token`
   means); the longest gap is the spike a reader sees.

Prints one JSON line per trial, then the medians per length.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Slot:
    """One running stream's token arrivals: (time, tokens in that delta)."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)


def window(slots: list[Slot], t0: float, t1: float) -> dict:
    """The slots' decoding between t0 and t1: mean time per token and the longest gap."""
    tokens, gaps = [], []
    for slot in slots:
        inside = [(t, n) for t, n in slot.arrivals if t0 <= t <= t1]
        tokens.append(sum(n for _, n in inside))
        before = [t for t, _ in slot.arrivals if t < t0]
        times = ([before[-1]] if before else []) + [t for t, _ in inside]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    per_stream = statistics.mean(tokens)
    return {
        "seconds": t1 - t0,
        "tokens_per_stream": per_stream,
        "itl_ms": (t1 - t0) / per_stream * 1000 if per_stream else None,
        "max_gap_ms": max(gaps) * 1000 if gaps else None,
    }


async def probe(args: argparse.Namespace) -> dict:
    from sluice_server.engine.tiny_model import ensure_tiny_model
    from testkit.cpus import engine_apart_from_this_process
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.sampling_params import RequestOutputKind
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    model = str(ensure_tiny_model())
    argv = ["--model", model, "--enforce-eager", "--kv-cache-memory-bytes", str(512 * 2**20),
            "--max-model-len", "4096", "--max-num-seqs", "64", "--no-enable-prefix-caching",
            "--max-num-batched-tokens", str(args.budget)]  # fmt: skip
    parsed = make_arg_parser(FlexibleArgumentParser(prog="calibrate")).parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(parsed)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    llm = AsyncLLM.from_vllm_config(vllm_config=config, disable_log_stats=True)
    sched = config.scheduler_config
    vocab = llm.tokenizer.vocab_size if llm.tokenizer is not None else 500
    rng = random.Random(7)
    ids = itertools.count()

    def fresh(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(10, vocab - 1) for _ in range(n)]}

    async def first_token(n: int) -> float:
        """Seconds from submitting a fresh n-token prompt to its one token."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        start = time.perf_counter()
        async for _ in llm.generate(fresh(n), params, f"long-{next(ids)}"):
            break
        return time.perf_counter() - start

    stop = asyncio.Event()

    async def keep(slot: Slot) -> None:
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        while not stop.is_set():
            async for out in llm.generate(fresh(8), params, f"stream-{next(ids)}"):
                slot.arrivals.append((time.perf_counter(), len(out.outputs[0].token_ids)))
                if stop.is_set():
                    break

    trials: list[dict] = []
    try:
        with engine_apart_from_this_process() as layout:
            for n in (64, *args.lengths):  # warm every shape once
                await first_token(n)
            alone: dict[int, list[float]] = {n: [] for n in args.lengths}
            for _ in range(args.repeats):
                for n in args.lengths:
                    alone[n].append(await first_token(n))
            slots = [Slot() for _ in range(args.streams)]
            tasks = [asyncio.ensure_future(keep(s)) for s in slots]
            await asyncio.sleep(2.0)  # every stream past its prefill
            for rep in range(args.repeats):
                order = list(args.lengths)
                random.Random(rep).shuffle(order)
                for n in order:
                    q0 = time.perf_counter()
                    await asyncio.sleep(args.quiet_s)
                    p0 = time.perf_counter()
                    ttft = await first_token(n)
                    p1 = time.perf_counter()
                    await asyncio.sleep(0.05)  # the last arrivals of the window land
                    quiet, during = window(slots, q0, p0), window(slots, p0, p1)
                    lost = during["seconds"] - during["tokens_per_stream"] * quiet["itl_ms"] / 1000
                    trial = {"repeat": rep, "prompt_tokens": n, "ttft_ms": ttft * 1000,
                             "quiet_itl_ms": quiet["itl_ms"], "itl_ms": during["itl_ms"],
                             "itl_ratio": during["itl_ms"] / quiet["itl_ms"]
                             if during["itl_ms"] else None,
                             "quiet_max_gap_ms": quiet["max_gap_ms"],
                             "max_gap_ms": during["max_gap_ms"],
                             "interference_us_per_token": lost / n * 1e6}  # fmt: skip
                    trials.append(trial)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in trial.items()}), flush=True)  # fmt: skip
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        llm.shutdown()

    def med(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    per_length = []
    for n in args.lengths:
        rows = [t for t in trials if t["prompt_tokens"] == n]
        ttft_alone = statistics.median(alone[n])
        per_length.append({
            "prompt_tokens": n,
            "ttft_alone_ms": round(ttft_alone * 1000, 2),
            "prefill_us_per_token_alone": round(ttft_alone / n * 1e6, 2),
            "ttft_beside_streams_ms": med(rows, "ttft_ms"),
            "quiet_itl_ms": med(rows, "quiet_itl_ms"),
            "itl_ms": med(rows, "itl_ms"),
            "itl_ratio": med(rows, "itl_ratio"),
            "quiet_max_gap_ms": med(rows, "quiet_max_gap_ms"),
            "max_gap_ms": med(rows, "max_gap_ms"),
            "interference_us_per_token": med(rows, "interference_us_per_token"),
        })  # fmt: skip
    return {
        "streams": args.streams, "repeats": args.repeats,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "chunked_prefill": bool(getattr(sched, "enable_chunked_prefill", True)),
        "cpu_layout": layout, "per_length": per_length,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 3584])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048,
                        help="vLLM's --max-num-batched-tokens (the chunk)")  # fmt: skip
    parser.add_argument("--quiet-s", type=float, default=0.6)
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args()
    from sluice_bench.procs import engine_env

    os.environ.update(engine_env(Path(tempfile.mkdtemp(prefix="disagg-calibrate-"))))
    result = asyncio.run(probe(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
