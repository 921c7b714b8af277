"""LoRA adapters made at test time (testkit/lora.py), the adapters file the server watches,
and waiting for what the server records."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from testkit.lora import make_adapter

T = TypeVar("T")
__all__ = ["eventually", "make_adapter", "write_adapters"]


def write_adapters(path: Path, adapters: dict[str, Path | str]) -> None:
    """The adapters file, replaced in one rename (as the kubelet swaps a ConfigMap)."""
    doc = {"adapters": [{"name": n, "uri": str(p)} for n, p in adapters.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


async def eventually(check: Callable[[], Awaitable[T]], within: float = 30.0,
                     every: float = 0.1) -> T:  # fmt: skip
    """`check()`'s first truthy result; AssertionError with the last one after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still {result!r} after {within} s")
        await asyncio.sleep(every)
