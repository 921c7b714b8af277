"""LoRA adapters made at test time (PEFT's files written directly), for the server tests,
the live-pod e2e test and the LoRA benchmark, and the adapters file the server watches."""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(folder: Path, base: Path | None = None, rank: int = 8, scale: float = 0.3,
                 seed: int = 0) -> Path:  # fmt: skip
    """A PEFT LoRA adapter folder, written directly (adapter_config.json +
    adapter_model.safetensors, PEFT's layout and tensor names). With `base` (a Llama
    folder), random A/B matrices for every projection of every layer, large enough that
    the answer at temperature 0 differs from the base's; without, the config only (enough
    for the simulator)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": list(TARGETS), "modules_to_save": None,
              "base_model_name_or_path": str(base or "tiny")}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if base is None:
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def write_adapters(path: Path, adapters: dict[str, Path | str]) -> None:
    """The adapters file, replaced in one rename (as the kubelet swaps a ConfigMap)."""
    doc = {"adapters": [{"name": n, "uri": str(p)} for n, p in adapters.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
