"""The tiny local model: built once, atomically, with the properties the streaming tests
rely on (every generated token is non-empty printable text; no special tokens)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from sluice_server.engine import tiny_model


def test_concurrent_builds_agree_and_leave_no_debris(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []

    def build():
        try:
            results.append(tiny_model.ensure_tiny_model(tmp_path))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == [tmp_path / "tiny-model"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-model"]  # temp dirs gone
    marker = json.loads((tmp_path / "tiny-model" / ".sluice-tiny-model").read_text())
    assert marker["version"] == tiny_model.RECIPE_VERSION
    # Idempotent: a second call returns the cached folder untouched.
    mtime = (tmp_path / "tiny-model" / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.ensure_tiny_model(tmp_path) == tmp_path / "tiny-model"
    assert (tmp_path / "tiny-model" / "model.safetensors").stat().st_mtime_ns == mtime


def test_losing_a_cross_process_race_keeps_the_winner(tmp_path, monkeypatch):
    """Another process renamed its build into place while we built: ours is discarded."""
    winner = tiny_model.ensure_tiny_model(tmp_path)
    mtime = (winner / "model.safetensors").stat().st_mtime_ns
    real = tiny_model._is_complete
    blind = [False, False]  # both checks before building see no model; later ones are real
    monkeypatch.setattr(tiny_model, "_is_complete", lambda p: blind.pop() if blind else real(p))
    assert tiny_model.ensure_tiny_model(tmp_path) == winner
    assert (winner / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-model"]


def test_stale_recipe_is_rebuilt(tmp_path):
    target = tmp_path / "tiny-model"
    target.mkdir()
    (target / ".sluice-tiny-model").write_text(json.dumps({"version": "0"}))
    assert tiny_model.ensure_tiny_model(tmp_path) == target
    assert (target / "model.safetensors").exists()


@pytest.fixture(scope="module")
def built(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path), AutoModelForCausalLM.from_pretrained(
        tiny_model_path
    )


def test_tokenizer_and_chat_template(built):
    tok, _ = built
    assert 500 <= len(tok) <= 1000
    for special in ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"):
        assert special in tok.all_special_tokens
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Any input tokenizes (byte-level), and round-trips.
    s = "Grüße, 世界! 42"
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s


def test_generated_tokens_are_printable_and_never_special(built):
    import torch

    tok, model = built
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer model; threads only fight the engine's processes
    try:
        torch.manual_seed(0)
        ids = tok("The cat", return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=150, do_sample=True, temperature=1.0,
                             min_new_tokens=150, pad_token_id=tok.pad_token_id)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 150
    special = set(tok.all_special_ids)
    for i in new:
        piece = tok.decode([i])
        assert i not in special and piece, (i, piece)
        assert all(c == "\n" or " " <= c <= "~" for c in piece), (i, piece)
