"""One typed settings model for the server: CLI flags win over `SLUICE_*` environment.

The flag names are a contract with the operator (docs/design.md); keep them stable.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .names import TENANT, check_priority_classes, check_weight, valid_tenant

Protocol = Literal["sse", "websocket", "responses", "anthropic"]
ALL_PROTOCOLS: tuple[Protocol, ...] = ("sse", "websocket", "responses", "anthropic")


class HttpSettings(BaseSettings):
    """The flags every Sluice process that serves HTTP has, the server's and the router's:
    where it listens, idle keep-alive, stalled readers, log level. Each subclass gives its own
    environment prefix; these fields come first in its flag table."""

    host: str = Field("0.0.0.0", description="Listen address.")
    port: int = Field(8000, ge=0, le=65535, description="Listen port.")
    keep_alive_seconds: float = Field(
        75.0,
        gt=0,
        description="Idle HTTP keep-alive. Keep it above the proxy's upstream "
        "keep-alive (ingress-nginx: 60 s), or the proxy can reuse a connection the server is "
        "closing and answer a POST with 502.",
    )
    send_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="A client that accepts no bytes for this long while bytes "
        "wait for it (a stalled reader) is cut off and its request aborted; a reader that "
        "keeps accepting bytes, however slowly, never is.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )


class Settings(HttpSettings):
    """Every field is a flag (`--max-model-len`) and an environment variable
    (`SLUICE_MAX_MODEL_LEN`); flags win. The descriptions are the documentation: `--help`
    and the flag table in server/README.md are generated from them."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="forbid")

    # What to serve
    model: str = Field(
        description="HF repo id, local path, or `tiny` (a tiny random Llama "
        "made locally, for CPU tests and the demo)."
    )
    revision: str | None = Field(None, description="HF revision (branch, tag or commit).")
    served_model_name: str | None = Field(
        None,
        description="The name clients send as `model`; also the `model` metric label "
        "(default: `--model`).",
    )
    engine: Literal["vllm", "simulator"] = Field(
        "vllm",
        description="`vllm`, or `simulator` (no model: deterministic tokens on a "
        "configurable clock, for load tests and rehearsals).",
    )

    # Where
    api_workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Front-end processes sharing the listening port and one "
        "engine (vLLM's multi-API-server mode: one engine core, N API processes). Each runs "
        "the whole app; stream slots, rate limits, `/metrics` and `/ready` stay the pod's. "
        "1: one process, as without the flag. On Kubernetes the operator derives it from "
        "the pod's CPU request (`spec.server.apiWorkers`).",
    )

    # vLLM engine (None = vLLM's own default)
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism (GPUs).")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline parallelism.")
    nnodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Nodes the engine spans (vLLM's multiprocessing "
        "multi-node backend); tensor x pipeline parallel size is split evenly over them. "
        "Above 1 needs `--engine vllm`, `--master-addr` and `--api-workers 1`. On "
        "Kubernetes `spec.parallelism.nodes` sets it (a LeaderWorkerSet group).",
    )
    node_rank: int = Field(
        0,
        ge=0,
        description="This node's rank, 0 to `--nnodes` - 1. 0: the leader, which "
        "serves the API with the engine's rank-0 node; above 0: a worker, which runs only "
        "vLLM's headless workers for the leader's engine (no HTTP port).",
    )
    master_addr: str | None = Field(
        None,
        description="With `--nnodes` above 1: the leader's address (host name or IP), "
        "where vLLM's torch.distributed rendezvous listens; the same on every node.",
    )
    master_port: int = Field(
        29501,
        ge=1,
        le=65535,
        description="With `--nnodes` above 1: the port of that rendezvous on the leader.",
    )
    gpu_memory_utilization: float = Field(
        0.92, gt=0, le=1, description="vLLM: share of GPU memory for weights and KV cache."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM: context length (default: the model's)."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM: sequences per batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM: tokens per scheduler step."
    )
    swap_space: float | None = Field(
        None,
        ge=0,
        description="GiB of CPU memory for KV cache; vLLM 0.32 has no "
        "`--swap-space`, so this maps to `--kv-offloading-size`.",
    )
    dtype: str = Field("auto", description="vLLM: weight and activation dtype.")
    quantization: str | None = Field(None, description="vLLM: quantization method.")
    # Everything after `--` on the command line, handed to vLLM's argument parser unchanged.
    engine_args: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Everything after `--`: vLLM's own engine "
        "arguments, unchanged (they win over what the flags above derive).",
    )

    # LoRA adapters
    adapters_file: Path | None = Field(
        None,
        description="JSON file listing the LoRA adapters to serve next to the base, "
        '`{"adapters": [{"name", "uri", "rank"?, "id"?}]}` (`uri`: a local folder or '
        "`hf://org/name[@revision]`); watched, and adapters are loaded and unloaded in the "
        "running engine when it changes (on Kubernetes: the `<name>-adapters` ConfigMap). "
        "Turns LoRA on.",
    )
    adapters_reload_seconds: float = Field(
        2.0,
        gt=0,
        description="How often `--adapters-file` is checked for changes (one `stat`).",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM: adapters in one batch (`--max-loras`); turns LoRA on. "
        "Fixed at engine start.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="vLLM: largest adapter rank (`--max-lora-rank`). Fixed at engine start.",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM: adapters kept in CPU memory (`--max-cpu-loras`). Fixed at engine start.",
    )

    # Streaming behaviour
    protocols: Annotated[list[Protocol], NoDecode] = Field(
        default_factory=lambda: list(ALL_PROTOCOLS),
        description="Served protocols, comma-separated: `sse` covers the OpenAI chat, "
        "completions and models routes, `/v1/stream`, `/tokenize`, `/detokenize` and "
        "`/version`; `websocket` `/ws/stream`; `responses` OpenAI's `/v1/responses`; "
        "`anthropic` `/v1/messages` and `/v1/messages/count_tokens`. The others answer 404 "
        "with a message naming this flag.",
    )
    heartbeat_seconds: float = Field(
        15.0,
        gt=0,
        description="Longest silence on a stream: an SSE comment (`: ping`) "
        "goes to a stream that sent nothing for that long (one app-wide timer; none while "
        "tokens flow), and the WebSocket ping interval.",
    )
    max_concurrent_streams: int = Field(
        256,
        ge=1,
        description="Streams per pod (shared by every `--api-workers` process); "
        "over it: 429 + `Retry-After: 1` at once, or with `--queue-size` a wait in the queue.",
    )
    stream_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="Whole-stream limit; then an error event, and the engine request is aborted.",
    )
    stream_buffer_tokens: int = Field(
        4096,
        ge=1,
        description="Per-stream cap of undelivered engine outputs; past it the "
        "request is aborted with an error event (stalled reader).",
    )
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Request body and WebSocket frame limit (413; 1009 on a WebSocket).",
    )
    drain_timeout_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how long in-flight streams may continue before "
        "they end with an error event.",
    )
    handover_seconds: float = Field(
        5.0,
        ge=0,
        description="On SIGTERM, with --continuation-key-file: after this long, the streams "
        "the router relays are handed to it, which continues them on another replica "
        "(docs/migration.md); only the others keep the pod up to --drain-timeout-seconds.",
    )

    # Admission queue, priorities and fair shares (server/README.md, "Sharing a model")
    queue_size: int = Field(
        0,
        ge=0,
        le=100000,
        description="Requests per pod that may wait for a stream slot "
        "when every slot is taken (shared by every `--api-workers` process), served by "
        "priority, then by tenant weight. Past it: 429 with a `Retry-After` from the "
        "queue's measured drain rate, at once (the lowest priority is shed first). 0: no "
        "queue, a full pod answers 429 at once.",
    )
    queue_timeout_seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Longest wait in the queue (default 30 with "
        "`--queue-size`); then 429 + `Retry-After`, or, for a stream already committed to "
        "200 by keep-alives (after `--heartbeat-seconds` of waiting), its protocol's error "
        "event with code `queue_timeout`. Needs `--queue-size`.",
    )
    queue_slot_sharing: bool = Field(
        True,
        description="With a queue: a tenant takes more than its weighted share of the "
        "slots only while slots stay free for every other active tenant (queued, streaming "
        "or seen within `--fair-share-window-seconds`) below its share: as many as it held "
        "at once lately, at least one, at most a quarter of the slots in all; free slots are "
        "lent when nobody else needs them. `false`: every free slot goes to the next request "
        "in the queue's order.",
    )
    fair_share_window_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a tenant counts as active after its last "
        "request, for the slot shares (`--queue-slot-sharing`).",
    )
    priority_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Priority classes, highest first, comma-separated "
        "(`interactive,batch`). A caller's class comes from its key line (`priority=`) or "
        "its JWT (`--jwt-priority-claim`), else `--default-priority`. The queue serves "
        "higher classes first and sheds lower ones first, and vLLM runs with "
        "`--scheduling-policy priority` and each request's class as its priority. Fixed "
        "for the process (the engine's policy is); key files reload, classes do not.",
    )
    default_priority: str | None = Field(
        None,
        description="The class of a caller that names none (default: the lowest of "
        "`--priority-classes`).",
    )
    tenant_weights: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="Tenants' weights, `acme=3,free=1` (1-1000; "
        "unnamed tenants: 1, or the key file's `weight=`): a tenant's share of the pod "
        "against the other active tenants', in generated tokens and in slots.",
    )

    # Browsers
    cors_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Origins (`https://app.example.com`, or `*`) whose "
        "pages may call every route cross-origin, comma-separated; WebSocket upgrades from "
        "any other origin get 403. Empty: CORS off (same origin only).",
    )
    cors_allowed_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-API-Key", "Last-Event-ID"],
        description="Request headers a cross-origin page may send, comma-separated.",
    )
    cors_max_age_seconds: int = Field(
        600, ge=0, description="How long browsers may cache a CORS preflight answer."
    )
    playground: bool = Field(
        True,
        description="Serve the browser playground at "
        "`/playground` (one self-contained page; `false`: 404).",
    )
    root_path: str = Field(
        "",
        description="Path prefix the Ingress publishes the server under (`/mistral`): "
        "routes answer both with and without it, and links the server makes include it.",
    )
    resume_grace_seconds: float = Field(
        0.0,
        ge=0,
        le=600,
        description="How long a token-SSE stream whose client dropped "
        "keeps generating into its buffer, waiting for a reconnect with `Last-Event-ID` "
        "(same process only). 0: its request is aborted at once.",
    )

    # Security
    api_key_file: Path | None = Field(
        None,
        description="File with one API key per line (`#` comments and blank lines "
        "ignored), each optionally followed by `tenant=NAME rpm=N tpm=N models=A,B` (that "
        "key's tenant, limits and the served names it may use; the defaults are tenant "
        "`default`, the `--rate-limit-*` flags and every name); auth is off when unset.",
    )
    jwt_jwks_file: Path | None = Field(
        None,
        description='JWKS file (JSON `{"keys": [...]}`, public RSA or EC P-256 keys) '
        "that Bearer JWTs are verified against: RS256/ES256 only; `exp`, `iss`, `aud` and `sub` "
        "required, `nbf` honoured. JWTs are off when unset; with `--api-key-file` too, both "
        "are accepted.",
    )
    jwt_issuer: str | None = Field(
        None, description="The `iss` every JWT must carry (required with `--jwt-jwks-file`)."
    )
    jwt_audience: str | None = Field(
        None, description="The `aud` every JWT must carry (required with `--jwt-jwks-file`)."
    )
    jwt_tenant_claim: str = Field(
        "tenant",
        description="The JWT claim that names the tenant (absent: `default`). The "
        "claims `rpm` and `tpm` give the token's limits (absent: the `--rate-limit-*` flags); "
        "limits apply per subject (`iss` + `sub`).",
    )
    jwt_priority_claim: str = Field(
        "priority",
        description="The JWT claim that names the caller's priority class (with "
        "`--priority-classes`; absent: `--default-priority`; not a class: 401).",
    )
    share_prefix_cache_across_tenants: bool = Field(
        False,
        description="Let tenants reuse each other's cached prompt prefixes. Off: "
        "vLLM's `cache_salt` is set from the caller's tenant (combined with a client's own "
        "`cache_salt`), so no tenant can tell from its time to first token what another "
        "sent. On: for tenants that trust each other (a client's own `cache_salt` still "
        "applies). Without auth every caller is one tenant and nothing is salted.",
    )
    describe_prefix_cache: bool = Field(
        False,
        description="Serve `GET /internal/prefix-cache`: the engine's block size, hash "
        "algorithm and seed, adapter paths and tokenizer files, which the Sluice router "
        "reads to hash prompts as this engine does. Off: 404. The operator turns it on for "
        "models the router places (`spec.routing.router.enabled`).",
    )
    continuation_key_file: Path | None = Field(
        None,
        description="File holding the key (its first line) the Sluice router presents "
        "in `X-Sluice-Continuation-Key` to `POST /internal/continue`, which continues on this "
        "replica a stream another replica started (docs/migration.md). Unset: 404. Read at "
        "each continuation, so a rotated Secret applies at once.",
    )
    kv_transfer_config: str | None = Field(
        None,
        description="Disaggregated serving: vLLM's `--kv-transfer-config` JSON (a "
        '`KVTransferConfig`, e.g. `{"kv_connector": "NixlConnector", "kv_role": "kv_both"}`), '
        "passed to the engine; checked with vLLM's own config class at start (the simulator "
        "reads `engine_id`, `kv_ip` and `kv_port` from it for the params it returns). "
        "Also turns on the prompt token details in usage (the cached prompt tokens).",
    )
    disaggregation_role: Literal["prefill", "decode"] | None = Field(
        None,
        description="This pod's pool in a disaggregated model (docs/disaggregation.md): "
        "`prefill` serves `POST /internal/prefill`, `decode` accepts the router's "
        "`X-Sluice-KV-Transfer` header; both need --continuation-key-file (the router's key "
        "authenticates those calls). The `role` label of `sluice_kv_transfer_tokens_total`. "
        "Unset: a pod that serves whole requests.",
    )
    credentials_reload_seconds: float = Field(
        2.0,
        ge=0,
        description="How often the key file and the JWKS file are checked for "
        "changes (one `stat` each); a changed file is reloaded without a restart, a bad one "
        "is refused and the credentials before it stay. 0: read once at start.",
    )
    rate_limit_rpm: int = Field(
        0,
        ge=0,
        description="Requests per minute per API key "
        "(token bucket; 0: off), unless the key file gives the key "
        "its own.",
    )
    rate_limit_tpm: int = Field(
        0,
        ge=0,
        description="Prompt + completion tokens per "
        "minute per API key (charged when a stream ends; 0: off), "
        "unless the key file gives the key its own.",
    )
    rate_limit_backend: Literal["memory", "redis"] = Field(
        "memory",
        description="Where the buckets live: `memory` (each replica limits on its "
        "own, so N replicas allow N times the limit) or `redis` (one set of buckets for every "
        "replica; needs `--redis-url-file` or `--redis-url`).",
    )
    redis_url: SecretStr | None = Field(
        None,
        description="Redis for `--rate-limit-backend redis`, e.g. "
        "`redis://:password@redis:6379/0` or `rediss://...` (TLS). It may hold a password: "
        "prefer `--redis-url-file`; never pass it as a flag.",
    )
    redis_url_file: Path | None = Field(
        None,
        description="File holding the Redis URL (surrounding whitespace ignored), read "
        "at start; instead of `--redis-url`. On Kubernetes the operator mounts "
        "`spec.auth.rateLimit.redisUrlSecretRef` there. A missing or empty file stops the "
        "server at start.",
    )
    rate_limit_failure_mode: Literal["open", "closed"] = Field(
        "open",
        description="When Redis cannot be reached: `open` admits (counted in "
        "`sluice_rate_limit_backend_errors_total`, logged at most every 30 s), `closed` refuses "
        "with 503 and `Retry-After`. Redis is retried a second after a failure.",
    )
    redis_timeout_seconds: float = Field(
        0.25,
        gt=0,
        le=10,
        description="Redis connect and read timeout: the most a request "
        "waits on the rate-limit store before the failure mode applies.",
    )

    # Simulator engine timing
    sim_ttft_ms: float = Field(50.0, ge=0, description="Simulator: time to first token.")
    sim_itl_ms: float = Field(20.0, ge=0, description="Simulator: time between tokens.")
    sim_ttft_per_stream_ms: float = Field(
        0.0, ge=0, description="Simulator: extra TTFT per stream already in flight (queueing)."
    )
    sim_jitter: float = Field(
        0.0, ge=0, description="Simulator: relative standard deviation of every TTFT and gap."
    )
    sim_prefix_cache_blocks: int = Field(
        0,
        ge=0,
        description="Simulator: prefix-cache capacity in blocks (an LRU keyed by vLLM's "
        "block hashes; 0: no cache, no cached tokens).",
    )
    sim_block_size: int = Field(
        16, ge=1, description="Simulator: tokens per cache block (vLLM's `--block-size`)."
    )
    sim_prefill_us_per_token: float = Field(
        0.0,
        ge=0,
        description="Simulator: extra TTFT per prompt token not served from the "
        "prefix cache, in microseconds.",
    )
    sim_kv_transfer_us_per_block: float = Field(
        80.0,
        ge=0,
        description="Simulator, disaggregated (--kv-transfer-config): TTFT per KV-cache "
        "block a decode request receives from its prefill, in microseconds, instead of "
        "computing those tokens (80: one 16-token block of an 8B model, 2 MiB, at 25 GB/s).",
    )
    sim_prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "sha256",
        description="Simulator: the block hash (vLLM's "
        "`--prefix-caching-hash-algo`; its seed is PYTHONHASHSEED as in vLLM).",
    )
    sim_kv_events_config: str | None = Field(
        None,
        description="Simulator: publish the prefix cache's KV events, in vLLM's "
        '`--kv-events-config` JSON (`{"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ...}`; an endpoint '
        "with `*` binds, as in vLLM). Needs --sim-prefix-cache-blocks. The events carry prompt "
        "token ids in clear and the port takes no credentials: let only the router reach it.",
    )

    # Observability
    access_log: bool = Field(
        True,
        description="One line per request when it ends (logger `sluice_server.access`): "
        "request id, key id (never the key), model, protocol, status, TTFT, tokens, outcome, "
        "duration. Probes are not logged; query strings never are.",
    )
    access_log_format: Literal["text", "json"] = Field(
        "text",
        description="Access log lines as `key=value` text or as one JSON object per line.",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (e.g. `http://collector:4318/v1/traces`): "
        "one span per request, joining the caller's W3C `traceparent`; also passed to vLLM. "
        "Tracing is off when unset.",
    )
    trace_sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of new traces sampled (a sampled caller's "
        "`traceparent` is always followed).",
    )

    @field_validator("protocols", mode="before")
    @classmethod
    def _split_protocols(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _split_weights(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        weights: dict[str, str] = {}
        for item in (p.strip() for p in value.split(",")):
            if not item:
                continue
            tenant, sep, weight = item.partition("=")
            if not sep or tenant in weights:
                raise ValueError("give each tenant once, as TENANT=WEIGHT")
            weights[tenant] = weight
        return weights

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, weight in value.items():
            if not valid_tenant(tenant):
                raise ValueError(f"tenant names must match {TENANT.pattern}")
            check_weight(weight)
        return value

    @field_validator("priority_classes")
    @classmethod
    def _classes(cls, value: list[str]) -> list[str]:
        check_priority_classes(value)
        return value

    @field_validator(
        "priority_classes", "cors_allowed_origins", "cors_allowed_headers", mode="before"
    )
    @classmethod
    def _split_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("sim_kv_events_config")
    @classmethod
    def _kv_events_json(cls, value: str | None) -> str | None:
        if value is not None and not isinstance(json.loads(value), dict):
            raise ValueError("--sim-kv-events-config must be a JSON object")
        return value

    @field_validator("kv_transfer_config")
    @classmethod
    def _kv_transfer_json(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("--kv-transfer-config must be a JSON object (vLLM's KVTransferConfig)")
        return value

    @field_validator("root_path")
    @classmethod
    def _root_path(cls, value: str) -> str:
        value = value.rstrip("/")
        if value and (not value.startswith("/") or "//" in value):
            raise ValueError("root_path must be a path such as /mistral")
        return value

    @field_validator("engine_args", mode="before")
    @classmethod
    def _split_engine_args(cls, value: object) -> object:
        if isinstance(value, str):
            import shlex

            return shlex.split(value)
        return value

    @model_validator(mode="after")
    def _complete(self) -> Settings:
        if self.redis_url_file is not None:
            if self.redis_url is not None:
                raise ValueError(
                    "give --redis-url-file or --redis-url (SLUICE_REDIS_URL), not both"
                )
            self.redis_url = SecretStr(
                read_secret_file(self.redis_url_file, "--redis-url-file", "the Redis URL")
            )
        if self.rate_limit_backend == "redis" and self.redis_url is None:
            raise ValueError(
                "--rate-limit-backend redis needs --redis-url-file or --redis-url "
                "(SLUICE_REDIS_URL)"
            )
        check_hf_token_path(os.environ)
        if self.jwt_jwks_file is not None and not (self.jwt_issuer and self.jwt_audience):
            raise ValueError("--jwt-jwks-file needs --jwt-issuer and --jwt-audience")
        if self.queue_timeout_seconds is not None and not self.queue_size:
            raise ValueError(
                "--queue-timeout-seconds needs --queue-size N (N > 0): a queue always has a bound"
            )
        if self.default_priority is not None and not self.priority_classes:
            raise ValueError("--default-priority needs --priority-classes")
        if self.default_priority is not None and self.default_priority not in self.priority_classes:
            raise ValueError(
                f"--default-priority {self.default_priority} is not one of "
                f"--priority-classes ({','.join(self.priority_classes)})"
            )
        self._check_nodes()
        self._check_disaggregation()
        if self.sim_kv_events_config is not None and not self.sim_prefix_cache_blocks:
            raise ValueError("--sim-kv-events-config needs --sim-prefix-cache-blocks N (N > 0)")
        if self.sim_kv_events_config is not None and self.api_workers > 1:
            raise ValueError(
                "--sim-kv-events-config needs --api-workers 1: each worker runs its "
                "own simulator, and they cannot share one events port"
            )
        if self.api_workers > 1 and self.resume_grace_seconds > 0:
            raise ValueError(
                "--resume-grace-seconds needs --api-workers 1: a resumable stream lives in one "
                "process, and a reconnect may reach another worker"
            )
        return self

    def _check_disaggregation(self) -> None:
        """A role needs the router's key, and a real engine its connector (whose settings
        vLLM's own `KVTransferConfig` checks when the engine starts: `vllm_engine`)."""
        role = self.disaggregation_role
        if role is not None and self.continuation_key_file is None:
            raise ValueError(
                f"--disaggregation-role {role} needs --continuation-key-file: the Sluice "
                "router's key authenticates /internal/prefill and X-Sluice-KV-Transfer"
            )
        if role is not None and self.engine == "vllm" and self.kv_transfer_config is None:
            raise ValueError(
                f"--disaggregation-role {role} needs --kv-transfer-config with --engine vllm: "
                "the engine hands the KV cache over through its connector"
            )

    def _check_nodes(self) -> None:
        """Multi-node arguments that vLLM would refuse late (or hang on) are refused here."""
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} must be below --nnodes {self.nnodes} "
                "(ranks are 0 to nnodes - 1; 0 is the leader)"
            )
        if self.nnodes == 1:
            return
        if self.engine != "vllm":
            raise ValueError("--nnodes above 1 needs --engine vllm (the simulator is one process)")
        if not self.master_addr:
            raise ValueError(
                "--nnodes above 1 needs --master-addr: the leader's address, the same on every node"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size x --pipeline-parallel-size ({world}) must split "
                f"evenly over --nnodes {self.nnodes} (the same number of GPUs on every node)"
            )
        if self.api_workers > 1:
            raise ValueError(
                "--api-workers above 1 cannot be combined with --nnodes above 1: a "
                "multi-node leader runs one server process with the engine in it"
            )

    @property
    def headless(self) -> bool:
        """A worker node: no HTTP API, only vLLM's headless workers for the leader's engine."""
        return self.node_rank > 0

    @property
    def lora_enabled(self) -> bool:
        return self.adapters_file is not None or self.max_loras is not None

    @property
    def queue_timeout(self) -> float:
        return self.queue_timeout_seconds if self.queue_timeout_seconds is not None else 30.0

    @property
    def model_label(self) -> str:
        """The name clients send in `model` and metrics carry as a label."""
        return self.served_model_name or self.model


def read_secret_file(path: Path, flag: str, what: str) -> str:
    """The secret a file holds, stripped (a Secret's key often ends in a newline); a
    ValueError that names the flag, the file and what to fix when there is none."""
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(
            f"{flag} {path}: no such file; it must hold {what} (on Kubernetes: "
            "mounted from the Secret key the StreamingModel names)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
    if not value:
        raise ValueError(
            f"{flag} {path} is empty; it must hold {what} (on Kubernetes: the "
            "Secret key the StreamingModel names is empty)"
        )
    return value


def check_hf_token_path(environ: Mapping[str, str]) -> None:
    """`HF_TOKEN_PATH`, when set, names the Hugging Face token file that `huggingface_hub`
    reads in every process (on Kubernetes: `spec.model.hfTokenSecretRef`, mounted). Without
    the file it would download anonymously and fail later on a gated model with an error that
    names no file: refuse at start instead."""
    path = environ.get("HF_TOKEN_PATH")
    if path:
        read_secret_file(Path(path), "HF_TOKEN_PATH", "a Hugging Face token")


class RouterSettings(HttpSettings):
    """The router (`sluice-server router`, also called as `sluice-server activator`): every
    field is a flag and a `SLUICE_ACTIVATOR_*` environment variable (the prefix deployed
    charts set); flags win. Which models it serves, how it holds their requests and where
    their pods are is per model, in `--models-file`."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_ACTIVATOR_", extra="forbid")

    models_file: Path = Field(
        description='JSON file of the models the router serves, `{"<namespace>/<name>": '
        '{"host", "port", "holdTimeoutSeconds", "maxHeld", "keepaliveSeconds", '
        '"pods"}}` (on Kubernetes the operator\'s `<release>-activator-models` ConfigMap); '
        "watched, and reloaded without a restart when it changes. An entry with `pods` "
        '(`{"namespace", "selector", "port", "kvEvents"}`) has its Pods watched and each '
        'request placed on one Ready pod (`kvEvents`, `{"port", "replayPort"}`: where '
        "the pods publish their KV-cache events, followed for the prefix index); one "
        "without is forwarded to its Service `host`. A request "
        "for any other model gets 404.",
    )
    models_reload_seconds: float = Field(
        2.0,
        gt=0,
        description="How often `--models-file` and `--pin-key-file` are checked for changes "
        "(one `stat` each).",
    )
    ready_poll_seconds: float = Field(
        0.5,
        gt=0,
        description="Longest pause between two readiness checks (`GET /ready`) of "
        "a model that has held requests; the first checks come sooner (backoff from a tenth "
        "of it).",
    )
    connect_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Connecting to a model's Service or pod (a readiness check or "
        "a forwarded request), or to the API server.",
    )
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Request body limit (413): a held request's body waits in memory.",
    )
    max_held_frames: int = Field(
        64,
        ge=1,
        description="WebSocket frames a held connection may send before its model "
        "is up (they are relayed then); past it the connection is closed with 1013.",
    )
    heartbeat_seconds: float = Field(15.0, gt=0, description="WebSocket ping interval.")
    drain_timeout_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how much longer held requests wait for their "
        "model (then they give up as at the hold timeout: 503 `model_starting`, or the "
        "stream's error event); forwarded ones get 5 s more to finish. New connections are "
        "refused at once (the Service sends them to the other router pods).",
    )
    kube_api_url: str | None = Field(
        None,
        description="The Kubernetes API server the Pods of models with `pods` are "
        "watched through (default: in-cluster, `https://$KUBERNETES_SERVICE_HOST:"
        "$KUBERNETES_SERVICE_PORT`).",
    )
    service_account_dir: Path = Field(
        Path("/var/run/secrets/kubernetes.io/serviceaccount"),
        description="The ServiceAccount's `token` (re-read as the kubelet rotates it) and "
        "`ca.crt` for the API server.",
    )
    pin_key_file: Path | None = Field(
        None,
        description="Key (a file, at least 32 bytes) that signs the `sluice-pin` cookie "
        "with which a resumed token SSE stream returns to the pod that holds it, through any "
        "router pod sharing the key. Reloaded when it changes (cookies signed with the key "
        "before stay honoured). Without it no cookie is set or honoured.",
    )
    continuation_key_file: Path | None = Field(
        None,
        description="The master key for continuations (docs/migration.md): each model's "
        "key is derived from it. Read when a stream is continued, so a rotated Secret "
        "applies at once. Unset: no stream is continued on another pod.",
    )
    pin_seconds: float = Field(
        3600.0,
        gt=0,
        description="How long a `sluice-pin` cookie is honoured after it is set "
        "(cover the longest resume window of the models served).",
    )
    # Placement among a model's pods (router/placement.py): a weighted sum of scores in
    # [0, 1], under a saturation guard. The defaults are placement.Scoring's.
    prefix_weight: float = Field(
        2.0,
        ge=0,
        description="Placement: weight of the prefix score (the share of the request's "
        "prompt blocks a pod's KV cache holds, from its KV events or from what this router "
        "sent it). 0: placement by load alone.",
    )
    queue_weight: float = Field(
        1.0,
        ge=0,
        description="Placement: weight of the queue score (the pod's waiting requests, "
        "scraped from its /metrics, against the other pods').",
    )
    kv_use_weight: float = Field(
        1.0,
        ge=0,
        description="Placement: weight of the KV-cache score (1 - the pod's scraped KV-cache use).",
    )
    in_flight_weight: float = Field(
        1.0,
        ge=0,
        description="Placement: weight of the in-flight score (this router's requests on "
        "the pod now, against the busiest pod's).",
    )
    saturation_guard: bool = Field(
        True,
        description="Placement: a pod past `--saturation-waiting` or `--saturation-kv-use` "
        "gets no request while another pod is under both, whatever its prefix score.",
    )
    saturation_waiting: int = Field(
        4,
        ge=0,
        description="Placement: waiting requests past which a pod is saturated.",
    )
    saturation_kv_use: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Placement: KV-cache use (0..1) past which a pod is saturated.",
    )
    load_scrape_seconds: float = Field(
        1.0,
        gt=0,
        description="Placement: how often each Ready pod's /metrics is read for its load "
        "(requests waiting, KV-cache use); one read waits at most this long (and at most "
        "`--connect-timeout-seconds`).",
    )
    prefix_hasher_refresh_seconds: float = Field(
        60.0,
        gt=0,
        description="Placement: how often the router reads a model's prefix-cache "
        "description (`GET /internal/prefix-cache`) again from its first Ready pod, for a "
        "change no pod restart announces (an adapter loaded at run time). A pod that turns "
        "Ready, restarts or moves is read at once; the prompt hasher is rebuilt only when "
        "the description changed.",
    )
    prefix_hasher_cache_dir: Path | None = Field(
        None,
        description="Placement: where the tokenizer files the pods serve are kept, one "
        "folder per content hash (up to 64 MiB each). Default: a temporary folder made at "
        "start-up and removed at exit.",
    )
    load_stale_seconds: float = Field(
        3.0,
        gt=0,
        description="Placement: a pod's load reading older than this is not believed (the "
        "pod is scored as loaded as the busiest pod with a fresh one).",
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(name: str, model: type[BaseSettings] = Settings) -> str:
    info = model.model_fields[name]
    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, list | dict):
        return f"`{','.join(value)}`" if value else "none"
    return f"`{value}`"


def flag_table(model: type[BaseSettings] = Settings) -> str:
    """The Markdown flag table of server/README.md (`make docs`)."""
    prefix = model.model_config.get("env_prefix", "")
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        flag = "`-- ARGS...`" if name == "engine_args" else f"`{_flag(name)}`"
        env = "" if name == "engine_args" else f"`{prefix}{name.upper()}`"
        rows.append(f"| {flag} | {env} | {_default(name, model)} | {info.description} |")
    return "\n".join(rows) + "\n"


def build_parser(model: type[BaseSettings] = Settings) -> argparse.ArgumentParser:
    """Flags mirror the Settings fields; unset flags stay absent so the environment applies."""
    if model is Settings:
        prog, about = (
            "sluice-server",
            ("Streaming LLM server. Arguments after `--` go to vLLM's engine parser."),
        )
    else:
        prog, about = (
            "sluice-server router",
            "Sends each request for a listed model to one of its Ready pods (or its Service), "
            "holding it while none is ready.",
        )
    parser = argparse.ArgumentParser(
        prog=prog, description=about, argument_default=argparse.SUPPRESS
    )
    for name, info in model.model_fields.items():
        if name == "engine_args":
            continue
        parser.add_argument(
            _flag(name),
            dest=name,
            metavar=name.upper(),
            help=f"{info.description} [default: {_default(name, model)}]",
        )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    given = vars(build_parser().parse_args(argv))
    if engine_args is not None:
        given["engine_args"] = engine_args
    # Init values win over env in pydantic-settings; pydantic converts the strings.
    return Settings(**given)


def parse_router_settings(argv: Sequence[str]) -> RouterSettings:
    """`sluice-server router ARGS` (or `activator ARGS`): the arguments after the mode."""
    return RouterSettings(**vars(build_parser(RouterSettings).parse_args(list(argv))))
