"""A tiny random Llama model made locally, for CPU runs, tests and the demo.

No weights can be downloaded in CI, so `--model tiny` builds one in seconds: a byte-level
BPE tokenizer trained on generated sentences plus a 2-layer Llama with seeded random
weights (~2 MB). Its output is gibberish, but deterministic for a given seed.

Two properties the streaming tests rely on:
- Every token the model can *generate* decodes to non-empty printable ASCII (or a newline).
  The tokenizer still covers all 256 bytes so any input tokenizes, but the output head is
  biased hard against byte fragments of multi-byte UTF-8, control bytes and special tokens.
  So one engine token = one non-empty text delta, and the demo can print it raw.
- Because special tokens (EOS included) are never generated, a generation only ends at
  `max_tokens` or a `stop` string; lengths are predictable without `ignore_eos`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path

# Bump when the recipe changes: a cached model with another version is rebuilt.
RECIPE_VERSION = "1"
_MARKER = ".sluice-tiny-model"
# One build at a time per process (threads would also race on transformers' lazy imports);
# across processes the atomic rename below decides.
_BUILD_LOCK = threading.Lock()

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
VOCAB_SIZE = 768
SEED = 1234

# ChatML, as used by Qwen and many others; vLLM applies it for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SUBJECTS = (
    "the cat",
    "a stream",
    "the server",
    "my friend",
    "the river",
    "a token",
    "the model",
    "our team",
    "the proxy",
    "a small bird",
    "the engine",
    "every client",
    "the queue",
    "a quiet night",
    "the operator",
    "the old man",
    "a red fox",
    "the cluster",
)
_VERBS = (
    "sends",
    "reads",
    "watches",
    "builds",
    "finds",
    "carries",
    "answers",
    "follows",
    "writes",
    "counts",
    "drops",
    "keeps",
    "opens",
    "closes",
    "streams",
    "waits for",
)
_OBJECTS = (
    "the message",
    "a long answer",
    "three apples",
    "the first byte",
    "a warm cup of tea",
    "the green door",
    "every request",
    "a blue sky",
    "the last word",
    "some numbers",
    "the morning news",
    "a heavy box",
    "the open socket",
    "twelve small stones",
)
_TAILS = (
    "today",
    "again",
    "at noon",
    "in the rain",
    "before dinner",
    "very slowly",
    "at once",
    "with care",
    "on Monday",
    "near the sea",
    "after 42 seconds",
    "for 7 minutes",
)


def _sentences(count: int = 4000, seed: int = SEED) -> list[str]:
    """Deterministic English-like training text for the BPE tokenizer."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.5:
            text = text[0].upper() + text[1:]
        out.append(text + rng.choice((".", "!", "?", ",", ":", ";")))
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sluice"


def _printable(text: str) -> bool:
    return bool(text) and all(ch == "\n" or " " <= ch <= "~" for ch in text)


def _build(target: Path) -> None:
    """Write tokenizer + model files into `target` (an empty directory)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in server logs

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any input tokenizes
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)

    vocab_size = tok.get_vocab_size()
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Channel 0 of every embedding carries a constant, so channel 0 of the final
        # normalised hidden state stays strongly positive for any input. A large negative
        # weight on that channel in the output head then acts as a fixed logit penalty.
        model.model.embed_tokens.weight[:, 0] = 0.2
        model.lm_head.weight[:, 0] = 0.0
        banned = [
            i
            for i in range(vocab_size)
            if i in tok.get_vocab().values()
            and (
                tok.id_to_token(i) in SPECIAL_TOKENS
                or not _printable(tok.decode([i], skip_special_tokens=False))
            )
        ]
        model.lm_head.weight[banned, 0] = -3.0
    model.save_pretrained(target, safe_serialization=True)
    GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        pad_token_id=tok.token_to_id(PAD),
    ).save_pretrained(target)
    (target / _MARKER).write_text(
        json.dumps({"version": RECIPE_VERSION, "banned_tokens": len(banned)})
    )


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()).get("version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the folder of the tiny model, building it first if needed.

    Idempotent and safe when several processes race: each builds in its own temporary
    folder next to the target and renames it into place; a loser discards its copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "tiny-model"
    if _is_complete(target):
        return target
    with _BUILD_LOCK:
        if _is_complete(target):  # another thread built it while we waited
            return target
        _build_into(root, target)
    return target


def _build_into(root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=root))
    try:
        _build(tmp)
        if target.exists() and not _is_complete(target):
            # A stale recipe or a half-written folder from an older layout: move it aside
            # atomically, then delete it (another process may be doing the same).
            stale = Path(tempfile.mkdtemp(prefix=".tiny-model-stale-", dir=root))
            try:
                os.rename(target, stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)  # atomic; fails if another process won the race
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    print(ensure_tiny_model())


if __name__ == "__main__":
    main()
