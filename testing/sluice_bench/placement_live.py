"""Placement on live pods: the fleet's prefix-cache hit rate through the Sluice router.

The client side of tests/e2e/test_router_placement_live.py (three real vLLM pods on the
tiny model, each with a KV cache smaller than the workload's working set, behind the
router, reached through the e2e ingress): the workload, one phase's run, the pods' own
prefix-cache counters, the targets and the table (`section`), which the test writes into
docs/benchmarks.md's `placement-live` block when asked (`make bench-placement-live`).

Workload (`workload`): `groups` groups, each with its own shared prefix of `prefix_blocks`
whole KV blocks of the engine (plus a few tokens, so the prefix's blocks are the same
whatever follows), and `per_group` requests per group, each the group's prefix, a line of
its own and `max_tokens` output tokens, in a seeded random order. Every phase gets its own
`tag` in front of every prompt: its blocks hash apart from the previous phases', so what a
pod's cache kept from them can never hit. With `groups * prefix_blocks` above one pod's
cache and `groups * prefix_blocks / pods` under it, placement decides the hit rate: a
router that keeps each group on one pod keeps its prefix cached there, one that spreads
the groups makes every pod cycle through all of them (LRU).

The hit rate is vLLM's own: `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`
(prompt tokens found in the cache over prompt tokens looked up), read from each pod's
`/metrics` before and after a phase and summed over the pods. The ceiling of a workload
(`Workload.ceiling`): every request but each group's first served its whole prefix from
the cache, on one pod.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from sluice_bench import docblock

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


@dataclass(frozen=True)
class Request:
    group: int
    prompt: str


@dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]
    prefix_tokens: int  # tokens of each group's shared prefix
    prompt_tokens: int  # a prompt's tokens, about (the longest)
    groups: int

    def ceiling(self, block: int) -> float:
        """The hit rate if every request but each group's first found the prefix's whole
        blocks cached (one cache that holds everything)."""
        n = len(self.requests)
        return (n - self.groups) * (self.prefix_tokens // block) * block / (n * self.prompt_tokens)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randint(0, 9999)}" for _ in range(n))


def workload(count_tokens: Callable[[str], int], *, tag: str, groups: int, per_group: int,
             block: int, prefix_blocks: int, seed: int = 1) -> Workload:  # fmt: skip
    """`count_tokens(text) -> int`: the model's tokenizer (what vLLM counts)."""
    rng = random.Random(seed)
    want = prefix_blocks * block + 16  # whole blocks that end before the text does
    prefixes = []
    for g in range(groups):
        text = f"{tag} group {g}. "
        while count_tokens(text) < want:
            text += f"Fact {rng.randint(0, 999)} of group {g}: {_words(rng, 6)}.\n"
        prefixes.append(text)
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    requests = tuple(Request(g, f"{prefixes[g]}Question {i}: {_words(rng, 8)}?")
                     for i, g in enumerate(order))  # fmt: skip
    return Workload(
        requests,
        min(count_tokens(p) for p in prefixes),
        max(count_tokens(r.prompt) for r in requests),
        groups,
    )


def samples(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a Prometheus text page whose labels include these."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name and all(w in (m.group(2) or "") for w in want):
            total += float(m.group(3))
    return total


def cache_counters(pods: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Each pod's (prefix-cache hits, queries) in tokens, from its own /metrics."""
    out = {}
    for url in pods:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out[url] = (samples(text, HITS), samples(text, QUERIES))
    return out


@dataclass
class Phase:
    name: str
    pods: int
    sent: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    per_pod: dict[str, tuple[float, float]] = field(default_factory=dict)  # deltas
    picks: dict[str, float] = field(default_factory=dict)  # the router's, by what decided

    @property
    def hits(self) -> float:
        return sum(h for h, _ in self.per_pod.values())

    @property
    def queries(self) -> float:
        return sum(q for _, q in self.per_pod.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def pods_served(self) -> int:
        return sum(1 for _, q in self.per_pod.values() if q > 0)


def delta(before: Mapping[str, tuple[float, float]],
          after: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:  # fmt: skip
    return {p: (h - before.get(p, (0.0, 0.0))[0], q - before.get(p, (0.0, 0.0))[1])
            for p, (h, q) in after.items()}  # fmt: skip


async def _send(url: str, model: str, requests: Sequence[Request], concurrency: int,
                max_tokens: int, phase: Phase) -> None:  # fmt: skip
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            phase.sent += 1
            try:
                resp = await http.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": r.prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True})  # fmt: skip
                body = resp.json() if resp.status_code == 200 else None
                if body and body["usage"]["completion_tokens"] == max_tokens:
                    phase.ok += 1
                else:
                    phase.errors.append(f"{resp.status_code}: {resp.text[:200]}")
            except httpx.HTTPError as e:
                phase.errors.append(f"{type(e).__name__}: {e}"[:200])

    async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


def run_phase(phase: Phase, url: str, model: str, pods: Sequence[str],
              requests: Sequence[Request], *, concurrency: int = 3,
              max_tokens: int = 2) -> Phase:  # fmt: skip
    """Send the requests through `url` (the route to the router), `concurrency` at a time;
    the pods' counters (at their own addresses) before and after."""
    before = cache_counters(pods)
    asyncio.run(_send(url, model, requests, concurrency, max_tokens, phase))
    phase.per_pod = delta(before, cache_counters(pods))
    return phase


@dataclass(frozen=True)
class Target:
    text: str
    value: float
    bound: float

    @property
    def met(self) -> bool:
        return self.value >= self.bound


def targets(prefix: Phase, round_robin: Phase, least_loaded: Phase, single: Phase) -> list[Target]:
    """The issue's: the fleet's hit rate with prefix placement at least 0.9 x one pod's with
    the same cache on the same workload, and above round robin's and least-loaded's in the
    same run."""
    return [
        Target("prefix / one pod >= 0.9",
               prefix.hit_rate / single.hit_rate if single.hit_rate else 0.0, 0.9),
        Target("prefix - round robin > 0", prefix.hit_rate - round_robin.hit_rate, 1e-9),
        Target("prefix - least-loaded > 0", prefix.hit_rate - least_loaded.hit_rate, 1e-9),
    ]  # fmt: skip


PICKED_BY = ("prefix", "load", "round-robin")


def table(phases: Sequence[Phase], found: Sequence[Target], ceiling: float) -> str:
    lines = [
        "| placement | pods | requests ok | pods served | prompt tokens | cached | hit rate "
        f"| router picks ({' / '.join(PICKED_BY)}) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in phases:
        picks = " / ".join(f"{p.picks.get(by, 0):.0f}" for by in PICKED_BY)
        lines.append(f"| {p.name} | {p.pods} | {p.ok}/{p.sent} | {p.pods_served} "
                     f"| {p.queries:,.0f} | {p.hits:,.0f} | {p.hit_rate:.3f} | {picks} |")  # fmt: skip
    lines.append(f"| (ceiling: one cache holding every prefix) | | | | | | {ceiling:.3f} | |")
    lines += ["", "| target | value | met |", "|---|---:|---|"]
    for t in found:
        lines.append(f"| {t.text} | {t.value:.3f} | {'met' if t.met else 'NOT MET'} |")
    return "\n".join(lines)


def section(phases: Sequence[Phase], found: Sequence[Target], w: Workload, *, block: int,
            cache_blocks: int, prefix_blocks: int) -> str:  # fmt: skip
    """docs/benchmarks.md's `placement-live` block: the setup as measured, then the table."""
    per_group = len(w.requests) // w.groups
    head = (
        f"The tiny model on vLLM's CPU engine, {max(p.pods for p in phases)} pods, each with a "
        f"KV cache of {cache_blocks} blocks of {block} tokens, below the workload's "
        f"{w.groups * prefix_blocks} blocks of shared prefixes; {len(w.requests)} completions "
        f"per phase ({w.groups} groups of {per_group} sharing a {w.prefix_tokens}-token "
        f"prefix, prompts up to {w.prompt_tokens} tokens), 3 at a time, through the e2e "
        "ingress and one router pod. Hit rate: the pods' own `vllm:prefix_cache_hits_total / "
        "vllm:prefix_cache_queries_total` over the phase, summed over the pods.\n\n"
    )
    return head + table(phases, found, w.ceiling(block)) + "\n"


def write(text: str) -> None:
    docblock.write("placement-live", "tests/e2e/test_router_placement_live.py "
                   "(`make bench-placement-live`)", text)  # fmt: skip
