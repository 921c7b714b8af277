"""A Hugging Face fast tokenizer's encode of a rendered chat, segment by segment, with the
segments' token ids cached: most of a precise router's time to first byte was the BPE
encode of the prompt, and the prompts it serves share their system prompt and history.

Why a segment's ids do not depend on what surrounds it: the `tokenizers` library's encode
first cuts the text at the occurrences of its added tokens that match before normalization
(`normalized: false`; leftmost, longest first), then normalizes, pre-tokenizes and
tokenizes each piece between them on its own, the added tokens becoming their own ids. So
the ids of a text are the concatenation of its pieces' ids, and a piece's ids can be kept
by its text. `SegmentEncoder.of` builds the encoder only for a tokenizer where that holds
as the library works, else None (the caller encodes whole texts):

- every added token cut out before normalization keeps its exact text (no `lstrip`,
  `rstrip`, `single_word`), and special tokens are cut out (`encode_special_tokens` off);
- no truncation or padding;
- no pre-tokenizer or normalizer that reads a piece's position in the whole text (a
  Metaspace with `prepend_scheme: first` prepends only at offset 0).

and it checks itself on a probe text once, against the whole-text encode. Texts are encoded
without the tokenizer's own special tokens (`add_special_tokens=False`: how vLLM encodes a
rendered chat). The cache is an LRU bounded by an estimate of its bytes.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections import OrderedDict
from typing import Any

# What a cached piece is counted as besides its text and ids: the array and the dict's entry.
_ENTRY_BYTES = 150
CACHE_BYTES = 32 * 2**20  # per model's hasher


class SegmentEncoder:
    def __init__(self, backend: Any, max_bytes: int = CACHE_BYTES) -> None:
        self.backend = backend
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        cut = {t.content: i for i, t in added.items() if not t.normalized}
        self.ids_of = cut
        alternatives = sorted(cut, key=len, reverse=True)  # longest first at each position
        self.cut = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if cut else None
        self.cache: OrderedDict[str, array[int]] = OrderedDict()
        self.max_bytes, self.bytes = max_bytes, 0
        self.hits = self.misses = 0

    @classmethod
    def of(cls, tokenizer: Any, max_bytes: int = CACHE_BYTES) -> SegmentEncoder | None:
        """The encoder for a transformers fast tokenizer where segments are exact (see the
        module docstring); None for any other."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None
        if getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
            return None
        if backend.truncation is not None or backend.padding is not None:
            return None
        for token in backend.get_added_tokens_decoder().values():
            if token.lstrip or token.rstrip or token.single_word:
                return None
        if _reads_position(json.loads(backend.to_str())):
            return None
        encoder = cls(backend, max_bytes)
        probe = " ".join(f"{t} a\n b  {t}{t}x" for t in encoder.ids_of) + " hello, world"
        if encoder.encode(probe) != backend.encode(probe, add_special_tokens=False).ids:
            return None
        encoder.cache.clear()
        encoder.bytes = encoder.hits = encoder.misses = 0
        return encoder

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, as `backend.encode(text, add_special_tokens=False).ids`."""
        ids: list[int] = []
        if self.cut is None:
            ids.extend(self._piece(text))
            return ids
        special = False
        for part in self.cut.split(text):  # pieces and, between them, the added tokens
            if special:
                ids.append(self.ids_of[part])
            elif part:
                ids.extend(self._piece(part))
            special = not special
        return ids

    def _piece(self, text: str) -> array[int]:
        cache = self.cache
        got = cache.get(text)
        if got is not None:
            cache.move_to_end(text)
            self.hits += 1
            return got
        self.misses += 1
        got = array("q", self.backend.encode(text, add_special_tokens=False).ids)
        size = _ENTRY_BYTES + sys.getsizeof(text) + 8 * len(got)
        if size > self.max_bytes:
            return got
        cache[text] = got
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, old_ids = cache.popitem(last=False)
            self.bytes -= _ENTRY_BYTES + sys.getsizeof(old) + 8 * len(old_ids)
        return got


def _reads_position(node: Any) -> bool:
    """Whether a tokenizer's JSON holds a step that treats a text's first piece apart."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return True
        return any(_reads_position(v) for v in node.values())
    if isinstance(node, list):
        return any(_reads_position(v) for v in node)
    return False
