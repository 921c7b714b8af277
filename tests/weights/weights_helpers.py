"""What the weights tests share: a model's files, a fetch against the fake Hub in this
process (`huggingface_hub` reads HF_ENDPOINT at import, so the Hub is handed its
endpoint), and the log lines a run wrote."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from sluice_server.weights.fetch import Request, fetch
from sluice_server.weights.hub import Hub
from sluice_server.weights.progress import Progress
from sluice_server.weights.result import Result
from testkit.fake_hub import FakeHub

REPO = "acme/tiny"
MiB = 1024 * 1024
# Above huggingface_hub's 10 MiB download chunk: a cut connection resumes at a chunk's end.
BIG = 24 * MiB


def model_files(shard: int = 300_000, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "config.json": json.dumps({"model_type": "llama", "seed": seed}).encode(),
        "tokenizer.json": b'{"version": "1.0", "vocab": {}}' * 40,
        "model.safetensors": rng.randbytes(shard),
    }


def run(hub: FakeHub, root: Path, revision: str = "main", *, repo: str = REPO,
        token: str | None = None, free_bytes: Callable[[Path], int] | None = None,
        verify_hashes: bool = True, endpoint: str | None = None) -> tuple[Result, Progress]:  # fmt: skip
    progress = Progress()
    client = Hub(token, endpoint=endpoint or hub.url, attempts=2, retry_wait=0.0)
    kwargs = {} if free_bytes is None else {"free_bytes": free_bytes}
    result = fetch(
        Request(repo, revision, root), client, progress, verify_hashes=verify_hashes, **kwargs
    )
    return result, progress


def gets(hub: FakeHub, path: str) -> int:
    return len(hub.file_requests(path, "GET"))
