"""StreamingModel spec: every field typed, described (for `kubectl explain`) and defaulted.

The CRD in crds/ is generated from these classes (`python -m sluice_operator crds --write`),
and the operator validates every object with them again before it renders anything, so a
cluster without CEL support or an object written before a rule existed still gets a clear
`SpecValid=False` instead of a broken Deployment. Each class's `RULES` are both: the CEL rule
in the CRD and the operator's check, with one message (`base.Rule`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from .base import ApiModel, FreeForm, Quantity, Rule, sub
from .flags import RESERVED_RE, positional_arg, reserved_flag

# Object names (Secrets, PVCs, ...): DNS-1123 subdomain.
Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
]
Label = Annotated[str, StringConstraints(max_length=63)]
Arg = Annotated[str, StringConstraints(max_length=512)]  # bounded: CEL cost estimation needs it

# hf://org/name[@revision] | pvc://claim[/path] | /absolute/path/in/image | tiny (the server's
# built-in CPU test model). RE2 (CEL) and Python `re` agree on this pattern; it has no
# backslashes because it is embedded in a CEL string literal ([!-~] = printable, no space).
MODEL_URI_PATTERN = (
    r"^(hf://([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[!-~]*)?"
    r"|/[!-~]*"
    r"|tiny)$"
)

# nginx's size syntax (client_max_body_size): bytes, or k/m/g (binary multiples).
NGINX_SIZE_PATTERN = r"^[0-9]{1,10}[kKmMgG]?$"


def nginx_size_bytes(size: str) -> int:
    factor = {"k": 2**10, "m": 2**20, "g": 2**30}.get(size[-1].lower(), 1)
    return int(size.rstrip("kKmMgG")) * factor


class SecretKeyRef(ApiModel):
    """A key in a Secret in the StreamingModel's namespace."""

    name: Name = Field(description="Name of the Secret (same namespace as the StreamingModel).")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="token", description="Key inside the Secret."
    )


class ApiKeySecretRef(SecretKeyRef):
    """A Secret key holding API keys, one per line."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="keys", description="Key inside the Secret; its value is one API key per line."
    )


class JwksKeyRef(ApiModel):
    """A key in a Secret or ConfigMap in the StreamingModel's namespace."""

    name: Name = Field(description="Name of the Secret or ConfigMap (same namespace).")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="jwks.json", description="Key inside it; its value is the JWKS (JSON)."
    )


class ModelCache(ApiModel):
    """Where downloaded weights are kept (mounted at /cache, HF_HOME=/cache/hf)."""

    pvc_name: Name | None = Field(
        default=None,
        description="Existing PersistentVolumeClaim to keep downloads across restarts. "
        "Unset: an emptyDir of sizeLimit (weights are downloaded again on every pod start).",
    )
    size_limit: Quantity = Field(
        default="100Gi", description="Size limit of the emptyDir cache when pvcName is unset."
    )


class ModelSpec(ApiModel):
    """Which model to serve and where its weights come from."""

    RULES = (
        Rule(
            f"self.uri.matches('{MODEL_URI_PATTERN}')",
            "model.uri: use hf://org/name (optionally @revision), pvc://claim/path/in/claim, "
            "an absolute path inside the image, or tiny",
            holds=lambda m: re.match(MODEL_URI_PATTERN, m.uri) is not None,
            field=".uri",
            detail=lambda m: f"got {m.uri!r}",
        ),
    )

    uri: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        description="Model location: hf://org/name or hf://org/name@revision (Hugging Face Hub), "
        "pvc://claim/path (weights on a PersistentVolumeClaim, mounted read-only), "
        "an absolute path inside the image, or tiny (a tiny random model, CPU tests only)."
    )
    served_name: Annotated[str, StringConstraints(min_length=1, max_length=253)] | None = Field(
        default=None,
        description="Name clients put in the OpenAI `model` field. Default: org/name for hf:// "
        "models, otherwise the StreamingModel's name.",
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token for gated or private models. "
        "Mounted into the pod as a file named by HF_TOKEN_PATH, never in the environment or "
        "the arguments.",
    )
    cache: ModelCache = sub(ModelCache, "Cache volume for downloaded weights.")


# -- LoRA adapters: fine-tunes served by name on the base model's engine ---------------------
# Their rules (`Rule` records) are grouped here: ADAPTER_RULES (on StreamingModelSpec, which
# sees the base model, the engine limits and the list), LoraSpec's and AdapterSpec's own.

# hf://org/name[@revision] | pvc://claim/path | /absolute/path: where an adapter's folder is
# (adapter_config.json + adapter_model.safetensors). Not `tiny` (that names a base model).
ADAPTER_URI_PATTERN = (
    r"^(hf://([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[!-~]*)?"
    r"|/[!-~]*)$"
)
ADAPTER_URI_HELP = (
    "use hf://org/name (optionally @revision), pvc://claim/path/in/claim or an absolute path "
    "inside the image"
)
# A served name: what clients put in `model`, also a metric label and a key-file value.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/:-]*[A-Za-z0-9])?$"
MAX_ADAPTERS = 32
# vLLM 0.32's --max-lora-rank choices (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK: LoraRank = 16
ENGINE_START = (
    "Fixed when the engine starts: changing it replaces the pods (a rolling update; the "
    "status says so)."
)

LORA_CPU_BELOW_GPU = (
    "engine.lora.maxCpuLoras must be at least engine.lora.maxLoras (vLLM keeps every adapter "
    "of a batch in its CPU cache too)"
)
ADAPTER_NAMES_REPEAT = "adapters: every adapter needs its own name (a name appears twice)"
ADAPTER_NAME_IS_BASE = (
    "adapters: an adapter cannot take the base model's served name (model.servedName, or "
    "org/name of an hf:// model): clients could not tell them apart"
)
ADAPTER_RANK_OVER_MAX = (
    "adapters: an adapter's rank exceeds engine.lora.maxLoraRank (default 16): raise "
    "maxLoraRank (this rolls the pods) or use a smaller adapter"
)
ADAPTERS_ON_SIMULATOR = (
    "adapters and engine.lora need engine.backend vllm (the simulator serves no adapters)"
)


class LoraSpec(ApiModel):
    """vLLM's LoRA limits (--enable-lora and its sizes). Set it, even to {}, to start the
    engine with LoRA on before the first adapter, so that adding one does not roll the pods."""

    RULES = (
        Rule(
            "!has(self.maxCpuLoras) || self.maxCpuLoras >= "
            f"(has(self.maxLoras) ? self.maxLoras : {DEFAULT_MAX_LORAS})",
            LORA_CPU_BELOW_GPU,
            holds=lambda lora: lora.max_cpu_loras is None or lora.max_cpu_loras >= lora.max_loras,
            field=".maxCpuLoras",
            detail=lambda lora: f"maxCpuLoras {lora.max_cpu_loras} < maxLoras {lora.max_loras}",
        ),
    )

    max_loras: int = Field(
        default=DEFAULT_MAX_LORAS,
        ge=1,
        le=256,
        description="Adapters one engine batch can use at once (vLLM --max-loras); requests "
        "for further adapters wait for a slot. Each slot reserves GPU memory for "
        "maxLoraRank-sized weights. " + ENGINE_START,
    )
    max_lora_rank: LoraRank = Field(
        default=DEFAULT_MAX_LORA_RANK,
        description="Largest adapter rank the engine accepts (vLLM --max-lora-rank: 1, 8, 16, "
        "32, 64, 128, 256, 320 or 512). " + ENGINE_START,
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Adapters kept loaded in CPU memory (vLLM --max-cpu-loras, at least "
        "maxLoras); others are read from the pod's cache volume again when asked for. "
        "Unset: maxLoras. " + ENGINE_START,
    )


class AdapterSpec(ApiModel):
    """A LoRA adapter (fine-tune) of the base model, served under its own name."""

    RULES = (
        Rule(
            f"self.uri.matches('{ADAPTER_URI_PATTERN}')",
            f"adapters[].uri: {ADAPTER_URI_HELP}",
            holds=lambda a: re.match(ADAPTER_URI_PATTERN, a.uri) is not None,
            field=".uri",
            detail=lambda a: f"got {a.uri!r}: not an adapter location",
        ),
    )

    name: Annotated[
        str, StringConstraints(min_length=1, max_length=128, pattern=ADAPTER_NAME_PATTERN)
    ] = Field(
        description="The served name: clients put it in `model` (OpenAI, Anthropic, token "
        "SSE, WebSocket frames), /v1/models lists it with the base as `parent`, metrics and "
        "the access log carry it. Letters, digits and . _ / : - ; not the base's served name."
    )
    uri: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        description="The adapter folder (adapter_config.json and adapter_model.safetensors, "
        "as PEFT saves them): hf://org/name or hf://org/name@revision (downloaded once per "
        "pod into the cache volume, with model.hfTokenSecretRef), pvc://claim/path (the "
        "claim is mounted read-only; a claim no other adapter or the base uses adds a "
        "volume, which rolls the pods), or an absolute path inside the image."
    )
    rank: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description="The adapter's rank (`r` in its adapter_config.json), when known: checked "
        "against engine.lora.maxLoraRank before any pod tries it. Unset: the engine checks "
        "it on loading (a larger rank is reported as Failed in the status).",
    )


class Toleration(ApiModel):
    """A Kubernetes toleration (same fields as in a Pod spec)."""

    key: str | None = Field(
        default=None, description="Taint key to tolerate; empty matches all keys."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value to match (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


class ComputeResources(ApiModel):
    """CPU and memory for the server container."""

    cpu: Quantity | None = Field(default=None, description="CPU, e.g. 4 or 500m.")
    memory: Quantity | None = Field(default=None, description="Memory, e.g. 32Gi.")


class ResourcesSpec(ApiModel):
    """GPUs, CPU, memory and placement of each pod (a replica's pod, or with
    parallelism.nodes > 1 each pod of its group)."""

    gpus: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per pod: per replica, or with parallelism.nodes > 1 per node of the "
        "replica's group. parallelism.tensor x parallelism.pipeline must equal gpus x "
        "parallelism.nodes. Not requested when engine.backend is simulator.",
    )
    gpu_resource_name: Annotated[
        str,
        StringConstraints(
            max_length=253,
            pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
        ),
    ] = Field(
        default="nvidia.com/gpu",
        description="Extended resource name of the GPU (e.g. nvidia.com/gpu, amd.com/gpu).",
    )
    requests: ComputeResources = Field(
        default_factory=lambda: ComputeResources(cpu="4", memory="32Gi"),
        description="CPU/memory requests of the server container (of each pod of a group).",
        json_schema_extra={"default": {"cpu": "4", "memory": "32Gi"}},
    )
    limits: ComputeResources = Field(
        default_factory=lambda: ComputeResources(memory="64Gi"),
        description="CPU/memory limits of the server container (no CPU limit by default: throttling hurts token latency; vLLM's engine-core process busy-polls a whole core while it generates, so keep any CPU limit at 2 or more).",
        json_schema_extra={"default": {"memory": "64Gi"}},
    )
    shared_memory_size: Quantity = Field(
        default="8Gi",
        description="Size of /dev/shm (a memory emptyDir); NCCL and tensor parallelism need it.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations, e.g. for tainted GPU nodes."
    )
    affinity: FreeForm | None = Field(
        default=None, description="Pod affinity/anti-affinity, as in a Pod spec."
    )
    priority_class_name: Name | None = Field(default=None, description="PriorityClass of the pods.")


Key = Annotated[
    str,
    StringConstraints(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    ),
]


class ParallelismSpec(ApiModel):
    """How one replica splits the model over its GPUs and, with nodes > 1, over several nodes."""

    RULES = (
        Rule(
            "!has(self.exclusiveTopologyKey) || (has(self.nodes) && self.nodes > 1)",
            "parallelism.exclusiveTopologyKey places the pods of a multi-node group; it needs "
            "parallelism.nodes above 1",
            holds=lambda p: p.exclusive_topology_key is None or p.nodes > 1,
            field=".exclusiveTopologyKey",
        ),
    )

    tensor: int = Field(
        default=1, ge=1, le=64, description="Tensor-parallel size (GPUs a layer is split over)."
    )
    pipeline: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pipeline-parallel size (stages the layers are split into).",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Nodes per replica. 1: a replica is one pod (a Deployment). Above 1: a "
        "replica is a group of this many pods, one per node, each with resources.gpus GPUs "
        "(a LeaderWorkerSet, leaderworkerset.x-k8s.io/v1, LWS v0.10 or later must be "
        "installed): the leader runs the server and vLLM's engine, the workers run vLLM's "
        "headless workers (its multiprocessing multi-node backend), and the whole group is "
        "recreated when any of its pods fails. tensor x pipeline must equal gpus x nodes.",
    )
    exclusive_topology_key: Key | None = Field(
        default=None,
        description="With nodes > 1: a node label (e.g. a rack or NVLink-domain label) whose "
        "value every pod of one group shares, with one group per value (LWS exclusive "
        "placement). Unset: the scheduler places the group's pods freely.",
    )


class SimulatorSpec(ApiModel):
    """Timing of the simulator engine (no model, no GPU; for tests and load experiments)."""

    ttft_ms: float = Field(
        default=50, ge=0, description="Simulated time to first token in milliseconds."
    )
    itl_ms: float = Field(
        default=20, ge=0, description="Simulated inter-token latency in milliseconds."
    )
    ttft_per_stream_ms: float = Field(
        default=0,
        ge=0,
        description="Extra time to first token per concurrent stream (simulates queueing).",
    )
    jitter: float = Field(
        default=0, ge=0, le=1, description="Relative random jitter on every delay (0-1)."
    )


class EnvVar(ApiModel):
    """An environment variable of the server container."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Variable name."
    )
    value: str | None = Field(default=None, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None,
        description="Source of the value (secretKeyRef, configMapKeyRef, fieldRef...), as in a Pod spec.",
    )


def _reserved(engine: EngineSpec) -> list[str]:
    return [a for a in engine.extra_args if reserved_flag(a)]


class EngineSpec(ApiModel):
    """Inference engine settings (vLLM engine arguments)."""

    RULES = (
        Rule(
            f"!has(self.extraArgs) || self.extraArgs.all(a, !a.matches('{RESERVED_RE}'))",
            "engine.extraArgs must not repeat flags the operator sets from the spec "
            "(model, parallelism, engine, auth...); set the spec field instead",
            holds=lambda e: not _reserved(e),
            field=".extraArgs",
            detail=lambda e: (
                f"got {', '.join(_reserved(e))}: vLLM reads aliases, underscores "
                "and abbreviations of a flag as the flag"
            ),
        ),
        Rule(
            # CEL checks the first argument and `--`; the operator also a bare word after
            # --flag=value (`positional_arg`).
            "!has(self.extraArgs) || (self.extraArgs.all(a, a != '--') && "
            "(size(self.extraArgs) == 0 || self.extraArgs[0].startsWith('-')))",
            "engine.extraArgs must start with a flag and must not contain '--': vLLM "
            "reads a bare word there as the model to serve (set spec.model instead)",
            holds=lambda e: positional_arg(e.extra_args) is None,
            field=".extraArgs",
            detail=lambda e: (
                f"got {positional_arg(e.extra_args)}: a bare word first in "
                "extraArgs, after --flag=value or after -- is the model; give flag values as "
                "--flag value"
            ),
        ),
    )

    backend: Literal["vllm", "simulator"] = Field(
        default="vllm",
        description="vllm: the real engine. simulator: a fake engine with configurable timing and no GPU request.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Maximum context length (prompt + output); vLLM default when unset.",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Maximum sequences in one batch; vLLM default when unset."
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Maximum tokens in one scheduler step; vLLM default when unset.",
    )
    gpu_memory_utilization: float = Field(
        default=0.92, ge=0.5, le=0.98, description="Fraction of GPU memory vLLM may use (0.5-0.98)."
    )
    swap_space_gib: float | None = Field(
        default=None,
        ge=0,
        alias="swapSpaceGiB",
        description="GiB of CPU memory for swapped-out KV cache; vLLM default when unset.",
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        default="auto", description="Weight and activation dtype."
    )
    quantization: (
        Annotated[str, StringConstraints(max_length=63, pattern=r"^[a-z0-9_-]+$")] | None
    ) = Field(
        default=None, description="Quantization method (e.g. awq, gptq, fp8); none when unset."
    )
    extra_args: Annotated[list[Arg], Field(max_length=64)] = Field(
        default_factory=list,
        description="Extra vLLM engine arguments, passed unchanged after `--`. Flags the spec "
        "sets (model, served name, host, port, tensor/pipeline/data parallel size, GPU memory, "
        "batch limits, dtype, quantization, LoRA limits and modules, API key) and --config FILE (vLLM would read flags "
        "from that file) are refused in every spelling vLLM accepts: aliases (-tp, -pp, -dp, "
        "-q), underscores (--tensor_parallel_size) and abbreviations. So is a bare word vLLM "
        "would read as the model to serve: first, after --flag=value, or after --.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment variables of the server container."
    )
    simulator: SimulatorSpec | None = Field(
        default=None,
        description="Simulator timing; used only when backend is simulator (defaults apply when unset).",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="LoRA limits of the engine. The engine runs with LoRA on when this is set "
        "or spec.adapters is non-empty; turning it on or off, or raising a limit, restarts the "
        "engine (the pods roll). Adding, changing or removing adapters within the limits does "
        "not.",
    )


Protocol = Literal["sse", "websocket", "responses", "anthropic"]
ALL_PROTOCOLS: list[Protocol] = ["sse", "websocket", "responses", "anthropic"]


Origin = Annotated[str, StringConstraints(max_length=253, pattern=r"^(\*|https?://[^/\s,]+)$")]
HeaderName = Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9-]+$")]


class CorsSpec(ApiModel):
    """Cross-origin access for browser pages on other origins (off when allowedOrigins is empty)."""

    allowed_origins: Annotated[list[Origin], Field(max_length=64)] = Field(
        default_factory=list,
        description="Origins whose pages may call the model (https://app.example.com, or * for any); "
        "WebSocket upgrades from other origins get 403. Empty: same origin only.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    allowed_headers: Annotated[list[HeaderName], Field(max_length=64)] | None = Field(
        default=None,
        description="Request headers such pages may send (default: Authorization, Content-Type, "
        "X-API-Key, Last-Event-ID).",
    )
    max_age_seconds: int = Field(
        default=600, ge=0, le=86400, description="How long browsers may cache a preflight answer."
    )


class ResumeSpec(ApiModel):
    """Resumable token streams: a dropped client may come back with Last-Event-ID."""

    grace_seconds: int = Field(
        default=0,
        ge=0,
        le=600,
        description="How long a token-SSE stream whose client dropped keeps generating, waiting "
        "for a reconnect with Last-Event-ID to the same pod (the Ingress gets cookie session "
        "affinity); the stream is lost if the pod goes. 0: abort at once.",
    )


class StreamingSpec(ApiModel):
    """Which streaming protocols are served and their limits."""

    protocols: Annotated[list[Protocol], Field(min_length=1, max_length=4)] = Field(
        default_factory=lambda: list(ALL_PROTOCOLS),
        description="Client APIs to serve, a non-empty subset of [sse, websocket, responses, "
        "anthropic]: sse covers the OpenAI chat, completions and models routes, /v1/stream, "
        "/tokenize, /detokenize and /version; websocket /ws/stream; responses the OpenAI "
        "Responses API (/v1/responses); anthropic the Anthropic Messages API (/v1/messages, "
        "/v1/messages/count_tokens). The others answer 404 naming this field.",
        json_schema_extra={"x-kubernetes-list-type": "set", "default": [*ALL_PROTOCOLS]},
    )
    heartbeat_seconds: int = Field(
        default=15,
        ge=1,
        le=300,
        description="Longest silence on a stream in seconds: an SSE comment goes to a stream idle that long (a long prefill), and the WebSocket ping interval.",
    )
    max_concurrent_streams: int = Field(
        default=256,
        ge=1,
        le=100000,
        description="Concurrent streams per replica; more get 429 with Retry-After.",
    )
    stream_timeout_seconds: int = Field(
        default=600,
        ge=1,
        le=86400,
        description="Longest a single stream may last. Pods get at least this long to drain on shutdown, "
        "and the ingress read/send timeouts are at least this.",
    )
    cors: CorsSpec = sub(CorsSpec, "Cross-origin access for browser pages (CORS); off by default.")
    resume: ResumeSpec = sub(ResumeSpec, "Resumable token streams; off by default.")
    playground: bool = Field(
        default=True,
        description="Serve the browser playground (<url>/playground), a page to try the model.",
    )

    @field_validator("protocols")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("protocols must not repeat an entry")
        return v


class RedisUrlSecretRef(SecretKeyRef):
    """A Secret key holding the Redis URL (it may carry a password)."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="url",
        description="Key inside the Secret; its value is a URL such as "
        "redis://:PASSWORD@redis.cache:6379/0 (rediss:// for TLS).",
    )


class RateLimitSpec(ApiModel):
    """Per API key (or JWT subject) token buckets (0 = unlimited)."""

    RULES = (
        Rule(
            "!has(self.backend) || self.backend != 'redis' || has(self.redisUrlSecretRef)",
            "rateLimit.backend redis needs rateLimit.redisUrlSecretRef",
            holds=lambda r: r.backend != "redis" or r.redis_url_secret_ref is not None,
            field=".redisUrlSecretRef",
        ),
    )

    requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Requests per minute per API key; 0 = unlimited. A key "
        "file line or a JWT claim may give a key its own.",
    )
    tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Prompt + completion tokens per minute per API key, "
        "charged when a stream ends; 0 = unlimited.",
    )
    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="Where the buckets live: memory (each replica limits on its own, so N "
        "replicas allow N times the limit) or redis (one set of buckets for every replica; "
        "needs redisUrlSecretRef). No Redis is installed for you: use any the cluster has.",
    )
    redis_url_secret_ref: RedisUrlSecretRef | None = Field(
        default=None,
        description="Secret key with the Redis URL, mounted into the pod as the file the server "
        "reads (--redis-url-file), never in the environment or the arguments (except for a "
        "spec.image pinned to a server version from before that flag).",
    )
    failure_mode: Literal["open", "closed"] = Field(
        default="open",
        description="When Redis cannot be reached: open admits (counted and logged), closed "
        "refuses with 503 and Retry-After. The server retries Redis by itself.",
    )


class JwksSource(ApiModel):
    """Where the JWKS comes from: exactly one of a Secret key or a ConfigMap key."""

    RULES = (
        Rule(
            "has(self.secretRef) != has(self.configMapRef)",
            "auth.jwt.jwks needs exactly one of secretRef or configMapRef",
            holds=lambda j: (j.secret_ref is None) != (j.config_map_ref is None),
        ),
    )

    secret_ref: JwksKeyRef | None = Field(
        default=None, description="A Secret key whose value is the JWKS (JSON)."
    )
    config_map_ref: JwksKeyRef | None = Field(
        default=None, description="A ConfigMap key whose value is the JWKS (JSON)."
    )


class JwtSpec(ApiModel):
    """Bearer JWTs (RS256/ES256) verified against a JWKS; a short-lived token is what a
    browser page should carry instead of a long-lived API key."""

    issuer: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description="The iss every token must carry."
    )
    audience: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description="The aud every token must carry."
    )
    jwks: JwksSource = Field(
        description="The public keys tokens are verified against, mounted as a file and "
        "reloaded when it changes (rotate by adding the new key before retiring the old)."
    )
    tenant_claim: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="tenant",
        description="Claim naming the tenant (metrics and logs are labelled by tenant). The "
        "claims rpm and tpm give a token its limits.",
    )
    priority_claim: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="priority",
        description="Claim naming the caller's priority class (with server.queue.priorities; "
        "a class that is not one of them: 401).",
    )


class AuthSpec(ApiModel):
    """Client authentication and rate limits."""

    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret key with API keys, mounted as a file: one key per line, "
        "optionally followed by tenant=NAME rpm=N tpm=N models=A,B priority=CLASS weight=N "
        "(models: the served names, base or adapters, the key may use; priority and weight: "
        "server.queue). Reloaded when the Secret changes (no restart). Unset (and no jwt): no "
        "authentication.",
    )
    jwt: JwtSpec | None = Field(
        default=None, description="Accept Bearer JWTs (as well as API keys, if both are set)."
    )
    rate_limit: RateLimitSpec = sub(
        RateLimitSpec,
        "Per API key rate limits (need apiKeySecretRef or jwt to tell callers apart).",
    )


class KedaSpec(ApiModel):
    """Settings used only with autoscaling.backend: keda (the ScaledObject's Prometheus trigger)."""

    server_address: str = Field(
        default="http://prometheus-operated.monitoring.svc:9090",
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description=(
            "URL of the Prometheus that scrapes the model pods; KEDA runs the TTFT query "
            "there. The default is the Service the Prometheus Operator (kube-prometheus-stack) "
            "makes in namespace monitoring, the same Prometheus docs/helm.md points "
            "prometheus-adapter at; for the prometheus-community 'prometheus' chart use "
            "http://<release>-server.<namespace>.svc (port 80)."
        ),
    )
    polling_interval_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="How often KEDA runs the query, in seconds (KEDA's pollingInterval).",
    )


class ScaleToZeroSpec(ApiModel):
    """Scale to zero when idle and back on the first request (autoscaling.minReplicas: 0).

    The operator's activator (shipped by the sluice-operator chart) is in the model's route
    while it has no Ready replica: it holds each request, keeps streams alive, and the
    operator scales the workload to 1 on that demand (docs/autoscaling.md, "Scale to zero")."""

    idle_seconds: int = Field(
        default=600,
        ge=30,
        le=604800,
        description="Scale to zero once no request has been admitted for this long on any "
        "pod and none is in flight (each pod's sluice_last_request_timestamp_seconds and "
        "sluice_active_streams, read from its /metrics). With backend keda this is the "
        "ScaledObject's cooldownPeriod.",
    )
    hold_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description="How long the activator holds a request while a replica starts; past it "
        "a request that received nothing gets 503 model_starting with Retry-After, a stream "
        "already committed to 200 ends with its protocol's error event. Default: "
        "startup.timeoutSeconds + 60.",
    )
    max_held: int = Field(
        default=100,
        ge=1,
        le=100000,
        description="Most requests the activator holds for this model at once (per activator "
        "pod); past it 429 with Retry-After, before anything else is sent.",
    )


MIN_ZERO_NEEDS_AUTOSCALING = (
    "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.enabled: the operator scales "
    "0 <-> 1 and the autoscaler 1 <-> maxReplicas"
)


class AutoscalingSpec(ApiModel):
    """Horizontal autoscaling on time to first token: an HPA fed by prometheus-adapter with the chart's rule (backend hpa), or a KEDA ScaledObject running the same query (backend keda)."""

    RULES = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            holds=lambda a: a.min_replicas <= a.max_replicas,
            field=".minReplicas",
            detail=lambda a: f"got minReplicas {a.min_replicas}, maxReplicas {a.max_replicas}",
        ),
        Rule(
            "!has(self.minReplicas) || self.minReplicas > 0 || !has(self.enabled) || self.enabled",
            MIN_ZERO_NEEDS_AUTOSCALING,
            holds=lambda a: a.min_replicas > 0 or a.enabled,
            field=".minReplicas",
        ),
        Rule(
            "!has(self.scaleToZero) || (has(self.minReplicas) && self.minReplicas == 0)",
            "autoscaling.scaleToZero is only used with autoscaling.minReplicas 0: set "
            "minReplicas: 0, or remove scaleToZero",
            holds=lambda a: a.scale_to_zero is None or a.min_replicas == 0,
            field=".scaleToZero",
            detail=lambda a: f"got minReplicas {a.min_replicas}",
        ),
    )

    enabled: bool = Field(
        default=True,
        description="Create the autoscaler (see backend); false keeps the settings but uses spec.replicas.",
    )
    backend: Literal["hpa", "keda"] = Field(
        default="hpa",
        description=(
            "Who scales. hpa: the operator makes a HorizontalPodAutoscaler on the custom "
            "metric sluice_ttft_pNN_seconds (install prometheus-adapter with the operator "
            "chart's rule). keda: the operator makes a KEDA ScaledObject (keda.sh/v1alpha1) "
            "whose Prometheus trigger runs the same per-pod TTFT query against "
            "autoscaling.keda.serverAddress; KEDA then owns an HPA named keda-hpa-<name>. "
            "Needs KEDA in the cluster and the operator chart's keda.enabled=true."
        ),
    )
    keda: KedaSpec = sub(KedaSpec, "KEDA settings, used when backend is keda.")
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest replicas. 0: scale to zero when idle (see scaleToZero); the HPA "
        "(or KEDA's) then keeps 1..maxReplicas and the operator owns 0 <-> 1.",
    )
    scale_to_zero: ScaleToZeroSpec | None = Field(
        default=None,
        description="Scale-to-zero settings, used with minReplicas 0 (defaults apply when unset).",
    )
    max_replicas: int = Field(
        default=4, ge=1, le=1000, description="Most replicas (each needs resources.gpus GPUs)."
    )
    target_ttft_milliseconds: int = Field(
        default=500,
        ge=1,
        le=600000,
        alias="targetTTFTMilliseconds",
        description="Target time to first token per pod, in milliseconds, at ttftPercentile.",
    )
    # Float literals: pydantic validates them (an enum in the CRD); the typing spec has none.
    ttft_percentile: Literal[0.5, 0.75, 0.9, 0.95, 0.99] = Field(  # type: ignore[valid-type]
        default=0.9,
        description="Which TTFT percentile the target applies to (0.5, 0.75, 0.9, 0.95 or 0.99).",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="Scale-up stabilization window in seconds (of our HPA, or of the HPA KEDA makes).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="Scale-down stabilization window in seconds, for either backend (model start-up is slow; avoid flapping).",
    )


class IngressSpec(ApiModel):
    """An Nginx Ingress with streaming-safe settings (buffering off, long timeouts)."""

    RULES = (
        Rule(
            "!has(self.tlsSecretName) || has(self.host)",
            "ingress.tlsSecretName needs ingress.host (the name on the certificate)",
            holds=lambda i: not i.tls_secret_name or bool(i.host),
            field=".tlsSecretName",
        ),
    )

    enabled: bool = Field(default=False, description="Create an Ingress.")
    class_name: Annotated[str, StringConstraints(max_length=253)] = Field(
        default="nginx", description="IngressClass name (spec.ingressClassName of the Ingress)."
    )
    controller: Literal["auto", "ingress-nginx", "f5-nginx"] = Field(
        default="auto",
        description="Which controller serves className, which decides the annotation set: ingress-nginx "
        "(community, nginx.ingress.kubernetes.io/*) or f5-nginx (F5 NGINX Ingress Controller, nginx.org/*). "
        "auto: f5-nginx when className contains nginx-org, nginx-plus or f5, else ingress-nginx "
        "(both controllers default to the class name nginx, so set this when you run F5's).",
    )
    host: (
        Annotated[
            str,
            StringConstraints(max_length=253, pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        ]
        | None
    ) = Field(default=None, description="Host name; unset matches every host.")
    path: Annotated[
        str, StringConstraints(max_length=1024, pattern=r"^(/[A-Za-z0-9._~-]+)*/?$")
    ] = Field(
        default="/",
        description="Path prefix (/mistral): the Ingress routes it unchanged and the server is "
        "told (--root-path), so the model answers at <prefix>/v1/... with no rewrite annotations.",
    )
    tls_secret_name: Name | None = Field(
        default=None, description="Secret with the TLS certificate for host; unset: plain HTTP."
    )
    max_body_size: (
        Annotated[str, StringConstraints(max_length=32, pattern=NGINX_SIZE_PATTERN)] | None
    ) = Field(
        default=None,
        description="Deprecated: set spec.limits.maxRequestBytes, which sets the server's limit "
        "and the ingress's together. Still honoured (nginx size, e.g. 16m) when "
        "limits.maxRequestBytes is unset.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra Ingress annotations, merged over the operator's (yours win).",
    )


Hostname = Annotated[
    str, StringConstraints(max_length=253, pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]


class ParentReference(ApiModel):
    """A Gateway (or one of its listeners) the route attaches to."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Gateway name."
    )
    namespace: Name | None = Field(
        default=None,
        description="Gateway namespace; the StreamingModel's when unset (the Gateway's "
        "listener must allow routes from it: allowedRoutes.namespaces).",
    )
    section_name: Name | None = Field(
        default=None, description="Listener name on the Gateway; every listener when unset."
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Listener port.")


class GatewaySpec(ApiModel):
    """A Gateway API HTTPRoute (gateway.networking.k8s.io/v1) instead of an Ingress."""

    parent_refs: Annotated[list[ParentReference], Field(min_length=1, max_length=32)] = Field(
        description="Gateways the route attaches to (Gateway API parentRefs)."
    )
    hostnames: Annotated[list[Hostname], Field(max_length=16)] = Field(
        default_factory=list,
        description="Host names the route answers; every host the listener accepts when empty. "
        "The first one is the status URL's host.",
    )
    path: Annotated[str, StringConstraints(max_length=1024, pattern=r"^/")] = Field(
        default="/",
        description="Path prefix (PathPrefix match, passed to the server unchanged, as with the Ingress).",
    )
    scheme: Literal["http", "https"] = Field(
        default="http",
        description="Protocol of the Gateway listener, for the status URL (TLS is the "
        "Gateway's, not the route's).",
    )
    session_persistence: bool = Field(
        default=False,
        description="With streaming.resume.graceSeconds > 0, pin each client to its pod with a "
        "session cookie (sluice-affinity) on the route's rule, so a resumed stream reaches "
        "the pod that kept it (rules[].sessionPersistence). That field is in the "
        "Experimental channel of Gateway API v1.x, not the Standard one: turn this on only "
        "where the Experimental HTTPRoute CRD is installed and the implementation supports "
        "cookie session persistence. With the Standard CRD the route is applied without it "
        "and condition GatewayRoute is False (SessionPersistenceDropped).",
    )


class EndpointPickerPort(ApiModel):
    """A port of the endpoint picker's Service."""

    number: int = Field(
        ge=1,
        le=65535,
        description="Port number (the EPP's ext-proc gRPC port, 9002 in GAIE's charts).",
    )


class EndpointPickerRef(ApiModel):
    """The endpoint picker (EPP) the gateway asks which pod serves each request."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Name of the endpoint picker's Service, in the model's namespace (the "
        "platform team runs the EPP, e.g. llm-d-router's or GAIE's chart)."
    )
    port: EndpointPickerPort = Field(description="The EPP Service's ext-proc port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the EPP does not answer: FailClose refuses "
        "the request (503), FailOpen sends it to a pod of the pool its own way.",
    )


class InferencePoolSpec(ApiModel):
    """A Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1)."""

    enabled: bool = Field(
        default=False,
        description="Create an InferencePool named like the model that selects its pods; "
        "with spec.gateway, the HTTPRoute's backend is the pool instead of the Service, so "
        "the gateway asks the endpoint picker which pod takes each request.",
    )
    app_protocol: Literal["http", "kubernetes.io/h2c"] = Field(
        default="http",
        description="Protocol the gateway speaks to the pods. The Sluice server speaks "
        "HTTP/1.1 (uvicorn has no HTTP/2): keep http unless the image serves HTTP/2 in "
        "cleartext (kubernetes.io/h2c).",
    )
    endpoint_picker: EndpointPickerRef | None = Field(
        default=None,
        description="The pool's endpointPickerRef. Unset: the pool carries none (optional "
        "in GAIE v1.6.0's CRD) and the gateway implementation picks the endpoint its own way.",
    )


class RoutingSpec(ApiModel):
    """How requests are spread over the model's replicas."""

    balance: Literal["least-loaded", "round-robin"] = Field(
        default="least-loaded",
        description="How the Ingress picks a replica for a new request. least-loaded: the "
        "controller's nearest load-aware method (F5 NGINX Ingress: nginx.org/lb-method "
        "least_conn, the replica with the fewest open streams; ingress-nginx has none that "
        "sees open streams, its ewma scores replicas by finished responses only, so it "
        "keeps round_robin). round-robin: each replica in turn. With "
        "streaming.resume.graceSeconds > 0 an affinity cookie still brings a client back "
        "to its pod. A Gateway API route has no balancing field: use inferencePool for "
        "load-aware routing behind a Gateway.",
    )
    inference_pool: InferencePoolSpec = sub(
        InferencePoolSpec, "InferencePool for an endpoint picker (off by default)."
    )


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


class LimitsSpec(ApiModel):
    """Request limits, applied alike by the server and the proxy in front of it."""

    max_request_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=2**30,
        description="Largest request body (and WebSocket frame) in bytes; default 16 MiB "
        "(16777216). Sets the server's --max-body-bytes, the Ingress's body-size annotation "
        "(proxy-body-size or client-max-body-size) and, with spec.gateway, is the limit the "
        "server enforces behind the route (Gateway API has no body-size field).",
    )


class StartupSpec(ApiModel):
    """How long a new pod may take to load its model before it counts as failed."""

    timeout_seconds: int = Field(
        default=1800,
        ge=60,
        le=86400,
        description="Startup budget in seconds (download, weights into GPU memory, warm-up): "
        "the startup probe holds liveness off this long; the Deployment's progress deadline "
        "is 10 minutes longer. Default 30 minutes.",
    )


class RolloutSpec(ApiModel):
    """How a spec change replaces pods (the Deployment's rolling update)."""

    RULES = (
        Rule(
            # has(): the API server checks this rule on the field's default ({}) too,
            # before the members' own defaults apply.
            "(has(self.maxSurge) ? self.maxSurge : 1)"
            " + (has(self.maxUnavailable) ? self.maxUnavailable : 0) > 0",
            "rollout.maxSurge and rollout.maxUnavailable cannot both be 0 (nothing "
            "could be replaced); surge: maxSurge: 1; in place: maxUnavailable: 1",
            holds=lambda r: r.max_surge + r.max_unavailable > 0,
        ),
    )

    max_surge: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Extra pods started (with their GPUs) before old ones stop. The default 1 "
        "keeps every ready replica serving while the new pod loads its model; it needs room "
        "for one more pod. On a full cluster the surge pod waits (status says why): set 0 to "
        "replace in place.",
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Ready pods that may stop before their replacement is ready. 0 (default): "
        "never fewer than the current ready replicas. maxSurge: 0 with maxUnavailable: 1 "
        "replaces in place (a one-replica model is down while the new pod loads). Also the "
        "PodDisruptionBudget's maxUnavailable (at least 1, so node drains never block).",
    )


class PodMonitorSpec(ApiModel):
    """A Prometheus Operator PodMonitor for the model's pods (clusters that run the Prometheus Operator)."""

    enabled: bool = Field(
        default=False,
        description=(
            "Make a monitoring.coreos.com/v1 PodMonitor that scrapes /metrics of every pod. "
            "Without the Prometheus Operator's CRD the rest of the model still converges and "
            "the status says why (condition PodMonitorReady)."
        ),
    )
    interval: str = Field(
        default="15s",
        pattern=r"^[0-9]+(ms|s|m)$",
        description="Scrape interval (Prometheus duration, e.g. 15s).",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Extra labels on the PodMonitor, e.g. the `release` label a kube-prometheus-stack "
            "Prometheus selects monitors by."
        ),
    )


class TracingSpec(ApiModel):
    """OpenTelemetry traces of every request (server and engine)."""

    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description=(
            "OTLP/HTTP traces endpoint, e.g. http://otel-collector.monitoring:4318/v1/traces; "
            "unset: no tracing."
        ),
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of new traces sampled (a sampled caller's traceparent is always followed).",
    )


class ObservabilitySpec(ApiModel):
    """Monitoring objects and tracing."""

    pod_monitor: PodMonitorSpec = sub(PodMonitorSpec, "Prometheus Operator PodMonitor.")
    tracing: TracingSpec = sub(TracingSpec, "OpenTelemetry tracing.")


class NetworkPolicySpec(ApiModel):
    """A NetworkPolicy that admits traffic to the model pods only from where it should come."""

    enabled: bool = Field(
        default=False,
        description="Create a NetworkPolicy for the model pods: ingress to the server port only "
        "from the model's namespace, proxyNamespaces and monitoringNamespaces (egress is not "
        "restricted). Needs a CNI that enforces NetworkPolicy.",
    )
    proxy_namespaces: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=lambda: ["ingress-nginx"],
        description="Namespaces of the ingress controller or Gateway data plane that proxies to "
        "the model (e.g. ingress-nginx, nginx-gateway, envoy-gateway-system, istio-system).",
    )
    monitoring_namespaces: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=lambda: ["monitoring"],
        description="Namespaces of the Prometheus that scrapes /metrics (prometheus-adapter "
        "and KEDA read Prometheus, not the pods, so they need no entry).",
    )


# Priority class and tenant names: the server's grammar (sluice_server/names.py), as RE2.
PRIORITY_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
PriorityName = Annotated[str, StringConstraints(pattern=PRIORITY_PATTERN)]

QUEUE_NEEDS_SIZE = (
    "server.queue needs size: a queue is always bounded (at most that many requests wait per "
    "pod; past it they get 429 with Retry-After at once)"
)
QUEUE_DEFAULT_IS_A_CLASS = "server.queue.defaultPriority must be one of server.queue.priorities"
QUEUE_WEIGHTS = (
    "server.queue.tenantWeights: every weight is a whole number from 1 to 1000 (a tenant "
    "without one weighs 1)"
)


class QueueSpec(ApiModel):
    """The admission queue: a request that finds every stream slot of the pod taken waits,
    instead of an instant 429, served by priority class, then by tenant weight."""

    RULES = (
        Rule(
            "has(self.size)",
            QUEUE_NEEDS_SIZE,
            holds=lambda q: q.size is not None,
            field=".size",
        ),
        Rule(
            "!has(self.defaultPriority) || (has(self.priorities) && "
            "self.defaultPriority in self.priorities)",
            QUEUE_DEFAULT_IS_A_CLASS,
            holds=lambda q: q.default_priority is None or q.default_priority in q.priorities,
            field=".defaultPriority",
            detail=lambda q: f"got {q.default_priority!r}; priorities: {q.priorities}",
        ),
        # Values only: a map's keys have no length bound for CEL's cost estimate (the
        # operator checks the names, `_tenants`).
        Rule(
            "!has(self.tenantWeights) || self.tenantWeights.all(t, "
            "self.tenantWeights[t] >= 1 && self.tenantWeights[t] <= 1000)",
            QUEUE_WEIGHTS,
            holds=lambda q: all(1 <= w <= 1000 for w in q.tenant_weights.values()),
            field=".tenantWeights",
            detail=lambda q: ", ".join(
                f"{t}: {w}" for t, w in q.tenant_weights.items() if not 1 <= w <= 1000
            ),
        ),
    )

    size: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description="Requests per pod that may wait for a stream slot (required: a queue is "
        "always bounded). Past it: 429 with a Retry-After from the queue's measured drain "
        "rate, at once, the lowest priority shed first.",
    )
    timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="Longest wait in the queue; then 429 with Retry-After (or, for a stream "
        "that already got its 200 after a heartbeat of waiting, its protocol's error event "
        "with code queue_timeout).",
    )
    priorities: Annotated[list[PriorityName], Field(max_length=16)] = Field(
        default_factory=list,
        description="Priority classes, highest first (e.g. [interactive, batch]). A caller's "
        "class comes from its API key line (priority=CLASS) or its JWT (auth.jwt."
        "priorityClaim); higher classes are served first and shed last, and vLLM runs with "
        "--scheduling-policy priority. A key file naming another class is refused by the "
        "server. Empty: one class.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    default_priority: PriorityName | None = Field(
        default=None,
        description="Class of a caller that names none; default: the last (lowest) of priorities.",
    )
    tenant_weights: Annotated[dict[str, int], Field(max_length=256)] = Field(
        default_factory=dict,
        description="Tenants' weights (1-1000, default 1): a tenant's share of the pod, in "
        "generated tokens and in slots, against the other active tenants'. A key line's "
        "weight=N says the same for its tenant (the two must agree).",
    )
    slot_sharing: bool = Field(
        default=True,
        description="A tenant takes more than its weighted share of the slots only while "
        "slots stay free for every other active tenant below its share (as many as that "
        "tenant held at once lately, at least one, at most a quarter of the slots in all); "
        "false: slots go to the queue's order alone.",
    )
    fair_share_window_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long a tenant counts as active after its last request, for the "
        "slot shares.",
    )

    @field_validator("priorities")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("server.queue.priorities must not repeat a class")
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _tenants(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [t for t in v if not re.match(TENANT_PATTERN, t)]
        if bad:
            raise ValueError(f"server.queue.tenantWeights: tenant names match {TENANT_PATTERN}; "
                             f"not a plain name: {', '.join(bad)}")  # fmt: skip
        return v


class ServerSpec(ApiModel):
    """The streaming server's own processes."""

    api_workers: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Front-end processes per pod (the server's --api-workers), sharing the "
        "port and one engine; stream slots, rate limits, /metrics and /ready stay the pod's. "
        "Unset: derived from resources.requests.cpu, one per whole core beyond the one "
        "vLLM's engine core busy-polls (max(1, cores - 1)), at most 8; no CPU request, "
        "streaming.resume on (a resumed stream lives in one process) or parallelism.nodes "
        "above 1 (the leader runs one process): 1.",
    )
    queue: QueueSpec | None = Field(
        default=None,
        description="Admission queue with priority classes and tenant weights, shared by "
        "every API worker of a pod; unset: a full pod answers 429 at once.",
    )


class LocalObjectReference(ApiModel):
    """A reference to an object by name in the same namespace."""

    name: Name = Field(description="Object name.")


# The adapter rules on the whole spec (StreamingModelSpec.RULES). The metadata.name case of
# ADAPTER_NAME_IS_BASE is on the CRD's root (models/resource.py, ADAPTER_NAME_RULE), the only
# place CEL sees the object's name.
_LORA_MAX_RANK_CEL = (
    "(has(self.engine.lora) && has(self.engine.lora.maxLoraRank) ? "
    f"self.engine.lora.maxLoraRank : {DEFAULT_MAX_LORA_RANK})"
)


def _names_twice(spec: StreamingModelSpec) -> list[str]:
    names = [a.name for a in spec.adapters]
    return sorted({n for n in names if names.count(n) > 1})


def _base_served_name(spec: StreamingModelSpec) -> str | None:
    """model.servedName, or org/name of an hf:// base; None: the object's name (root rule)."""
    served = spec.model.served_name
    if served is None and spec.model.uri.startswith("hf://"):
        served = spec.model.uri.removeprefix("hf://").partition("@")[0]
    return served


def _ranks_over(spec: StreamingModelSpec) -> list[str]:
    top = spec.lora_limits.max_lora_rank
    return [f"{a.name} (rank {a.rank})" for a in spec.adapters if a.rank and a.rank > top]


ADAPTER_RULES = (
    Rule(
        "!has(self.adapters) || "
        "self.adapters.all(a, self.adapters.filter(b, b.name == a.name).size() == 1)",
        ADAPTER_NAMES_REPEAT,
        holds=lambda s: not _names_twice(s),
        field=".adapters",
        detail=lambda s: ", ".join(_names_twice(s)),
    ),
    Rule(
        "!has(self.adapters) || self.adapters.all(a, has(self.model.servedName) ? "
        "a.name != self.model.servedName : "
        "!(self.model.uri == 'hf://' + a.name || self.model.uri.startsWith('hf://' + a.name + '@')))",
        ADAPTER_NAME_IS_BASE,
        holds=lambda s: _base_served_name(s) not in {a.name for a in s.adapters},
        field=".adapters",
        detail=lambda s: f"{_base_served_name(s)}: rename the adapter",
    ),
    Rule(
        "!has(self.adapters) || self.adapters.all(a, !has(a.rank) || a.rank <= "
        + _LORA_MAX_RANK_CEL
        + ")",
        ADAPTER_RANK_OVER_MAX,
        holds=lambda s: not _ranks_over(s),
        field=".adapters",
        detail=lambda s: f"{', '.join(_ranks_over(s))} > {s.lora_limits.max_lora_rank}",
    ),
    Rule(
        "!((has(self.adapters) && size(self.adapters) > 0) || has(self.engine.lora)) || "
        "!has(self.engine.backend) || self.engine.backend == 'vllm'",
        ADAPTERS_ON_SIMULATOR,
        holds=lambda s: not s.lora_enabled or s.engine.backend == "vllm",
        field=".adapters",
    ),
)


DEFAULT_IMAGE = "ghcr.io/sluice-dev/sluice-server:0.1.0"
# The activator holds a request this long past the startup budget by default.
HOLD_TIMEOUT_MARGIN_SECONDS = 60


def _gpus_detail(spec: StreamingModelSpec) -> str:
    tensor, pipeline, gpus = spec.parallelism.tensor, spec.parallelism.pipeline, spec.resources.gpus
    nodes = spec.parallelism.nodes
    if nodes == 1:
        return (
            f"got {tensor} x {pipeline} = {tensor * pipeline} and gpus: {gpus}; "
            f"set gpus: {tensor * pipeline} or change the parallelism"
        )
    fix = (
        f"set gpus: {tensor * pipeline // nodes}"
        if tensor * pipeline % nodes == 0
        else "change the parallelism"
    )
    return (
        f"got {tensor} x {pipeline} = {tensor * pipeline} and gpus x nodes: {gpus} x {nodes} "
        f"= {gpus * nodes}; {fix}"
    )


class StreamingModelSpec(ApiModel):
    """Desired state of a StreamingModel: a model served as a streaming endpoint."""

    RULES = (
        Rule(
            "!has(self.gateway) || !self.ingress.enabled",
            "spec.gateway and spec.ingress.enabled are exclusive: expose the model "
            "through a Gateway (HTTPRoute) or an Ingress, not both",
            holds=lambda s: s.gateway is None or not s.ingress.enabled,
            field=".gateway",
        ),
        Rule(
            "!has(self.server) || !has(self.server.apiWorkers) || self.server.apiWorkers "
            "== 1 || !has(self.streaming) || !has(self.streaming.resume) || "
            "!has(self.streaming.resume.graceSeconds) || "
            "self.streaming.resume.graceSeconds == 0",
            "server.apiWorkers above 1 cannot be combined with streaming.resume.graceSeconds: a "
            "resumable stream lives in one server process and a reconnect may reach another; "
            "leave apiWorkers unset (resume makes it 1) or set it to 1, or turn resume off",
            holds=lambda s: (
                (s.server.api_workers or 1) <= 1 or not s.streaming.resume.grace_seconds
            ),
            field=".server.apiWorkers",
        ),
        *ADAPTER_RULES,
        Rule(
            "self.parallelism.tensor * self.parallelism.pipeline == self.resources.gpus * "
            "(has(self.parallelism.nodes) ? self.parallelism.nodes : 1)",
            "parallelism.tensor x parallelism.pipeline must equal resources.gpus x "
            "parallelism.nodes (e.g. gpus: 4 with tensor: 4, pipeline: 1, or tensor: 2, "
            "pipeline: 2; gpus: 8 with nodes: 2 and tensor: 8, pipeline: 2)",
            holds=lambda s: (
                s.parallelism.tensor * s.parallelism.pipeline
                == s.resources.gpus * s.parallelism.nodes
            ),
            field=".parallelism",
            detail=_gpus_detail,
        ),
        Rule(
            "!has(self.parallelism.nodes) || self.parallelism.nodes == 1 || "
            "!has(self.engine.backend) || self.engine.backend == 'vllm'",
            "parallelism.nodes above 1 needs engine.backend vllm: the simulator has no "
            "multi-node engine",
            holds=lambda s: s.parallelism.nodes == 1 or s.engine.backend == "vllm",
            field=".parallelism.nodes",
        ),
        Rule(
            "!has(self.parallelism.nodes) || self.parallelism.nodes == 1 || "
            "!has(self.server) || !has(self.server.apiWorkers) || self.server.apiWorkers == 1",
            "server.apiWorkers above 1 cannot be combined with parallelism.nodes above 1: a "
            "multi-node leader runs one server process with the engine in it; leave apiWorkers "
            "unset (nodes above 1 make it 1) or set it to 1",
            holds=lambda s: s.parallelism.nodes == 1 or (s.server.api_workers or 1) <= 1,
            field=".server.apiWorkers",
        ),
    )

    model: ModelSpec = Field(description="Which model to serve.")
    resources: ResourcesSpec = sub(
        ResourcesSpec,
        "GPUs, CPU, memory and placement of each pod (per node with parallelism.nodes > 1).",
    )
    parallelism: ParallelismSpec = sub(
        ParallelismSpec,
        "Tensor, pipeline and node parallelism; tensor x pipeline must equal resources.gpus "
        "x nodes.",
    )
    engine: EngineSpec = sub(EngineSpec, "Inference engine settings.")
    streaming: StreamingSpec = sub(StreamingSpec, "Streaming protocols and limits.")
    auth: AuthSpec = sub(AuthSpec, "API keys, JWTs and rate limits.")
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Replicas when autoscaling is off (also the scale subresource); with "
        "parallelism.nodes > 1 each replica is a group of that many pods.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="TTFT autoscaling; unset: fixed spec.replicas."
    )
    ingress: IngressSpec = sub(IngressSpec, "Ingress settings.")
    gateway: GatewaySpec | None = Field(
        default=None,
        description="Expose the model through a Gateway API Gateway with an HTTPRoute "
        "(gateway.networking.k8s.io/v1) instead of an Ingress; exclusive with ingress.enabled.",
    )
    routing: RoutingSpec = sub(RoutingSpec, "Balancing over replicas and the InferencePool path.")
    network_policy: NetworkPolicySpec = sub(
        NetworkPolicySpec, "NetworkPolicy for the model pods (off by default)."
    )
    limits: LimitsSpec = sub(LimitsSpec, "Request size limits (server and proxy alike).")
    server: ServerSpec = sub(ServerSpec, "The streaming server's own processes.")
    adapters: Annotated[list[AdapterSpec], Field(max_length=MAX_ADAPTERS)] = Field(
        default_factory=list,
        description=f"LoRA adapters (fine-tunes of the base model) served by name next to "
        f"the base, at most {MAX_ADAPTERS}. Adding, changing or removing one does not restart "
        "anything: the operator writes the list to the ConfigMap <name>-adapters, which every "
        "pod has mounted, and each server process loads and unloads adapters in its running "
        "engine (the kubelet refreshes a mounted ConfigMap within about a minute). Only "
        "engine.lora's limits (and LoRA turning on with the first adapter, unless engine.lora "
        "is set) restart the engine. status.adapters says per adapter whether every pod "
        "serves it (Ready), is still loading it (Loading), or could not (Failed, with why).",
    )
    startup: StartupSpec = sub(StartupSpec, "Startup budget of a new pod.")
    rollout: RolloutSpec = sub(
        RolloutSpec, "How spec changes replace pods: surge (default) or in place."
    )
    observability: ObservabilitySpec = sub(
        ObservabilitySpec, "PodMonitor and OpenTelemetry tracing."
    )
    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        default=DEFAULT_IMAGE, description="Serving image (the Sluice server)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the image."
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="Extra pod labels (the operator's own labels win)."
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra pod annotations."
    )
    service_account_name: Name | None = Field(
        default=None, description="ServiceAccount of the pods; namespace default when unset."
    )

    @property
    def lora_enabled(self) -> bool:
        """The engine starts with LoRA on: engine.lora is set or adapters are declared."""
        return self.engine.lora is not None or bool(self.adapters)

    @property
    def lora_limits(self) -> LoraSpec:
        return self.engine.lora or LoraSpec()

    @property
    def max_request_bytes(self) -> int:
        """The one request body limit: limits.maxRequestBytes, else the deprecated
        ingress.maxBodySize, else 16 MiB."""
        if self.limits.max_request_bytes is not None:
            return self.limits.max_request_bytes
        if self.ingress.max_body_size is not None:
            return nginx_size_bytes(self.ingress.max_body_size)
        return DEFAULT_MAX_REQUEST_BYTES

    @property
    def autoscaling_enabled(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.enabled

    @property
    def autoscaling_backend(self) -> Literal["hpa", "keda"] | None:
        """Which autoscaler object the operator makes; None when autoscaling is off."""
        a = self.autoscaling
        return a.backend if a is not None and a.enabled else None

    @property
    def scale_to_zero(self) -> ScaleToZeroSpec | None:
        """The scale-to-zero settings (defaults filled in) when autoscaling.minReplicas is 0."""
        a = self.autoscaling
        if a is None or not a.enabled or a.min_replicas != 0:
            return None
        return a.scale_to_zero or ScaleToZeroSpec()

    @property
    def hold_timeout_seconds(self) -> int:
        """How long the activator holds a request: as set, else the startup budget + 60 s."""
        zero = self.scale_to_zero or ScaleToZeroSpec()
        if zero.hold_timeout_seconds is not None:
            return zero.hold_timeout_seconds
        return self.startup.timeout_seconds + HOLD_TIMEOUT_MARGIN_SECONDS

    @property
    def max_possible_replicas(self) -> int:
        a = self.autoscaling
        return a.max_replicas if a is not None and a.enabled else self.replicas
