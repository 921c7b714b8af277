"""Placement benchmark: the router's `pick` with and without its prefix score, and round
robin, on a discrete-event model of a 4-replica fleet with a prefix cache per replica.

This is a *model of the fleet*, not the fleet: pure Python, no server, seconds to run. It
checks that the placement code (sluice_server.router.placement, the same `Placement` the
router runs) gets the targets on workloads shaped like the issue's, before the simulator
servers and the live pods measure them.

The model, per replica: a prefix cache (an LRU of blocks of 16 tokens, a capacity in
blocks; a block's hash chains its parent's, as vLLM's do) and one prefill at a time in
arrival order, costing `PREFILL_FIXED_S + uncached tokens x PREFILL_S_PER_TOKEN`, where
the cached run is the longest run of the prompt's leading blocks in that replica's cache;
then decoding at `ITL_S` per output token, concurrent with the next prefills. Finished
prefills store their blocks (KV events to the router's precise index: `stored`, and
`removed` for the LRU's evictions, delivered at once); the router keeps its own in-flight
count per replica and sees each replica's waiting queue and KV use through a scrape every
`SCRAPE_S`. TTFT is the prefill's end minus the arrival.

Parameters: one NVIDIA H100 SXM serving Llama-3.1-8B in bf16, from arithmetic on published
figures, not a measurement (no GPU is reachable from here). Prefill is compute-bound:
2 FLOP per parameter per token, 16 GFLOP per token, at 40% of the H100's 989 TFLOP/s dense
bf16 (NVIDIA's H100 datasheet): 40 us per uncached token. Decode is bandwidth-bound: 16 GB
of weights per step over 3.35 TB/s is 4.8 ms, 8 ms per token with a batch's KV reads.
The KV cache: 128 KiB per token (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes);
`CAPACITY_BLOCKS` 8,192 (131k tokens, 16 GiB) is the cache left with
`--gpu-memory-utilization 0.5`, so it holds a fraction of the shared-prefix workload's
histories and eviction matters (the issue's live target sizes the cache below the working
set for the same reason). vLLM publishes no per-token prefill cost; replace these with
the simulator servers' measured ones when they land.

Workloads (open loop, arrival times fixed in advance):
- `shared-prefix`: 16 groups, each with its own 1,500-token system prompt; conversations
  of 2-6 turns, each turn resending the history (system prompt, earlier turns and answers)
  plus 50-150 new tokens, 3 s mean think time between turns;
- `unique`: 1,500-2,000 tokens no other request shares;
- `one-prompt`: one 1,500-token system prompt in every request plus 50-150 tokens.
Each request asks for 64-256 output tokens.

Load: for each workload, the arrival rate at which least-loaded's TTFT p99 doubles (from
its value at a light load) is found by a sweep; every router then runs at 70% of it.
"least-loaded" is the same router with its prefix weight 0 (`Scoring.without_prefix`).

    python -m sluice_bench.placement           # the table (about 10-20 s)
    python -m sluice_bench.placement --json    # and the numbers as JSON
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from sluice_server.router.placement import Placement, PodLoad, Scoring, default_key

BLOCK = 16
PREFILL_S_PER_TOKEN = 40e-6
PREFILL_FIXED_S = 0.003
ITL_S = 0.008
CAPACITY_BLOCKS = 8192
SCRAPE_S = 0.25
REPLICAS = 4
SYSTEM_TOKENS = 1500


@dataclass
class Request:
    rid: int
    arrival: float
    tokens: int
    hashes: list[int]
    output: int


@dataclass
class _Conv:
    tokens: list[int]
    hashes: list[int]

    def extend(self, new: Sequence[int]) -> None:
        self.tokens.extend(new)
        parent = self.hashes[-1] if self.hashes else 0
        for start in range(len(self.hashes) * BLOCK, len(self.tokens) - BLOCK + 1, BLOCK):
            parent = hash((parent, tuple(self.tokens[start : start + BLOCK])))
            self.hashes.append(parent)


def workload(kind: str, rate: float, n: int, seed: int) -> list[Request]:
    """`n` requests of one workload arriving at `rate` per second on average."""
    rng = random.Random(seed)
    fresh = iter(range(10**6, 10**9))
    out: list[Request] = []

    def unique(k: int) -> list[int]:
        return [next(fresh) for _ in range(k)]

    if kind == "shared-prefix":
        systems = [[g * 100_000 + i for i in range(SYSTEM_TOKENS)] for g in range(16)]
        mean_turns = 4.0
        t = 0.0
        while len(out) < n:
            t += rng.expovariate(rate / mean_turns)
            conv = _Conv([], [])
            conv.extend(systems[rng.randrange(16)])
            at = t
            for turn in range(rng.randint(2, 6)):
                if turn:
                    conv.extend(unique(out[-1].output))  # the previous answer
                    at += out[-1].output * ITL_S + rng.expovariate(1 / 3.0)
                conv.extend(unique(rng.randint(50, 150)))
                out.append(
                    Request(0, at, len(conv.tokens), list(conv.hashes), rng.randint(64, 256))
                )
        out = sorted(out[:n], key=lambda r: r.arrival)
    else:
        shared = _Conv([], [])
        shared.extend(range(SYSTEM_TOKENS))
        t = 0.0
        for _ in range(n):
            t += rng.expovariate(rate)
            conv = (
                _Conv(list(shared.tokens), list(shared.hashes))
                if kind == "one-prompt"
                else _Conv([], [])
            )
            conv.extend(
                unique(rng.randint(50, 150) if kind == "one-prompt" else rng.randint(1500, 2000))
            )
            out.append(Request(0, t, len(conv.tokens), conv.hashes, rng.randint(64, 256)))
    for i, r in enumerate(out):
        r.rid = i
    return out


@dataclass
class _Replica:
    name: str
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: deque[Request] = field(default_factory=deque)
    busy: bool = False
    blocks_in_use: int = 0


@dataclass
class Result:
    router: str
    ttft_p50: float
    ttft_p99: float
    tok_s: float
    busiest_over_mean: float
    cached_share: float


Router = Callable[[Request, list[PodLoad]], str]


def simulate(
    requests: list[Request],
    router: str,
    scoring: Scoring | None = None,
    precise: bool = True,
    capacity: int = CAPACITY_BLOCKS,
) -> Result:
    """Run the fleet model on `requests` placed by `router` ("prefix", "least-loaded",
    "round-robin"), with `scoring` overriding the router's defaults."""
    replicas = [_Replica(f"pod-{i}") for i in range(REPLICAS)]
    by_name = {r.name: r for r in replicas}
    base = scoring or Scoring()
    placement = Placement(base.without_prefix() if router == "least-loaded" else base)
    for r in replicas:
        placement.index.feed(r.name, live=precise)
    in_flight = Counter[str]()
    scraped = {r.name: (0, 0.0) for r in replicas}
    last_scrape = 0.0
    events: list[tuple[float, int, str, object]] = []
    seq = iter(range(10**9))
    for req in requests:
        heapq.heappush(events, (req.arrival, next(seq), "arrive", req))
    ttft: list[float] = []
    placed = Counter[str]()
    cached_tokens = 0
    total_tokens = 0
    end = 0.0
    rr = 0

    def start(rep: _Replica, now: float) -> None:
        nonlocal cached_tokens, total_tokens
        if rep.busy or not rep.queue:
            return
        req = rep.queue.popleft()
        hit = 0
        for h in req.hashes:
            if h not in rep.cache:
                break
            rep.cache.move_to_end(h)
            hit += 1
        cached = min(hit * BLOCK, req.tokens - 1)
        cached_tokens += cached
        total_tokens += req.tokens
        rep.busy = True
        done = now + PREFILL_FIXED_S + (req.tokens - cached) * PREFILL_S_PER_TOKEN
        heapq.heappush(events, (done, next(seq), "prefilled", (rep, req)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        while now - last_scrape >= SCRAPE_S:
            last_scrape += SCRAPE_S
            scraped = {
                r.name: (len(r.queue), min(1.0, r.blocks_in_use / capacity)) for r in replicas
            }
        if kind == "arrive":
            assert isinstance(payload, Request)
            req = payload
            if router == "round-robin":
                pod = replicas[rr % REPLICAS].name
                rr += 1
            else:
                age = now - last_scrape
                loads = [
                    PodLoad(r.name, in_flight[r.name], scraped[r.name][0], scraped[r.name][1], age)
                    for r in replicas
                ]
                pod = placement.pick(req.hashes, loads, default_key(req.hashes, str(req.rid)))
            placed[pod] += 1
            in_flight[pod] += 1
            rep = by_name[pod]
            rep.queue.append(req)
            rep.blocks_in_use += len(req.hashes)
            start(rep, now)
        elif kind == "prefilled":
            rep, req = payload  # type: ignore[misc]
            ttft.append(now - req.arrival)
            stored = []
            for h in req.hashes:
                if h in rep.cache:
                    rep.cache.move_to_end(h)
                else:
                    rep.cache[h] = None
                    stored.append(h)
            removed = []
            while len(rep.cache) > capacity:
                removed.append(rep.cache.popitem(last=False)[0])
            placement.stored(rep.name, stored)
            placement.removed(rep.name, removed)
            rep.busy = False
            heapq.heappush(events, (now + req.output * ITL_S, next(seq), "finished", (rep, req)))
            start(rep, now)
        else:
            rep, req = payload  # type: ignore[misc]
            in_flight[rep.name] -= 1
            rep.blocks_in_use -= len(req.hashes)
            end = now
    ttft.sort()
    mean = len(requests) / REPLICAS
    return Result(
        router=router,
        ttft_p50=statistics.median(ttft),
        ttft_p99=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        tok_s=sum(r.output for r in requests) / (end - requests[0].arrival),
        busiest_over_mean=max(placed.values()) / mean,
        cached_share=cached_tokens / total_tokens,
    )


def knee(kind: str, n: int, seed: int, capacity: int = CAPACITY_BLOCKS) -> tuple[float, float]:
    """The arrival rate at which least-loaded's TTFT p99 is twice its light-load value,
    by a geometric sweep then bisection; returns (rate, light-load p99)."""
    mean_tokens = statistics.mean(r.tokens for r in workload(kind, 1.0, 200, seed))
    service_rate = REPLICAS / (PREFILL_FIXED_S + mean_tokens * PREFILL_S_PER_TOKEN)
    light = 0.05 * service_rate

    def p99(rate: float) -> float:
        return simulate(workload(kind, rate, n, seed), "least-loaded", capacity=capacity).ttft_p99

    base = p99(light)
    low, high = light, light
    while p99(high) < 2 * base:
        low, high = high, high * 1.25
    for _ in range(5):
        mid = (low + high) / 2
        low, high = (mid, high) if p99(mid) < 2 * base else (low, mid)
    return (low + high) / 2, base


@dataclass
class Target:
    text: str
    value: float
    bound: float
    at_most: bool

    @property
    def met(self) -> bool:
        return self.value <= self.bound if self.at_most else self.value >= self.bound


def run(
    n: int = 2000, seed: int = 1, load: float = 0.7, capacity: int = CAPACITY_BLOCKS
) -> dict[str, object]:
    """Every workload at `load` x its knee under each router, and the issue's targets."""
    rows: dict[str, dict[str, Result]] = {}
    rates: dict[str, float] = {}
    for kind in ("shared-prefix", "unique", "one-prompt"):
        rate, _ = knee(kind, n, seed, capacity)
        rates[kind] = load * rate
        reqs = workload(kind, rates[kind], n, seed)
        rows[kind] = {
            "prefix": simulate(reqs, "prefix", capacity=capacity),
            "prefix (approximate)": simulate(reqs, "prefix", precise=False, capacity=capacity),
            "least-loaded": simulate(reqs, "least-loaded", capacity=capacity),
            "round-robin": simulate(reqs, "round-robin", capacity=capacity),
            "prefix, guard off": simulate(
                reqs, "prefix", replace(Scoring(), guard=False), capacity=capacity
            ),
        }
    sp, un, op = rows["shared-prefix"], rows["unique"], rows["one-prompt"]
    targets = [
        Target(
            "shared-prefix: TTFT p50 least-loaded / prefix >= 3",
            sp["least-loaded"].ttft_p50 / sp["prefix"].ttft_p50,
            3.0,
            False,
        ),
        Target(
            "shared-prefix: TTFT p99 least-loaded / prefix >= 3",
            sp["least-loaded"].ttft_p99 / sp["prefix"].ttft_p99,
            3.0,
            False,
        ),
        Target(
            "shared-prefix: output tok/s prefix / least-loaded >= 1",
            sp["prefix"].tok_s / sp["least-loaded"].tok_s,
            0.995,
            False,
        ),
        Target(
            "shared-prefix: busiest replica / mean <= 1.3",
            sp["prefix"].busiest_over_mean,
            1.3,
            True,
        ),
        Target(
            "unique: TTFT p99 prefix / least-loaded <= 1.1",
            un["prefix"].ttft_p99 / un["least-loaded"].ttft_p99,
            1.1,
            True,
        ),
        Target(
            "one-prompt: busiest replica / mean <= 1.5", op["prefix"].busiest_over_mean, 1.5, True
        ),
    ]
    return {"rates": rates, "rows": rows, "targets": targets}


def table(report: dict[str, object]) -> str:
    rows: dict[str, dict[str, Result]] = report["rows"]  # type: ignore[assignment]
    rates: dict[str, float] = report["rates"]  # type: ignore[assignment]
    targets: list[Target] = report["targets"]  # type: ignore[assignment]
    lines = [
        "| workload (req/s) | router | TTFT p50 ms | TTFT p99 ms | output tok/s | busiest / mean | prompt tokens cached |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, by_router in rows.items():
        for name, r in by_router.items():
            lines.append(
                f"| {kind} ({rates[kind]:.1f}) | {name} | {r.ttft_p50 * 1e3:.1f} | {r.ttft_p99 * 1e3:.1f} "
                f"| {r.tok_s:,.0f} | {r.busiest_over_mean:.2f} | {r.cached_share:.0%} |"
            )
    lines += ["", "| target | value | met |", "|---|---:|---|"]
    for t in targets:
        lines.append(f"| {t.text} | {t.value:.2f} | {'met' if t.met else 'NOT MET'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=float, default=0.7, help="share of least-loaded's knee rate")
    parser.add_argument(
        "--capacity", type=int, default=CAPACITY_BLOCKS, help="KV cache blocks per replica"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.requests, args.seed, args.load, args.capacity)
    print(table(report))
    if args.json:
        rows: dict[str, dict[str, Result]] = report["rows"]  # type: ignore[assignment]
        print(
            json.dumps({k: {n: vars(r) for n, r in v.items()} for k, v in rows.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
