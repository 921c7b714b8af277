"""LoRA adapters made at test time and the adapters file the server watches (testkit/lora.py)."""

from __future__ import annotations

from testkit.lora import make_adapter, write_adapters

__all__ = ["make_adapter", "write_adapters"]
