"""The server's command line, exactly as in docs/design.md ("Server command line")."""

from __future__ import annotations

import math
import re

from ..models.engine import SimulatorSpec
from ..models.resource import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    JWKS_DIR,
    JWKS_FILE,
    WEIGHTS_DIR,
    StreamingModel,
)
from .adapters import lora_args
from .common import PORT, fmt_number
from .continuation import continuation_args
from .disaggregation import disaggregation_args
from .kvevents import kv_event_args
from .secrets import secret_args
from .weights import serves_cached

# SIGTERM to exit: the pod keeps serving in-flight streams for the stream timeout, after a
# short preStop pause that lets endpoints and the ingress stop sending new requests.
PRESTOP_SECONDS = 5
DRAIN_MARGIN_SECONDS = 15


def root_path(model: StreamingModel) -> str:
    """The path prefix the pods answer under ("" for none): the Ingress's or the
    HTTPRoute's path, which both pass the prefix on unchanged (the two are exclusive)."""
    spec = model.spec
    if spec.gateway is not None:
        return spec.gateway.path.rstrip("/")
    return spec.ingress.path.rstrip("/") if spec.ingress.enabled else ""


def drain_seconds(model: StreamingModel) -> int:
    return model.spec.streaming.stream_timeout_seconds


def termination_grace_seconds(model: StreamingModel) -> int:
    return PRESTOP_SECONDS + drain_seconds(model) + DRAIN_MARGIN_SECONDS


# Derived --api-workers never exceeds this: past it the engine, not the front end, limits.
MAX_DERIVED_API_WORKERS = 8
_CPU = re.compile(r"^([0-9]*\.?[0-9]+)(m?)$")


def cpu_cores(quantity: int | str | None) -> float | None:
    """A CPU quantity (4, "2.5", "500m") in cores; None when unset or in another unit."""
    if quantity is None:
        return None
    m = _CPU.match(str(quantity))
    if m is None:
        return None
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def api_workers(model: StreamingModel) -> int:
    """spec.server.apiWorkers, else one per whole requested core beyond the engine core's,
    capped, and 1 when streams are resumable (see the field's description)."""
    given = model.spec.server.api_workers
    if given is not None:
        return given
    cores = cpu_cores(model.spec.resources.requests.cpu)
    if cores is None or model.spec.streaming.resume.grace_seconds or model.multi_node:
        return 1
    return max(1, min(MAX_DERIVED_API_WORKERS, math.floor(cores) - 1))


# vLLM's multi-node rendezvous (its torch.distributed master on the leader; vLLM's default
# port). LWS injects the leader's address and each pod's index into every container's env.
ENGINE_MASTER_PORT = 29501
LEADER_RANK = "0"
WORKER_RANK = "$(LWS_WORKER_INDEX)"


def _engine_args(model: StreamingModel, node_rank: str) -> list[str]:
    """The vLLM engine's part of the command line, the same on every node of a group (vLLM
    requires it), with this node's rank."""
    e, p = model.spec.engine, model.spec.parallelism
    args = ["--tensor-parallel-size", str(p.tensor), "--pipeline-parallel-size", str(p.pipeline)]
    if model.multi_node:
        args += ["--nnodes", str(p.nodes), "--node-rank", node_rank]
        args += ["--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(ENGINE_MASTER_PORT)]
    args += ["--gpu-memory-utilization", fmt_number(e.gpu_memory_utilization)]
    for flag, value in (
        ("--max-model-len", e.max_model_len),
        ("--max-num-seqs", e.max_num_seqs),
        ("--max-num-batched-tokens", e.max_num_batched_tokens),
        ("--swap-space", e.swap_space_gib),
    ):
        if value is not None:
            args += [flag, fmt_number(value)]
    args += ["--dtype", e.dtype]
    if e.quantization:
        args += ["--quantization", e.quantization]
    return args + lora_args(model)


def worker_args(model: StreamingModel) -> list[str]:
    """A multi-node group's worker: the same model and engine arguments as the leader with
    the worker's rank, so the server runs vLLM's headless workers only (no HTTP API)."""
    src = model.source
    args = ["--model", src.model_arg]
    if src.revision:
        args += ["--revision", src.revision]
    args += ["--served-model-name", model.served_name, "--engine", "vllm"]
    args += _engine_args(model, WORKER_RANK)
    if model.spec.engine.extra_args:
        args += ["--", *model.spec.engine.extra_args]
    return args


def server_args(model: StreamingModel) -> list[str]:
    spec, src = model.spec, model.source
    if serves_cached(model):  # the commit's folder on the weights claim; served as org/name
        args = ["--model", WEIGHTS_DIR]
    else:
        args = ["--model", src.model_arg]
        if src.revision:
            args += ["--revision", src.revision]
    args += ["--served-model-name", model.served_name, "--host", "0.0.0.0", "--port", str(PORT)]
    args += ["--engine", spec.engine.backend]
    workers = api_workers(model)
    if workers > 1:
        args += ["--api-workers", str(workers)]

    if not model.simulated:
        args += _engine_args(model, LEADER_RANK)

    s = spec.streaming
    args += ["--protocols", ",".join(sorted(s.protocols))]
    args += ["--heartbeat-seconds", str(s.heartbeat_seconds)]
    args += ["--max-concurrent-streams", str(s.max_concurrent_streams)]
    args += ["--stream-timeout-seconds", str(s.stream_timeout_seconds)]
    args += ["--drain-timeout-seconds", str(drain_seconds(model))]
    args += ["--max-body-bytes", str(spec.max_request_bytes)]
    if s.cors.allowed_origins:
        args += ["--cors-allowed-origins", ",".join(s.cors.allowed_origins)]
        if s.cors.allowed_headers is not None:
            args += ["--cors-allowed-headers", ",".join(s.cors.allowed_headers)]
        args += ["--cors-max-age-seconds", str(s.cors.max_age_seconds)]
    if not s.playground:
        args += ["--playground", "false"]
    if root_path(model):
        # The route passes the prefix on unchanged (no rewrites): the server knows
        # it is published there, answers under it and builds its links with it.
        args += ["--root-path", root_path(model)]
    if s.resume.grace_seconds:
        args += ["--resume-grace-seconds", str(s.resume.grace_seconds)]

    q = spec.server.queue
    if q is not None:
        args += ["--queue-size", str(q.size), "--queue-timeout-seconds", str(q.timeout_seconds)]
        if q.priorities:  # the server then runs vLLM with --scheduling-policy priority
            args += ["--priority-classes", ",".join(q.priorities)]
        if q.default_priority:
            args += ["--default-priority", q.default_priority]
        if q.tenant_weights:
            args += [
                "--tenant-weights",
                ",".join(f"{t}={w}" for t, w in sorted(q.tenant_weights.items())),
            ]
        if not q.slot_sharing:
            args += ["--queue-slot-sharing", "false"]
        args += ["--fair-share-window-seconds", str(q.fair_share_window_seconds)]

    auth = spec.auth
    if auth.api_key_secret_ref:
        args += ["--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}"]
    if auth.jwt:
        args += [
            "--jwt-jwks-file",
            f"{JWKS_DIR}/{JWKS_FILE}",
            "--jwt-issuer",
            auth.jwt.issuer,
            "--jwt-audience",
            auth.jwt.audience,
            "--jwt-tenant-claim",
            auth.jwt.tenant_claim,
        ]
        if q is not None and q.priorities:  # the server reads the claim with classes only
            args += ["--jwt-priority-claim", auth.jwt.priority_claim]
    if auth.share_prefix_cache_across_tenants:  # the default (off) renders nothing
        args += ["--share-prefix-cache-across-tenants", "true"]
    if model.routed:  # the router hashes prompts as this engine does (protocols/prefix_cache)
        args += ["--describe-prefix-cache", "true"]
    args += continuation_args(model)  # the router continues streams here (docs/migration.md)
    args += disaggregation_args(model)  # a pool of a disaggregated model (its connector)
    limit = auth.rate_limit
    if limit.requests_per_minute:
        args += ["--rate-limit-rpm", str(limit.requests_per_minute)]
    if limit.tokens_per_minute:
        args += ["--rate-limit-tpm", str(limit.tokens_per_minute)]
    if limit.backend == "redis":  # the URL comes from the Secret (builders/secrets.py)
        args += ["--rate-limit-backend", "redis", "--rate-limit-failure-mode", limit.failure_mode]
        args += secret_args(model)

    tracing = spec.observability.tracing
    if tracing.endpoint:
        args += ["--otlp-traces-endpoint", tracing.endpoint]
        args += ["--trace-sample-ratio", fmt_number(tracing.sample_ratio)]

    if model.simulated:
        sim = spec.engine.simulator or SimulatorSpec()
        args += ["--sim-ttft-ms", fmt_number(sim.ttft_ms), "--sim-itl-ms", fmt_number(sim.itl_ms)]
        args += [
            "--sim-ttft-per-stream-ms",
            fmt_number(sim.ttft_per_stream_ms),
            "--sim-jitter",
            fmt_number(sim.jitter),
        ]
    else:  # after `--`: vLLM's own; the router's events first, the user's flags win
        engine = [*kv_event_args(model), *spec.engine.extra_args]
        if engine:
            args += ["--", *engine]
    return args
