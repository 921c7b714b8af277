"""LoRA adapters: fine-tunes served by name on the base model's engine (`spec.adapters`).

Their rules (`Rule` records) are grouped here: AdapterSpec's own, and ADAPTER_RULES on the
whole spec (StreamingModelSpec.RULES), which sees the base model, the engine's LoRA limits
(`engine.py`, LoraSpec) and the list."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, StringConstraints

from .base import ApiModel, Rule
from .engine import DEFAULT_MAX_LORA_RANK, LoraSpec, ModelSpec

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


# The adapter rules on the whole spec (StreamingModelSpec.RULES). The metadata.name case of
# ADAPTER_NAME_IS_BASE is on the CRD's root (models/resource.py, ADAPTER_NAME_RULE), the only
# place CEL sees the object's name.
_LORA_MAX_RANK_CEL = (
    "(has(self.engine.lora) && has(self.engine.lora.maxLoraRank) ? "
    f"self.engine.lora.maxLoraRank : {DEFAULT_MAX_LORA_RANK})"
)


def _names_twice(adapters: list[AdapterSpec]) -> list[str]:
    names = [a.name for a in adapters]
    return sorted({n for n in names if names.count(n) > 1})


def _base_served_name(model: ModelSpec) -> str | None:
    """model.servedName, or org/name of an hf:// base; None: the object's name (root rule)."""
    served = model.served_name
    if served is None and model.uri.startswith("hf://"):
        served = model.uri.removeprefix("hf://").partition("@")[0]
    return served


def _ranks_over(adapters: list[AdapterSpec], lora: LoraSpec) -> list[str]:
    top = lora.max_lora_rank
    return [f"{a.name} (rank {a.rank})" for a in adapters if a.rank and a.rank > top]


ADAPTER_RULES = (
    Rule(
        "!has(self.adapters) || "
        "self.adapters.all(a, self.adapters.filter(b, b.name == a.name).size() == 1)",
        ADAPTER_NAMES_REPEAT,
        holds=lambda s: not _names_twice(s.adapters),
        field=".adapters",
        detail=lambda s: ", ".join(_names_twice(s.adapters)),
    ),
    Rule(
        "!has(self.adapters) || self.adapters.all(a, has(self.model.servedName) ? "
        "a.name != self.model.servedName : "
        "!(self.model.uri == 'hf://' + a.name || self.model.uri.startsWith('hf://' + a.name + '@')))",
        ADAPTER_NAME_IS_BASE,
        holds=lambda s: _base_served_name(s.model) not in {a.name for a in s.adapters},
        field=".adapters",
        detail=lambda s: f"{_base_served_name(s.model)}: rename the adapter",
    ),
    Rule(
        "!has(self.adapters) || self.adapters.all(a, !has(a.rank) || a.rank <= "
        + _LORA_MAX_RANK_CEL
        + ")",
        ADAPTER_RANK_OVER_MAX,
        holds=lambda s: not _ranks_over(s.adapters, s.lora_limits),
        field=".adapters",
        detail=lambda s: (
            f"{', '.join(_ranks_over(s.adapters, s.lora_limits))} > {s.lora_limits.max_lora_rank}"
        ),
    ),
    Rule(
        "!((has(self.adapters) && size(self.adapters) > 0) || has(self.engine.lora)) || "
        "!has(self.engine.backend) || self.engine.backend == 'vllm'",
        ADAPTERS_ON_SIMULATOR,
        holds=lambda s: not s.lora_enabled or s.engine.backend == "vllm",
        field=".adapters",
    ),
)
