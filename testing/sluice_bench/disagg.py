"""`make bench-disagg`: a simulator fleet, mixed replicas vs the same number split into a
prefill and a decode pool, under a mix of long-prompt and chat requests.

    python -m sluice_bench.disagg [--replicas 4] [--prefill 2] [--rate 6] [--seconds 30]
        [--long-share 0.2] [--long-words 8000] [--chat-words 1000] [--max-tokens 200]
        [--sides mixed disaggregated] [--write]

Each side: `--replicas` simulator server processes (`sluice_bench.simserver`: tokens
stamped with the time the simulator made them) behind `sluice-server router` (a process),
which finds them through a fake Pods API in this process. Mixed: every replica serves whole
requests. Disaggregated: `--prefill` of them are the prefill pool
(`--disaggregation-role prefill`) and the rest the decode pool, both with
`--kv-transfer-config`; the router's models file names the prefill pool
(`disaggregation.prefill`), so each request is prefilled on one pod and decoded on another.
Every pod has the same calibrated timing model (`SIM_ARGS`; docs/disaggregation.md says
where each number comes from).

The load is open-loop: requests arrive at `--rate` per second (Poisson, seeded) for
`--seconds`, a `--long-share` of them with `--long-words`-token prompts, the rest with
`--chat-words` (fresh random words each, so nothing is served from a cache), every one
streaming `--max-tokens` tokens (OpenAI chat, `ignore_eos`). Decode ITL is the gaps between
a stream's token stamps (the simulator's own production times, so the client's and the
router's CPU on this shared machine do not blur it), TTFT the first token's stamp minus
the moment the client sent the request (the router's steps included). Prints one JSON line
per side, then the targets table; `--write` puts it into docs/benchmarks.md
(`bench:disagg`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn
from testkit.fake_pods_api import FakePodsApi
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

from sluice_bench import docblock

PY = sys.executable
MASTER = b"bench-continuation-master-key-0123456789"
NS, NAME = "bench", "chat"
LABELS = {"app": "chat"}
STAMP = re.compile(r"@(\d+\.\d+)")
# One timing model for every pod (GPU-like, docs/disaggregation.md): 15 ms decode steps,
# each decode gap 40 us longer per prompt token prefilled beside it (at most a 2,048-token
# chunk per step), 80 us per KV block handed over (the simulator's default). A prompt token
# costs its 40 us of compute, plus, where its chunk shares a step with decoding streams
# (mixed and decode pods), that step's 15 ms spread over the chunk: 47 us.
SIM_ARGS = ["--sim-ttft-ms", "10", "--sim-itl-ms", "15",
            "--sim-prefill-interference-us-per-token", "40", "--max-num-batched-tokens", "2048",
            "--max-model-len", "16384"]  # fmt: skip
PREFILL_US = {"prefill": "40", "decode": "47", None: "47"}
KV_TRANSFER = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
WORDS = [f"w{i}" for i in range(5000)]


def model_key(master: bytes) -> bytes:
    from sluice_server.core.auth.routerkey import model_key as derive

    return derive(master, NS, NAME)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=words))


async def one_request(c: httpx.AsyncClient, url: str, text: str, max_tokens: int,
                      long: bool = False) -> dict:  # fmt: skip
    body = {"model": NAME, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    stamps: list[float] = []
    usage: dict = {}
    sent = time.time()
    try:
        async with c.stream("POST", url + "/v1/chat/completions", json=body,
                            headers={"X-Sluice-Model": f"{NS}/{NAME}"}) as r:  # fmt: skip
            if r.status_code != 200:
                return {
                    "long": long,
                    "error": f"{r.status_code} {(await r.aread())[:200]!r}",
                }
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices") or []:
                    stamps += [
                        float(s) for s in STAMP.findall(choice["delta"].get("content") or "")
                    ]
                usage = data.get("usage") or usage
    except httpx.HTTPError as e:
        return {"long": long, "error": f"{type(e).__name__}: {e}"}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "long": long, "tokens": len(stamps),
        "ttft_s": stamps[0] - sent if stamps else None,
        "gaps_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "prompt_tokens": usage.get("prompt_tokens"), "cached": details.get("cached_tokens") or 0,
        "error": None if len(stamps) == max_tokens else f"{len(stamps)} of {max_tokens} tokens",
    }  # fmt: skip


async def load(url: str, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    schedule, at = [], 0.0  # (when, prompt): made before the run, the same for both sides
    while at < args.seconds:
        long = rng.random() < args.long_share
        schedule.append((at, prompt(args.long_words if long else args.chat_words, rng), long))
        at += rng.expovariate(args.rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        await one_request(c, url, prompt(10, rng), 2)  # warm: the router knows the pods
        start = time.monotonic()
        for at, text, long in schedule:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.ensure_future(one_request(c, url, text, args.max_tokens, long)))
        return list(await asyncio.gather(*tasks))


def pod_argv(ip: str, port: int, key: Path, role: str | None) -> list[str]:
    argv = [PY, "-m", "sluice_bench.simserver", "--model", NAME, "--engine", "simulator",
            "--host", ip, "--port", str(port), "--continuation-key-file", str(key),
            "--max-concurrent-streams", "10000", "--log-level", "warning",
            "--access-log", "false", *SIM_ARGS,
            "--sim-prefill-us-per-token", PREFILL_US[role]]  # fmt: skip
    if role is not None:
        argv += ["--disaggregation-role", role, "--kv-transfer-config", KV_TRANSFER]
    return argv


async def side(args: argparse.Namespace, disaggregated: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    master, pod_key = work / "master", work / "pod-key"
    master.write_bytes(MASTER + b"\n")
    pod_key.write_bytes(model_key(MASTER) + b"\n")
    api = FakePodsApi()
    api_port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=api_port,
                                           log_level="warning", lifespan="off"))  # fmt: skip
    api_task = asyncio.create_task(server.serve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = free_port()
    procs: list[ManagedProcess] = []
    try:
        roles: list[str | None] = [None] * args.replicas
        if disaggregated:
            roles = [*["prefill"] * args.prefill, *["decode"] * (args.replicas - args.prefill)]
        pods = []
        for i, role in enumerate(roles):
            ip = f"127.0.{20 + int(disaggregated)}.{i + 1}"
            name = f"{role or 'mixed'}-{i}"
            pods.append((name, ip, role))
            procs.append(ManagedProcess(name, pod_argv(ip, port, pod_key, role), work,
                                        env).start())  # fmt: skip
        for (_, ip, _), proc in zip(pods, procs, strict=True):
            await asyncio.to_thread(wait_http, f"http://{ip}:{port}/ready", timeout=60,
                                    process=proc)  # fmt: skip
        for name, ip, role in pods:
            labels = dict(LABELS)
            if role is not None:
                labels["serving.sluice.dev/role"] = role
            api.put(name, ip, labels, namespace=NS)
        decode = dict(LABELS, **({"serving.sluice.dev/role": "decode"} if disaggregated else {}))
        entry: dict = {"host": "chat.bench.invalid", "keepaliveSeconds": 15,
                       "holdTimeoutSeconds": 60,
                       "pods": {"namespace": NS, "selector": decode, "port": port}}  # fmt: skip
        if disaggregated:
            entry["disaggregation"] = {"prefill": {
                "namespace": NS, "selector": dict(LABELS, **{"serving.sluice.dev/role": "prefill"}),
                "port": port}}  # fmt: skip
        (work / "models.json").write_text(json.dumps({f"{NS}/{NAME}": entry}))
        (work / "sa").mkdir()
        (work / "sa" / "token").write_text("bench")
        rport = free_port()
        router = ManagedProcess("router", [
            PY, "-m", "sluice_server", "router", "--models-file", str(work / "models.json"),
            "--host", "127.0.0.1", "--port", str(rport), "--kube-api-url",
            f"http://127.0.0.1:{api_port}", "--service-account-dir", str(work / "sa"),
            "--continuation-key-file", str(master), "--log-level", "warning"], work, env).start()  # fmt: skip
        procs.append(router)
        url = f"http://127.0.0.1:{rport}"
        await asyncio.to_thread(wait_http, url + "/ready", timeout=60, process=router)
        await asyncio.sleep(1.0)  # the router's watch has seen every pod
        load_before = os.getloadavg()[0]
        results = await load(url, args)
        load_after = os.getloadavg()[0]
    finally:
        for p in procs:
            p.stop()
        server.should_exit = True
        await api_task
    return {**summarise(results, disaggregated, args),
            "loadavg_1m": [round(load_before, 1), round(load_after, 1)]}  # fmt: skip


def summarise(results: list[dict], disaggregated: bool, args: argparse.Namespace) -> dict:
    ok = [r for r in results if not r["error"]]
    gaps = [g for r in ok for g in r["gaps_s"]]
    ttfts = [r["ttft_s"] for r in ok]
    chat = [r["ttft_s"] for r in ok if not r["long"]]
    long = [r["ttft_s"] for r in ok if r["long"]]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "side": "disaggregated" if disaggregated else "mixed",
        "pods": f"{args.prefill} prefill + {args.replicas - args.prefill} decode"
        if disaggregated else f"{args.replicas} mixed",
        "requests": len(results), "long": sum(r["long"] for r in results),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if r["error"]), None),
        "itl_p50_ms": ms(percentile(gaps, 0.5)), "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)), "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "ttft_p50_chat_ms": ms(percentile(chat, 0.5)), "ttft_p50_long_ms": ms(percentile(long, 0.5)),
        "cached_prompt_share": round(sum(r["cached"] for r in ok)
                                     / max(1, sum(r["prompt_tokens"] or 0 for r in ok)), 3),
    }  # fmt: skip


def target_rows(mixed: dict, disagg: dict) -> list[tuple[str, str, bool | None]]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    itl = ratio(mixed["itl_p99_ms"], disagg["itl_p99_ms"])
    ttft = ratio(disagg["ttft_p50_ms"], mixed["ttft_p50_ms"])
    clean = not mixed["errors"] and not disagg["errors"]
    return [
        ("decode ITL p99 at least 2x lower disaggregated",
         f"mixed {mixed['itl_p99_ms']} ms, disaggregated {disagg['itl_p99_ms']} ms: {itl}x",
         None if itl is None else itl >= 2 and clean),
        ("TTFT p50 not worse than 1.2x disaggregated",
         f"mixed {mixed['ttft_p50_ms']} ms, disaggregated {disagg['ttft_p50_ms']} ms: {ttft}x",
         None if ttft is None else ttft <= 1.2 and clean),
    ]  # fmt: skip


def table(mixed: dict, disagg: dict, args: argparse.Namespace) -> str:
    lines = [docblock.targets_table(target_rows(mixed, disagg)), "",
             "| fleet | requests (long) | errors | ITL p50 / p99 | TTFT p50 / p99 | "
             "TTFT p50 chat / long | prompt tokens handed over |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in (mixed, disagg):
        lines.append(
            f"| {s['pods']} | {s['requests']} ({s['long']}) | {s['errors']} | "
            f"{s['itl_p50_ms']} / {s['itl_p99_ms']} ms | {s['ttft_p50_ms']} / {s['ttft_p99_ms']} ms | "
            f"{s['ttft_p50_chat_ms']} / {s['ttft_p50_long_ms']} ms | {s['cached_prompt_share']:.0%} |"
        )
    lines += ["", f"Load: {args.rate} requests/s for {args.seconds:g} s, "
              f"{args.long_share:.0%} with {args.long_words}-token prompts, the rest "
              f"{args.chat_words}, {args.max_tokens} tokens each; pods `{' '.join(SIM_ARGS)}`, "
              f"`--sim-prefill-us-per-token` {PREFILL_US['prefill']} on prefill pods, "
              f"{PREFILL_US[None]} on the others. Load average (1 min) on the machine "
              f"before / after each side: mixed {mixed.get('loadavg_1m')}, disaggregated "
              f"{disagg.get('loadavg_1m')}.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=2, help="of the replicas, disaggregated")
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--long-words", type=int, default=8000)
    parser.add_argument("--chat-words", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sides", nargs="+", choices=["mixed", "disaggregated"],
                        default=["mixed", "disaggregated"])  # fmt: skip
    parser.add_argument("--write", action="store_true", help="write the table into docs/")
    args = parser.parse_args(argv)
    if not 0 < args.prefill < args.replicas:
        parser.error("--prefill must leave at least one decode replica")
    runs = {}
    for name in args.sides:
        runs[name] = asyncio.run(side(args, name == "disaggregated"))
        print(json.dumps(runs[name]), flush=True)
    if len(runs) < 2:
        return
    text = table(runs["mixed"], runs["disaggregated"], args)
    print(text)
    if args.write:
        docblock.write("disagg", "testing/sluice_bench/disagg.py --write", text)


if __name__ == "__main__":
    main()
