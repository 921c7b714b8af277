"""What a pod's /metrics says of its load: requests waiting and KV-cache use (pure).

- waiting: vLLM's `vllm:num_requests_waiting` (requests its scheduler has not started; one
  sample per engine, summed) plus the server's own `sluice_queue_depth` (requests in the
  admission queue, before the engine; one sample per priority class, summed). A server on
  the simulator engine exports only the second; a vLLM pod both.
- KV use: vLLM's `vllm:kv_cache_usage_perc` (0..1, "1 means 100 percent"; the highest over
  its engines). The simulator exports none: it reads as 0 on every such pod, which scores
  them alike.

A page with neither waiting measure is no load reading (`parse_load` returns None): the
pod is scored as if never scraped (placement.py: a stale scrape is neutral).

Only the lines of those three metrics go through prometheus_client's parser: a server's
page is some 800 lines of histograms, which the parser took 30 ms to read (pure Python),
every `--load-scrape-seconds` for every pod, on the router's one core.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USE = "vllm:kv_cache_usage_perc"
QUEUE_DEPTH = "sluice_queue_depth"
_NAMES = (VLLM_WAITING, VLLM_KV_USE, QUEUE_DEPTH)


@dataclass(frozen=True)
class Load:
    waiting: int
    kv_use: float


def parse_load(text: str) -> Load | None:
    """The load a /metrics page reports; None when it reports no waiting measure.
    ValueError when a sample line of those metrics is not Prometheus text."""
    waiting: float | None = None
    kv_use: float | None = None
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            if sample.name in (VLLM_WAITING, QUEUE_DEPTH):
                waiting = (waiting or 0.0) + sample.value
            elif sample.name == VLLM_KV_USE:
                kv_use = sample.value if kv_use is None else max(kv_use, sample.value)
    if waiting is None:
        return None
    return Load(round(waiting), min(1.0, max(0.0, kv_use or 0.0)))
