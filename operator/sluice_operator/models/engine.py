"""The model and the engine that serves it: where the weights come from (`model`), the
engine's arguments, environment and simulator timing (`engine`), and its LoRA limits
(`engine.lora`; the adapters themselves are `adapters.py`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import Field, StringConstraints

from .base import ApiModel, FreeForm, Quantity, Rule, sub
from .flags import RESERVED_RE, positional_arg, reserved_flag
from .refs import Name, SecretKeyRef
from .weights import WEIGHTS_NEED_HF, WeightsCache

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


class ModelCache(ApiModel):
    """Where downloaded weights are kept (mounted at /cache, HF_HOME=/cache/hf). With
    `weights`, the operator downloads them once into a shared claim and /cache keeps only
    what the pods write (the Hugging Face home, vLLM's compile cache)."""

    pvc_name: Name | None = Field(
        default=None,
        description="Existing PersistentVolumeClaim to keep downloads across restarts (with "
        "`weights`: vLLM's compile cache). Unset: an emptyDir of sizeLimit (weights are "
        "downloaded again on every pod start, unless `weights` is set).",
    )
    size_limit: Quantity = Field(
        default="100Gi", description="Size limit of the emptyDir cache when pvcName is unset."
    )
    weights: WeightsCache | None = Field(
        default=None,
        description="Download the hf:// weights once, with a Job of the operator, into a shared "
        "ReadWriteMany claim; the pods mount them read-only and start with the Hub off "
        "(HF_HUB_OFFLINE=1, no token). Unset: each pod downloads at start (docs/weights-cache.md).",
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
        WEIGHTS_NEED_HF,
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
        "the arguments; with cache.weights into the download Job only.",
    )
    cache: ModelCache = sub(ModelCache, "Cache volume for downloaded weights.")


# vLLM 0.32's --max-lora-rank choices (vllm.config.lora.MaxLoRARanks), which
# test_operator_vllm_flags.py compares with vLLM's parser; the field's description lists them.
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
_RANKS = [str(r) for r in get_args(LoraRank)]
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
        description="Largest adapter rank the engine accepts (vLLM --max-lora-rank: "
        f"{', '.join(_RANKS[:-1])} or {_RANKS[-1]}). " + ENGINE_START,
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Adapters kept loaded in CPU memory (vLLM --max-cpu-loras, at least "
        "maxLoras); others are read from the pod's cache volume again when asked for. "
        "Unset: maxLoras. " + ENGINE_START,
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
