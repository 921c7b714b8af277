"""How an endpoint picker reads a pod's /metrics: llm-d-router's metrics extractor's rules,
written again in Python for the tests (its Go source is not copied; read at llm-d-router
commit 03a70c3b, `pkg/epp/framework/plugins/datalayer/extractor/metrics/`: extractor.go,
spec.go, loraspec.go, mapping_registry.go).

- The exposition is grouped into metric families by name, as Prometheus' text parser does.
- A gauge spec (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`): the family must exist and hold a
  sample, else an error for that field; of the samples whose labels match the spec (the
  vLLM mapping names none) it takes the one with the largest timestamp, and with no
  timestamps (ours) the FIRST one. So a gauge split into one series per worker reads as one
  worker's share, and a doubled one reads double: the pod must expose each exactly once.
- Waiting and running are truncated to ints; KV cache usage is the float (0..1).
- `vllm:cache_config_info`: the labels `block_size` and `num_gpu_blocks` are parsed as ints
  (Go's `strconv.Atoi`: "None" or "16.0" is an error).
- `vllm:lora_requests_info`: absent is fine (no adapter loaded); else the series with the
  largest VALUE (its value is a timestamp) gives `running_lora_adapters` and
  `waiting_lora_adapters` (comma lists) and `max_lora` (int).
- The mapping is chosen by the pod label `llm-d.ai/engine-type` (then GAIE's older
  `inference.networking.k8s.io/engine-type`), falling back to the default (vLLM) mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?$")
_LABEL = re.compile(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"')
_ATOI = re.compile(r"^[+-]?\d+$")


@dataclass
class Series:
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None


def families(text: str) -> dict[str, list[Series]]:
    """Family name -> its samples, in exposition order."""
    out: dict[str, list[Series]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a sample line: {line!r}")
        name, labels, value, ts = m.groups()
        out.setdefault(name, []).append(
            Series(dict(_LABEL.findall(labels or "")), float(value), int(ts) if ts else None)
        )
    return out


def latest(fams: dict[str, list[Series]], name: str) -> Series:
    """spec.go getLatestMetric: the matching sample with the largest timestamp, first on a tie."""
    series = fams.get(name)
    if not series:
        raise LookupError(f"metric family {name!r} not found")
    best, recent = None, -1
    for s in series:
        ts = s.timestamp_ms or 0
        if ts > recent:
            best, recent = s, ts
    assert best is not None
    return best


def _atoi(value: str, what: str) -> int:
    if not _ATOI.match(value):
        raise ValueError(f"{what}={value!r} is not an integer (strconv.Atoi)")
    return int(value)


@dataclass
class EndpointMetrics:
    """What the extractor stores for one endpoint; `errors` as it would report them."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    block_size: int = 0
    num_gpu_blocks: int = 0
    active_adapters: set[str] = field(default_factory=set)
    waiting_adapters: set[str] = field(default_factory=set)
    max_adapters: int = 0
    errors: list[str] = field(default_factory=list)


def extract(text: str) -> EndpointMetrics:
    fams, out = families(text), EndpointMetrics()
    for name, attr, conv in (
        ("vllm:num_requests_waiting", "waiting", int),
        ("vllm:num_requests_running", "running", int),
        ("vllm:kv_cache_usage_perc", "kv_cache_usage", float),
    ):
        try:
            setattr(out, attr, conv(latest(fams, name).value))
        except LookupError as exc:
            out.errors.append(str(exc))
    try:
        info = latest(fams, "vllm:cache_config_info").labels
        for label, attr in (("block_size", "block_size"), ("num_gpu_blocks", "num_gpu_blocks")):
            if info.get(label):
                setattr(out, attr, _atoi(info[label], label))
    except (LookupError, ValueError) as exc:
        out.errors.append(str(exc))
    lora = fams.get("vllm:lora_requests_info") or []
    if lora:
        newest = max(lora, key=lambda s: s.value)  # the first of the largest, as loraspec.go
        split = lambda v: {a.strip() for a in v.split(",") if a.strip()}  # noqa: E731
        out.active_adapters = split(newest.labels.get("running_lora_adapters", ""))
        out.waiting_adapters = split(newest.labels.get("waiting_lora_adapters", ""))
        if newest.labels.get("max_lora"):
            out.max_adapters = _atoi(newest.labels["max_lora"], "max_lora")
    return out


def engine_type(pod_labels: dict[str, str]) -> str:
    """mapping_registry.go / extractor.go: which mapping the EPP uses for a pod."""
    return (
        pod_labels.get("llm-d.ai/engine-type")
        or pod_labels.get("inference.networking.k8s.io/engine-type")
        or "default"
    )
