"""Which Ready pod gets a request: a weighted prefix score plus load scores, under a
saturation guard, with a tie-break every router replica computes alike.

Each scorer gives every candidate a number in [0, 1], normalised as llm-d's endpoint picker
does (llm-d/llm-d-router, pkg/epp/framework/plugins/scheduling/scorer/):

- prefix (`prefix/plugin.go`, its default `matchLengthWeight` 0): matched blocks over the
  request's blocks, from `PrefixIndex.longest_prefix` (precise from KV events, as llm-d's
  precise-prefix-cache producer, or approximate from what this router sent);
- queue (`queuedepth/queue.go`): `(max - waiting) / (max - min)` over the candidates, 1.0 for
  all when every queue is the same length;
- KV use (`kvcacheutilization/kvcache_utilization.go`): `1 - kv_use`;
- in flight (`activerequest/active_request.go`, idle threshold 0, max busy score 1): 1.0 for
  a pod with no stream from this router, else `(max - n) / max`. The router's own count is
  fresh on every request, where the scraped two lag by a scrape interval.

The total is the weighted sum; the default weights are llm-d's precise-prefix-cache sample
(`deploy/config/epp-precise-prefix-cache-config.yaml`: prefix 2, KV use 1, queue 1) plus the
in-flight scorer at 1, and `sluice_bench.placement` measures them on a model of the fleet.

Two rules llm-d's weighted sum does not have:

- *the saturation guard*: a pod whose waiting queue or KV use is past its threshold is not a
  candidate while another pod is under both (whatever the weights, affinity to one system
  prompt shared by every request cannot pile them onto the pod that cached it first; once
  it is past the threshold, the others get requests, cache the prompt and tie on prefix);
- *a stable tie-break*: among equal totals the pod with the highest hash of (request key,
  pod name) wins (rendezvous hashing; llm-d's max-score picker breaks ties at random). Two
  router replicas fed the same events and loads therefore pick the same pod, and a prefix
  no pod holds yet lands on the same pod for every request keyed by it.

A scrape older than `Scoring.stale_after_s` is not believed: that pod is scored (and guarded)
as if it were as loaded as the busiest pod with a fresh scrape, so a pod whose /metrics went
quiet neither attracts traffic with an old idle reading nor is shunned for an old busy one
for longer than the staleness bound; with no fresh scrape at all the scraped scorers are
neutral and the in-flight count balances alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from sluice_server.router.prefixindex import BlockHash, PrefixIndex


class PrefixLookup(Protocol):
    def longest_prefix(self, pod: str, hashes: Sequence[BlockHash]) -> int: ...


@dataclass(frozen=True)
class PodLoad:
    """One Ready candidate's load: `in_flight` is this router's own count of streams on
    it; `waiting` (requests queued in the engine) and `kv_use` (0..1) come from the pod's
    /metrics, scraped `scrape_age_s` seconds ago (`math.inf`: never)."""

    pod: str
    in_flight: int = 0
    waiting: int = 0
    kv_use: float = 0.0
    scrape_age_s: float = 0.0


@dataclass(frozen=True)
class Scoring:
    """Weights of the scorers, the saturation guard's thresholds and the staleness bound."""

    prefix_weight: float = 2.0
    queue_weight: float = 1.0
    kv_weight: float = 1.0
    in_flight_weight: float = 1.0
    # The guard: past either, a pod is not a candidate while another is under both.
    waiting_max: int = 4
    kv_use_max: float = 0.9
    guard: bool = True
    stale_after_s: float = 3.0

    def without_prefix(self) -> Scoring:
        """The same router with its prefix score off (load only): "least-loaded"."""
        return replace(self, prefix_weight=0.0)


@dataclass(frozen=True)
class ScoreBreakdown:
    """Why a pod scored what it did (for the access log and metrics)."""

    pod: str
    prefix_blocks: int
    prefix: float
    queue: float
    kv: float
    in_flight: float
    total: float
    saturated: bool
    stale: bool
    tie: int


def tie_hash(key: str | bytes, pod: str) -> int:
    """The stable tie-break: equal on every router replica and every run."""
    raw = key.encode() if isinstance(key, str) else key
    return int.from_bytes(
        hashlib.blake2b(raw + b"\x00" + pod.encode(), digest_size=8).digest(), "big"
    )


def rank(
    hashes: Sequence[BlockHash],
    pods: Sequence[PodLoad],
    index: PrefixLookup,
    scoring: Scoring,
    key: str | bytes,
) -> list[ScoreBreakdown]:
    """Every candidate scored, best first (guarded pods after those with room)."""
    if not pods:
        return []
    fresh = [p for p in pods if p.scrape_age_s <= scoring.stale_after_s]
    worst_waiting = max((p.waiting for p in fresh), default=0)
    worst_kv = max((p.kv_use for p in fresh), default=0.0)

    def seen(p: PodLoad) -> tuple[int, float, bool]:
        if p.scrape_age_s <= scoring.stale_after_s:
            return p.waiting, p.kv_use, False
        return worst_waiting, worst_kv, True

    views = {p.pod: seen(p) for p in pods}
    waits = [v[0] for v in views.values()]
    low, high = min(waits), max(waits)
    busiest = max(p.in_flight for p in pods)
    total_blocks = len(hashes)
    # The prefix lookup is skipped when its weight is 0 (least-loaded costs no index walk).
    use_prefix = scoring.prefix_weight != 0.0 and total_blocks > 0

    rows: list[ScoreBreakdown] = []
    for p in pods:
        waiting, kv_use, stale = views[p.pod]
        blocks = index.longest_prefix(p.pod, hashes) if use_prefix else 0
        prefix = blocks / total_blocks if use_prefix else 0.0
        queue = 1.0 if high == low else (high - waiting) / (high - low)
        kv = 1.0 - min(1.0, max(0.0, kv_use))
        inflight = 1.0 if p.in_flight <= 0 else (busiest - p.in_flight) / busiest
        total = (
            scoring.prefix_weight * prefix
            + scoring.queue_weight * queue
            + scoring.kv_weight * kv
            + scoring.in_flight_weight * inflight
        )
        saturated = waiting > scoring.waiting_max or kv_use > scoring.kv_use_max
        rows.append(
            ScoreBreakdown(
                pod=p.pod,
                prefix_blocks=blocks,
                prefix=prefix,
                queue=queue,
                kv=kv,
                in_flight=inflight,
                total=round(total, 9),  # equal inputs, equal totals, on every replica
                saturated=saturated,
                stale=stale,
                tie=tie_hash(key, p.pod),
            )
        )
    guarded = scoring.guard and any(not r.saturated for r in rows)
    rows.sort(key=lambda r: (guarded and r.saturated, -r.total, -r.tie))
    return rows


def pick(
    hashes: Sequence[BlockHash],
    pods: Sequence[PodLoad],
    index: PrefixLookup,
    scoring: Scoring,
    key: str | bytes,
) -> str:
    """The pod for a request with these block hashes (see the module docstring)."""
    ranked = rank(hashes, pods, index, scoring, key)
    if not ranked:
        raise LookupError("no Ready pod to place the request on")
    return ranked[0].pod


class Placement:
    """One router replica's placement state: its prefix index, fed by the pods' KV events
    and by its own sends, and its scoring. The event methods are the ones
    `kvcache/kvevents.py` calls per decoded event."""

    def __init__(self, scoring: Scoring | None = None, index: PrefixIndex | None = None) -> None:
        self.scoring = scoring or Scoring()
        self.index = index or PrefixIndex()

    def stored(
        self, pod: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> None:
        self.index.stored(pod, hashes, parent)

    def removed(self, pod: str, hashes: Sequence[BlockHash]) -> None:
        self.index.removed(pod, hashes)

    def cleared(self, pod: str) -> None:
        self.index.cleared(pod)

    def rank(
        self, hashes: Sequence[BlockHash], pods: Sequence[PodLoad], key: str | bytes
    ) -> list[ScoreBreakdown]:
        return rank(hashes, pods, self.index, self.scoring, key)

    def pick(self, hashes: Sequence[BlockHash], pods: Sequence[PodLoad], key: str | bytes) -> str:
        """Pick a pod and remember the request's blocks there (the approximate index)."""
        pod = pick(hashes, pods, self.index, self.scoring, key)
        if self.scoring.prefix_weight != 0.0:
            self.index.sent(pod, hashes)
        return pod


def default_key(hashes: Sequence[Hashable], fallback: str) -> str | bytes:
    """The tie-break key: the first block's hash when there is one (requests sharing a
    prefix no pod holds then land together), else the caller's (the request id)."""
    if not hashes:
        return fallback
    return repr(hashes[0])


__all__ = [
    "PodLoad",
    "Placement",
    "PrefixLookup",
    "ScoreBreakdown",
    "Scoring",
    "default_key",
    "pick",
    "rank",
    "tie_hash",
]
