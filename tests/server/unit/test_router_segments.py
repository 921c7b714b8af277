"""router/segments.py: a rendered chat encoded segment by segment (between the tokenizer's
added tokens), segments cached, gives exactly the ids of the whole-text encode; and the
block-hash memo gives exactly the hashes computed afresh."""

from __future__ import annotations

import json
import random

import pytest
from sluice_server.engine.tiny_model import CHAT_TEMPLATE, IM_END, IM_START
from sluice_server.kvcache.blockhash import BlockHasher, BlockMemo
from sluice_server.router.prompts import PromptHasher, _HfTokens
from sluice_server.router.segments import SegmentEncoder

# Pieces of text that stress a byte-level BPE at segment edges: spaces and newlines
# around the special tokens, digits, punctuation, non-ASCII, the special tokens'
# own text (and near misses) inside a message.
_PIECES = ["the", "cat", " ", "  ", "\n", "\n\n", "42", "3.14", ",", "!?", "don't", "naïve",
           "日本", "🙂", "<|im", "_start|>", "<s>", "</s>", IM_START, IM_END, "<|im_end", "x",
           "stream", "tokens", "\t", "-", "'s", "A", "Z9"]  # fmt: skip


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_PIECES) + rng.choice(("", " ", "")) for _ in range(n))


def chats(count: int, seed: int = 3) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roles = ["system"] * rng.randint(0, 1) + ["user", "assistant"] * rng.randint(1, 3)
        out.append([{"role": r, "content": text(rng, rng.randint(0, 30))} for r in roles])
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_model_path))


def test_segments_give_the_whole_texts_ids(tokenizer):
    encoder = SegmentEncoder.of(tokenizer)
    assert encoder is not None and encoder.cut is not None
    backend = tokenizer.backend_tokenizer
    for chat in chats(300):
        rendered = tokenizer.apply_chat_template(
            chat, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        whole = backend.encode(rendered, add_special_tokens=False).ids
        assert encoder.encode(rendered) == whole, rendered
        assert encoder.encode(rendered) == whole  # again, from the cache
    assert encoder.hits > encoder.misses > 0


def test_a_cut_elsewhere_than_at_an_added_token_changes_the_ids(tokenizer):
    """Negative control: the same text cut inside a message (after a space, before a
    letter) instead of at the special tokens, each half encoded alone, gives other ids:
    the byte-level pre-tokenizer keeps a word's leading space with the word."""
    backend = tokenizer.backend_tokenizer
    rng = random.Random(5)
    differ = 0
    for chat in chats(100, seed=9):
        rendered = tokenizer.apply_chat_template(
            chat, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        spaces = [i + 1 for i, ch in enumerate(rendered[:-1])
                  if ch == " " and rendered[i + 1].isalpha()]  # fmt: skip
        if not spaces:
            continue
        cut = rng.choice(spaces)
        halves = [rendered[:cut], rendered[cut:]]
        pieced = [t for h in halves for t in backend.encode(h, add_special_tokens=False).ids]
        differ += pieced != backend.encode(rendered, add_special_tokens=False).ids
    assert differ > 50


def test_the_router_hashes_the_same_with_and_without_segments(tokenizer):
    tokens = _HfTokens(tokenizer, CHAT_TEMPLATE, "string")
    assert tokens.segments is not None
    hasher = PromptHasher(BlockHasher("sha256", "seed", 4), tokens)
    bodies = [json.dumps({"messages": chat}).encode() for chat in chats(100, seed=4)]
    with_segments = [hasher.hashes("/v1/chat/completions", b, "t") for b in bodies]
    tokens.segments = None
    hasher.memo = BlockMemo()
    assert with_segments == [hasher.hashes("/v1/chat/completions", b, "t") for b in bodies]
    # ... and the ids are the tokenizer's own chat encode (the router's path without segments)
    for body in bodies:
        chat = json.loads(body)["messages"]
        tokens.segments = SegmentEncoder.of(tokenizer)
        assert tokens.prompt_ids("chat", {"messages": chat}) == tokenizer.apply_chat_template(
            chat, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False,
            add_generation_prompt=True,
        )  # fmt: skip


def test_the_cache_stays_under_its_bytes(tokenizer):
    encoder = SegmentEncoder.of(tokenizer, max_bytes=4096)
    assert encoder is not None
    rng = random.Random(1)
    for _ in range(200):
        encoder.encode(f"{IM_START}user\n{text(rng, 20)}{IM_END}")
        assert encoder.bytes <= 4096
    assert 0 < len(encoder.cache) < 200


def test_tokenizers_whose_segments_are_not_exact_get_no_encoder():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(pre, token: AddedToken) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "▁a": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre
        tok.add_special_tokens([token])
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    plain = AddedToken("<x>", special=True, normalized=False)
    assert SegmentEncoder.of(fast(pre_tokenizers.Whitespace(), plain)) is not None
    stripping = AddedToken("<x>", special=True, normalized=False, lstrip=True)
    assert SegmentEncoder.of(fast(pre_tokenizers.Whitespace(), stripping)) is None
    first = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert SegmentEncoder.of(fast(first, plain)) is None
    assert SegmentEncoder.of(object()) is None  # not a fast tokenizer


def test_the_block_memo_gives_the_hashes_computed_afresh():
    hasher = BlockHasher("sha256", "seed", 4)
    memo = BlockMemo(max_blocks=8)
    rng = random.Random(2)
    shared = [rng.randrange(500) for _ in range(20)]
    for i in range(50):
        ids = shared + [rng.randrange(500) for _ in range(rng.randint(0, 12))]
        salt = "s" if i % 3 == 0 else None
        assert hasher.block_hashes(ids, cache_salt=salt, memo=memo) == hasher.block_hashes(
            ids, cache_salt=salt
        )
        assert len(memo.hashes) <= 8
