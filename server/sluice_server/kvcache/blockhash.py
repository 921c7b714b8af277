"""A request's prefix-cache block hashes, exactly as vLLM 0.32 computes them.

vLLM (`vllm/v1/core/kv_cache_utils.py`) keys every full block of a prompt by a hash chain:

    hash(block i) = H((hash(block i-1) or NONE_HASH, tuple(block i's token ids), extra_keys))

* `H` is `--prefix-caching-hash-algo`: `sha256` (the default: SHA-256 of the tuple pickled
  with the highest protocol), `sha256_cbor` (SHA-256 of the tuple in canonical CBOR),
  `xxhash` and `xxhash_cbor` (xxHash3-128 of the same bytes; needs the `xxhash` package).
* `NONE_HASH = H(seed)`: the seed is `PYTHONHASHSEED` when that is set in the engine's
  environment; otherwise `"vllm-none-hash"` for the SHA-256 algorithms, and random bytes per
  process for the xxHash ones (so a router can only match an xxHash engine whose
  `PYTHONHASHSEED` it knows).
* `extra_keys` is `None` or a tuple, in this order: `("lora", adapter name, adapter path)`
  on every block of a LoRA request, multimodal and prompt-embedding keys (not computed
  here: text prompts only), and `("cache_salt", salt)` on the first block only (an empty
  salt is no salt).
* Only full blocks are hashed (`block_size` tokens, 16 by default). vLLM never serves the
  prompt's last token from the cache: a prompt of exactly n full blocks can hit n - 1.

KV events carry each hash as vLLM's `ExternalBlockHash`: by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) the low 64 bits of the digest as an unsigned
integer (`external`), with the variable at 0 the digest's bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
DEFAULT_BLOCK_SIZE = 16
# vLLM's seed for NONE_HASH under the SHA-256 algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_UINT64 = (1 << 64) - 1


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        xxhash = importlib.import_module("xxhash")  # optional, as it is for vLLM
    except ImportError:
        raise ValueError("the xxhash prefix-caching hash needs the `xxhash` package") from None
    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


def hash_function(algo: HashAlgo) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(algo)`."""
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickled(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor(obj)).digest()
    if algo == "xxhash":
        return lambda obj: _xxh3_128(_pickled(obj))
    if algo == "xxhash_cbor":
        return lambda obj: _xxh3_128(_cbor(obj))
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r} (one of {HASH_ALGOS})")


def none_hash_seed(algo: HashAlgo, environ: Mapping[str, str]) -> str:
    """The seed an engine with `environ` derives NONE_HASH from. An xxHash engine without
    PYTHONHASHSEED uses a random seed no one else knows: that is an error here."""
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        raise ValueError(
            f"{algo}: without PYTHONHASHSEED vLLM seeds its block hashes randomly per "
            "process; set the same PYTHONHASHSEED for the engine and the router"
        )
    return DEFAULT_NONE_HASH_SEED


def external(block_hash: bytes) -> int:
    """The hash as vLLM's KV events carry it by default: the digest's low 64 bits."""
    return int.from_bytes(block_hash, "big") & _UINT64


@dataclass(frozen=True, slots=True)
class Lora:
    """A LoRA adapter as it enters the block hash: its name and the path vLLM loaded it
    from (re-pointing a name at another adapter must not reuse the old KV)."""

    name: str
    path: str


@dataclass(frozen=True)
class BlockHasher:
    """Block hashes for one engine configuration (hash algorithm, NONE_HASH seed, block
    size): `BlockHasher("sha256", none_hash_seed("sha256", pod_env))`."""

    algo: HashAlgo = "sha256"
    seed: str = DEFAULT_NONE_HASH_SEED
    block_size: int = DEFAULT_BLOCK_SIZE
    _fn: Callable[[Any], bytes] = field(init=False, repr=False, compare=False)
    none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        fn = hash_function(self.algo)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "none_hash", fn(self.seed))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None
    ) -> bytes:
        """vLLM's `hash_block_tokens`."""
        return self._fn((parent or self.none_hash, tuple(token_ids), extra_keys))

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: Lora | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
        memo: BlockMemo | None = None,
    ) -> list[bytes]:
        """The hashes of every full block of `token_ids` (a prompt, or prompt + output).

        `parent` and `start_block` continue a chain: the hashes of `token_ids`' blocks
        when they follow `start_block` blocks whose last hash is `parent` (the salt goes
        on block 0 of the whole sequence only). `memo`: hashes computed before, reused."""
        bs = self.block_size
        lora_keys: tuple[tuple[str, ...], ...] = (("lora", lora.name, lora.path),) if lora else ()
        hashes: list[bytes] = []
        for i in range(len(token_ids) // bs):
            keys = lora_keys
            if cache_salt and start_block + i == 0:
                keys = (*keys, ("cache_salt", cache_salt))
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            if memo is None:
                parent = self.hash_block(parent, block, keys or None)
            else:
                parent = memo.hash(self, parent, block, keys or None)
            hashes.append(parent)
        return hashes


class BlockMemo:
    """Block hashes already computed, by what they hash (parent hash, tokens, extra keys):
    requests sharing a prefix share its blocks' hashes, so the chain of a shared system
    prompt is hashed once. An LRU of at most `max_blocks` entries (some 800 bytes each with
    16-token blocks), for one `BlockHasher`
    (its configuration is not in the key); one thread at a time."""

    def __init__(self, max_blocks: int = 16_384) -> None:
        self.max_blocks = max_blocks
        self.hashes: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()

    def hash(
        self,
        hasher: BlockHasher,
        parent: bytes | None,
        block: tuple[int, ...],
        keys: tuple[Any, ...] | None,
    ) -> bytes:
        key = (parent, block, keys)
        got = self.hashes.get(key)
        if got is not None:
            self.hashes.move_to_end(key)
            return got
        got = hasher.hash_block(parent, block, keys)
        self.hashes[key] = got
        if len(self.hashes) > self.max_blocks:
            self.hashes.popitem(last=False)
        return got


def cacheable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks can be served from the cache: whole blocks, and never
    the last token (vLLM computes at least one token of every prompt)."""
    return max(0, num_prompt_tokens - 1) // block_size
