"""Prometheus metrics, names as in docs/design.md. One registry per app (tests build many).

With several worker processes (`--api-workers`), prometheus_client's multiprocess mode:
the supervisor points `PROMETHEUS_MULTIPROC_DIR` at a fresh folder before it spawns the
workers, every worker's metrics are files there, and any worker's `/metrics` answers the
sum over all of them (counters and histograms summed, the active-streams gauge summed over
live workers), so one scrape is the pod's totals and the autoscaler's queries do not
change.
"""

from __future__ import annotations

import os
import time

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from .families import Families

# 5 ms .. 60 s, roughly x2 steps with extra resolution where TTFT targets live.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
# Inter-token latency is much shorter; add sub-5 ms buckets so it resolves on fast GPUs.
ITL_BUCKETS = (0.001, 0.0025) + LATENCY_BUCKETS

REJECTION_REASONS = (
    "auth", "rate_limit", "limiter_unavailable", "capacity", "bad_input", "draining", "origin",
)  # fmt: skip
PROTOCOLS = ("openai", "responses", "anthropic", "sse", "websocket")


class Metrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        fam = Families(self.registry)
        labels = ("protocol", "model")
        self.ttft = fam.histogram(
            "sluice_ttft_seconds",
            "Request received to the first token's bytes written to the socket.",
            labels,
            buckets=LATENCY_BUCKETS,
        )
        self.itl = fam.histogram(
            "sluice_inter_token_latency_seconds",
            "Time between consecutive token-event writes to the socket: one observation "
            "per delivered chunk, however many tokens it carries (vLLM's benchmark counts "
            "inter-token latency the same way).",
            labels,
            buckets=ITL_BUCKETS,
        )
        self.e2e = fam.histogram(
            "sluice_e2e_latency_seconds",
            "Request received to the end of the stream (any outcome).",
            labels,
            buckets=LATENCY_BUCKETS,
        )
        self.first_output = fam.histogram(
            "sluice_first_output_seconds",
            "Request received to the engine's first output (admission queue, the engine's "
            "own queue and prefill).",
            labels,
            buckets=LATENCY_BUCKETS,
        )
        self.output_tokens = fam.counter(
            "sluice_output_tokens", "Tokens streamed to clients.", labels
        )
        # Accepted, not admitted to a slot: the alerts divide disconnects and stream errors
        # by it, and a stream answered 200 can still leave or time out in the queue.
        self.requests = fam.counter(
            "sluice_requests",
            "Generation requests accepted: answered 200 (a stream, also one that then waits "
            "in the admission queue for a slot) or with a whole answer.",
            labels,
        )
        self.disconnects = fam.counter(
            "sluice_client_disconnects",
            "Clients that went away mid-stream, or stopped reading and were cut off.",
            labels,
        )
        self.aborts = fam.counter(
            "sluice_aborts",
            "Engine requests aborted before they finished (any cause).",
            labels,
        )
        self.stream_errors = fam.counter(
            "sluice_stream_errors",
            "Streams ended by an error event after the 200.",
            labels,
        )
        self.handed_over = fam.counter(
            "sluice_streams_handed_over",
            "Streams handed to the router, which continues them on another pod: at the end "
            "of a drain's hand-over window, or on an engine failure.",
            labels,
        )
        self.rejections = fam.counter(
            "sluice_rejections",
            "Requests refused before streaming, by reason.",
            (*labels, "reason"),
        )
        self.resumes = fam.counter(
            "sluice_stream_resumes",
            "Dropped token streams resumed with Last-Event-ID.",
            labels,
        )
        self.resumes_expired = fam.counter(
            "sluice_stream_resumes_expired",
            "Dropped token streams whose resume window passed (then aborted).",
            labels,
        )
        self.kv_transfer = fam.counter(
            "sluice_kv_transfer_tokens",
            "Disaggregated serving: prompt tokens this pod prefilled for a decode pod "
            "(direction out: each /internal/prefill that finished), and prompt tokens a decode "
            "request did not compute because a prefill's KV cache came with it (direction in: "
            "the engine's cached prompt tokens on requests with X-Sluice-KV-Transfer).",
            ("model", "role", "direction"),
        )
        self.active = fam.gauge(
            "sluice_active_streams",
            "Streams generating: each holds a stream slot (a stream that waits in the "
            "admission queue is in sluice_queue_depth instead).",
            labels,
            mode="livesum",
        )
        self.limiter_errors = fam.counter(
            "sluice_rate_limit_backend_errors",
            "Rate-limit store (Redis) calls that failed or were skipped while it was down; "
            "the request then followed --rate-limit-failure-mode.",
            ("model", "op"),
        )
        # Per tenant (never per key): admissions and token use, for quotas and billing.
        self.tenant_requests = fam.counter(
            "sluice_tenant_requests",
            "Generation requests by tenant and result: admitted, rate_limit, limiter_unavailable, "
            "continued (a continuation of a stream another replica admitted: no rate limit).",
            ("model", "tenant", "result"),
        )
        self.tenant_tokens = fam.counter(
            "sluice_tenant_tokens",
            "Prompt + completion tokens by tenant (what the tokens-per-minute limit charges).",
            ("model", "tenant"),
        )
        self.credential_reloads = fam.counter(
            "sluice_credential_reloads",
            "Reloads of the key file or JWKS file after it changed, by file and result (ok, "
            "error: the file was refused and the credentials loaded before stay).",
            ("model", "file", "result"),
        )
        # The admission queue (--queue-size), by priority class and tenant.
        self.queue_wait = fam.histogram(
            "sluice_queue_wait_seconds",
            "Time an admitted request waited in the admission queue for a stream slot (0 "
            "when one was free), by tenant and priority class.",
            ("model", "tenant", "priority"),
            buckets=(0.0,) + LATENCY_BUCKETS,
        )
        self.queue_depth = fam.gauge(
            "sluice_queue_depth",
            "Requests waiting in the admission queue, by priority class.",
            ("model", "priority"),
            mode="livesum",
        )
        self.queue_sheds = fam.counter(
            "sluice_queue_sheds",
            "Requests the admission queue refused, by priority class and reason: queue_full "
            "(no place, at once), displaced (shed for a better newcomer), timeout, draining.",
            ("model", "priority", "reason"),
        )
        # LoRA adapters (core/adapters.py): the operator reads the state for the status.
        self.adapter_state = fam.gauge(
            "sluice_adapter_state",
            "LoRA adapters of --adapters-file: 1 for each adapter's current state (Loading, "
            "Ready, Failed with its reason), 0 for states it left; the maximum over the pod's "
            "workers.",
            ("model", "adapter", "id", "state", "reason"),
            mode="livemax",
        )
        self.adapter_loads = fam.counter(
            "sluice_adapter_loads",
            "Adapter loads by result: ok, failed (the adapter is Failed, the others serve), "
            "file_error (the adapters file was refused; nothing changed).",
            ("model", "result"),
        )
        self.adapter_load_seconds = fam.histogram(
            "sluice_adapter_load_seconds",
            "From an adapter appearing in the file to it serving (download included).",
            ("model",),
            buckets=LATENCY_BUCKETS,
        )
        # Scale to zero: the operator reads it from each pod (with sluice_active_streams)
        # to tell an idle model; the process start counts as the last request, so a new
        # pod is never idle before it has served for idleSeconds.
        self.last_request = fam.gauge(
            "sluice_last_request_timestamp_seconds",
            "Unix time of the last generation request admitted (the process start before "
            "the first); the newest over the pod's workers.",
            ("model",),
            mode="livemax",
        )
        self.last_request.labels(model).set(time.time())
        # The engine's node group (`--nnodes`): only the leader (rank 0) serves HTTP, so its
        # page speaks for the group.
        self.engine_nodes = fam.gauge(
            "sluice_engine_nodes",
            "Nodes the engine runs on (--nnodes; 1: one node).",
            ("model",),
            mode="livemax",
        )
        self.engine_node_rank = fam.gauge(
            "sluice_engine_node_rank",
            "This server's node rank in the engine's group (0: the leader, which serves the "
            "API; the workers serve no /metrics).",
            ("model",),
            mode="livemax",
        )
        self.engine_group_up = fam.gauge(
            "sluice_engine_group_up",
            "1 while the engine is loaded and passes its health check, which on several "
            "nodes means every node's workers joined it (a lost worker node is noticed at "
            "the engine's next step); 0 while loading or failed. Set by each /ready, /health "
            "and /metrics request.",
            ("model",),
            mode="livemostrecent",
        )
        self.engine_group_up.labels(model)
        # Set once, when the server starts serving (`sluice_server/startup.py`).
        self.startup_phase = fam.gauge(
            "sluice_startup_phase_seconds",
            "Seconds from the process's start (a worker's: its supervisor's) to each start-up "
            "phase it passed: process_started, imports_done, weights_located, engine_imported, "
            "engine_ready, serving; the slowest over the pod's workers.",
            ("model", "phase"),
            mode="livemax",
        )
        # Pre-create the label sets so dashboards and the autoscaler see zeros, not gaps.
        for p in PROTOCOLS:
            for m in (
                self.ttft,
                self.itl,
                self.e2e,
                self.first_output,
                self.output_tokens,
                self.requests,
                self.disconnects,
                self.aborts,
                self.stream_errors,
                self.resumes,
                self.resumes_expired,
                self.active,
            ):
                m.labels(p, model)
            for reason in REJECTION_REASONS:
                self.rejections.labels(p, model, reason)
        for op in ("admit", "charge"):
            self.limiter_errors.labels(model, op)

    def queue_classes(self, priorities: tuple[str, ...]) -> None:
        """Zeros for every priority class's depth and sheds (with a queue)."""
        for priority in priorities:
            self.queue_depth.labels(self.model, priority)
            for reason in ("queue_full", "displaced", "timeout", "draining"):
                self.queue_sheds.labels(self.model, priority, reason)

    def engine_group(self, nodes: int, rank: int) -> None:
        self.engine_nodes.labels(self.model).set(nodes)
        self.engine_node_rank.labels(self.model).set(rank)

    def startup_phases(self, phases: list[tuple[str, float]]) -> None:
        for phase, seconds in phases:
            self.startup_phase.labels(self.model, phase).set(seconds)

    def engine_up(self, up: bool) -> None:
        self.engine_group_up.labels(self.model).set(1 if up else 0)

    def reject(self, protocol: str, reason: str) -> None:
        self.rejections.labels(protocol, self.model, reason).inc()

    def count_tenant_request(self, tenant: str, result: str) -> None:
        self.tenant_requests.labels(self.model, tenant, result).inc()

    def count_tenant_tokens(self, tenant: str, tokens: int) -> None:
        self.tenant_tokens.labels(self.model, tenant).inc(tokens)


def exposition(metrics: Metrics) -> bytes:
    """The `/metrics` body: our metrics, then the process-wide default registry (process/GC
    metrics and, on vLLM, the engine's own `vllm:*` metrics); in multiprocess mode the sum
    over every worker's files instead (vLLM's metrics included: it writes them there too)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(metrics.registry) + generate_latest(REGISTRY)


class Bound:
    """Label-bound children for one protocol and served model (the base, or a LoRA
    adapter), so the hot path does no label lookups."""

    __slots__ = ("ttft", "itl", "e2e", "first_output", "output_tokens", "requests",
                 "disconnects", "aborts", "stream_errors", "handed_over", "active",
                 "last_request")  # fmt: skip
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    first_output: Histogram
    output_tokens: Counter
    requests: Counter
    disconnects: Counter
    aborts: Counter
    stream_errors: Counter
    handed_over: Counter
    active: Gauge
    last_request: Gauge  # per pod, not per protocol or adapter: the base model's label

    def __init__(self, m: Metrics, protocol: str, model: str) -> None:
        for name in self.__slots__[:-1]:
            setattr(self, name, getattr(m, name).labels(protocol, model))
        self.last_request = m.last_request.labels(m.model)


def bind(metrics: Metrics, protocol: str, model: str | None = None) -> Bound:
    """`model`: the served name a request asked for (default: the base's)."""
    key = (protocol, model or metrics.model)
    cache: dict[tuple[str, str], Bound] = metrics.__dict__.setdefault("_bound", {})
    b = cache.get(key)
    if b is None:
        b = cache[key] = Bound(metrics, *key)
    return b
