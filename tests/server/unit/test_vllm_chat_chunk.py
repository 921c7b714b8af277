"""The chunk a plain streamed chat writes for each token's text (engine/vllm_chat_stream.py)
is vLLM's own serialization of that chunk, for any text: escapes, control characters,
non-ASCII, emoji, line separators (the tiny model's answers are ASCII, so the comparison on
the real engine in tests/server/test_vllm_chat_stream.py cannot show these)."""

from __future__ import annotations

import pytest
from sluice_server.engine.vllm_chat_stream import CHUNK, framed, text_chunk
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)

TEXTS = ["", " the", 'say "hi"\\n', "a\nb\r\tc\x00\x01\x1f\x7f", "café 東京 😀",
         "\u2028\u2029", "</script>", "\ufffd", "sluice-text-placeholder-5f0c"]  # fmt: skip


def chunk(**fields):
    return ChatCompletionStreamResponse(id="chatcmpl-1", object=CHUNK, created=1700000000,
                                        model="tiny \"model\"", **fields)  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_a_token_chunk_is_vllms_serialization_of_it(text):
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text),
                                                logprobs=None, finish_reason=None,
                                                token_ids=None)  # fmt: skip
    assert text_chunk(chunk)(text) == framed(chunk(choices=[choice]))
