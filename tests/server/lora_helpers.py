"""LoRA adapters made at test time (testkit/lora.py) and the adapters file the server watches."""

from __future__ import annotations

import json
import os
from pathlib import Path

from testkit.lora import make_adapter

__all__ = ["make_adapter", "write_adapters"]


def write_adapters(path: Path, adapters: dict[str, Path | str]) -> None:
    """The adapters file, replaced in one rename (as the kubelet swaps a ConfigMap)."""
    doc = {"adapters": [{"name": n, "uri": str(p)} for n, p in adapters.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
