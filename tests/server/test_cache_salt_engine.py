"""Tenants do not share vLLM's prefix cache unless the model says they may: the real engine
(tiny model, prefix caching on as vLLM 0.32 has it by default) and two API keys of two
tenants. vLLM reports a prompt's cached tokens in the usage's
`prompt_tokens_details.cached_tokens` when its serving layer runs with
`--enable-prompt-tokens-details`; the session engine's completions handler gets that
switch for this test (what the flag sets), and gives it back after.

Tenant A's token-SSE request fills the cache, and A's completions request with the same
prompt finds it (the token route and the API routes salt a tenant alike); tenant B's finds
nothing. The control: with `--share-prefix-cache-across-tenants`, B finds A's prefix."""

from __future__ import annotations

import uuid

import httpx
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

KEYS = "sk-tenant-a tenant=acme\nsk-tenant-b tenant=globex\n"
WORDS = "river stone lamp forest cloud window garden bridge paper candle".split()


def prompt() -> str:
    """About 225 tokens (223-228 over 3,000 uuids; 45 words gave 196-202, under the 200 the
    usage check asks for about 1 time in 100), new to the engine's cache (the session shares
    one engine)."""
    return uuid.uuid4().hex + " " + " ".join(WORDS[i % 10] for i in range(50))


async def cached_tokens(c: httpx.AsyncClient, key: str, text: str) -> int:
    r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                     json={"model": "tiny", "prompt": text, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] >= 200, usage  # a few of vLLM's blocks, whatever their size
    return usage["prompt_tokens_details"]["cached_tokens"]


async def test_tenants_share_no_prefix_unless_the_model_says_so(engine, make_server, tmp_path,
                                                                monkeypatch):  # fmt: skip
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    monkeypatch.setattr(engine.api.state.openai_serving_completion,
                        "enable_prompt_tokens_details", True)  # fmt: skip
    salted = await make_server(api_key_file=keys)
    shared = await make_server(api_key_file=keys, share_prefix_cache_across_tenants=True)

    text = prompt()
    async with httpx.AsyncClient(base_url=salted, timeout=60) as c:
        body = {"prompt": text, "max_tokens": 1}
        r = await c.post("/v1/stream", json=body, headers={"Authorization": "Bearer sk-tenant-a"})
        assert r.status_code == 200, r.text  # the whole stream: the request has finished
        assert await cached_tokens(c, "sk-tenant-a", text) > 0  # A's own prefix, from SSE
        assert await cached_tokens(c, "sk-tenant-b", text) == 0  # B cannot probe A's

    text = prompt()
    async with httpx.AsyncClient(base_url=shared, timeout=60) as c:
        assert await cached_tokens(c, "sk-tenant-a", text) == 0
        assert await cached_tokens(c, "sk-tenant-b", text) > 0  # the control: shared
