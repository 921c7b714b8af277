"""A stream continued on another server, on the real engine (tiny model, temperature 0, one
stream at a time): cut after k events, continued from the received token ids through
`POST /internal/continue` on a second server, the spliced text equals an uninterrupted
run's, with one terminal event, contiguous event ids and the usage of one answer. The two
servers are two apps on the session's one engine (each has its own streams and limits);
what is proven is the pod side: vLLM's engine input (prompt + received ids, max_tokens
reduced) and each API's rendering of the rest. Negative control: the same continuation
without the received ids repeats the answer's start after the seam."""

from __future__ import annotations

import httpx
import pytest
from continuation_helpers import (
    KEY,
    ROUTER,
    check_one_stream,
    continue_on,
    cut,
    events_of,
    text_and_usage,
)

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

N = 40
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
COMMON = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
BODIES = {
    "/v1/stream": {"prompt": "The river", **COMMON},
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "stream": True,
                             "stream_options": {"include_usage": True}, **COMMON},
    "/v1/completions": {"model": "tiny", "prompt": "The river", "stream": True,
                        "stream_options": {"include_usage": True}, **COMMON},
    "/v1/messages": {"model": "tiny", "messages": MESSAGES, "stream": True, **COMMON},
    "/v1/responses": {"model": "tiny", "input": "Tell me about the river.", "stream": True,
                      "max_output_tokens": N, "temperature": 0, "ignore_eos": True},
}  # fmt: skip


async def _stream(c: httpx.AsyncClient, path: str, body: dict) -> str:
    r = await c.post(path, json=body, headers=ROUTER)
    assert r.status_code == 200, r.text
    return r.text


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_continued_stream_says_what_the_uninterrupted_one_says(make_server, tmp_path, path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    body = BODIES[path]
    a = await make_server(continuation_key_file=key_file)
    b = await make_server(continuation_key_file=key_file)
    async with httpx.AsyncClient(base_url=a, timeout=120) as ca, \
            httpx.AsyncClient(base_url=b, timeout=120) as cb:  # fmt: skip
        whole = events_of(await _stream(ca, path, body))
        answer = text_and_usage(path, whole)
        assert len(answer[0]) > 20, whole
        before, state = cut(await _stream(ca, path, body), 6)
        assert 0 < len(state["token_ids"]) < N
        r = await continue_on(cb, path, body, state)
        assert r.status_code == 200, r.text
        spliced = before + events_of(r.text)
        check_one_stream(path, spliced)
        assert text_and_usage(path, spliced) == answer

        # Negative control: without the received ids the answer starts again at the seam.
        r = await continue_on(cb, path, body, {**state, "token_ids": []})
        wrong = text_and_usage(path, before + events_of(r.text), strict=False)[0]
        assert wrong != answer[0]
