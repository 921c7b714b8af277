"""What a router needs to hash a model's prompts as its engine does, as a pod describes it.

A pod serves this at `GET /internal/prefix-cache` (protocols/prefix_cache.py); a router
builds its `router.prompts.PromptHasher` from it. The JSON object:

    {"enabled": bool,                    # prefix caching on in the engine
     "block_size": int, "hash_algo": str, # kvcache.blockhash.HashAlgo
     "none_hash_seed": str | null,        # null: an xxHash engine without PYTHONHASHSEED
     "loras": {name: path},               # the adapters as the engine loaded them
     "tokenizer": {"kind": "words"}       # the simulator: whitespace words
               | {"kind": "hf", "class": str, "chat_template": str | null,
                  "chat_rendering": "template" | "harmony",  # harmony: gpt-oss
                  "default_chat_template_kwargs": {...},     # the server's, for every chat
                  "content_format": "string" | "openai", "sha256": str,
                  "files": {name: size}}  # each at GET /internal/prefix-cache/files/{name}
               | {"kind": "unavailable", "reason": str}}

Nothing in it is secret: tokenizer files, a chat template and hashing parameters are what
the model's public repository ships; adapter paths are folders inside the pod.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# The files a Hugging Face tokenizer loads from its folder (whichever exist).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Large vocabularies' tokenizer.json are 10-20 MB; the bound keeps a pod's answer finite.
MAX_TOKENIZER_BYTES = 64 * 2**20


def tokenizer_files(folder: Path) -> dict[str, int]:
    """The tokenizer files present in `folder`, with their sizes; ValueError past the bound."""
    sizes = {n: (folder / n).stat().st_size for n in TOKENIZER_FILES if (folder / n).is_file()}
    if "tokenizer.json" not in sizes and "tokenizer.model" not in sizes:
        raise ValueError(f"no tokenizer.json or tokenizer.model in {folder}")
    if sum(sizes.values()) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"the tokenizer files in {folder} exceed {MAX_TOKENIZER_BYTES} bytes")
    return sizes


def files_digest(files: dict[str, bytes]) -> str:
    """The content hash a router caches a tokenizer under: names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "big") + files[name])
    return h.hexdigest()
