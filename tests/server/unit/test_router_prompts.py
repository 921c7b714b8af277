"""The router's prompt hashes (`router/prompts.py`) for the simulator: from the pod's own
`GET /internal/prefix-cache`, a request's hashes are the blocks the simulator's prefix
cache stored for it, on every route; what the router cannot parse is None."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from app_helpers import serve_simulator
from sluice_server.core.auth.cachesalt import cache_salt_for
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.kvcache import blockhash
from sluice_server.router.prompts import PromptHasher, fetch_hasher

BS = 4


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


REQUESTS = {
    "/v1/chat/completions": {"messages": [{"role": "system", "content": words("s", 5)},
                                          {"role": "user", "content": [
                                              {"type": "text", "text": words("c", 9)}]}]},
    "/v1/completions": {"prompt": words("p", 11)},
    "/v1/responses": {"instructions": words("i", 3), "input": words("r", 10)},
    "/v1/messages": {"system": words("a", 4), "max_tokens": 2,
                     "messages": [{"role": "user", "content": words("m", 9)}]},
    "/v1/stream": {"prompt": words("t", 13)},
}  # fmt: skip


def stored(engine: SimulatorEngine) -> set[int]:
    assert engine.cache is not None
    return {blockhash.external(h) for h in engine.cache._blocks}


async def test_simulator_hashes_equal_its_prefix_caches(tmp_path):
    engine = SimulatorEngine(ttft_ms=1, itl_ms=1, prefix_cache_blocks=1000, block_size=BS)
    async with serve_simulator(engine) as off, httpx.AsyncClient(timeout=10) as client:
        r = await client.get(off + "/internal/prefix-cache")  # not a router model's pod
        assert r.status_code == 404 and "--describe-prefix-cache" in r.json()["error"]
        assert (
            await client.get(off + "/internal/prefix-cache/files/tokenizer.json")
        ).status_code == 404
    async with (
        serve_simulator(engine, describe_prefix_cache=True) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.get(url + "/internal/prefix-cache")
        assert r.status_code == 200
        desc = r.json()
        assert desc["tokenizer"] == {"kind": "words"} and desc["block_size"] == BS
        assert desc["enabled"] and desc["hash_algo"] == "sha256"
        hasher = await fetch_hasher(client, url, tmp_path)
        assert hasher is not None
        for path, body in REQUESTS.items():
            body = {"model": "sim", "max_tokens": 1, **body}
            for salt in (None, "own"):
                b = body if salt is None else {**body, "cache_salt": salt}
                raw = json.dumps(b).encode()
                want = hasher.hashes(path, raw, None)
                assert want and len(want) >= 2, (path, want)
                before = stored(engine)
                assert not set(want) & before, path  # new blocks each time
                r = await client.post(url + path, content=raw,
                                      headers={"content-type": "application/json"})  # fmt: skip
                assert r.status_code == 200, (path, r.text)
                assert set(want) <= stored(engine), path
        # Control: another block size predicts none of what the simulator stored.
        wrong = PromptHasher.from_description({**desc, "block_size": BS + 1})
        assert wrong is not None
        raw = json.dumps(REQUESTS["/v1/completions"]).encode()
        assert not set(wrong.hashes("/v1/completions", raw, None) or []) & stored(engine)


def test_tenant_salt_and_lora_enter_the_hashes():
    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {"ad": "/a/ad"},
            "tokenizer": {"kind": "words"}}  # fmt: skip
    h = PromptHasher.from_description(desc)
    assert h is not None
    raw = json.dumps({"prompt": words("x", 8), "cache_salt": "c"}).encode()
    ids = h.tokens.prompt_ids("completion", json.loads(raw))
    salted = h.hashes("/v1/completions", raw, "tenant-a")
    salt = cache_salt_for("tenant-a", "c", shared=False)
    assert salted == [blockhash.external(x) for x in h.hasher.block_hashes(ids, cache_salt=salt)]
    lora_raw = json.dumps({"prompt": words("x", 8), "model": "ad"}).encode()
    lora = blockhash.Lora("ad", "/a/ad")
    assert h.hashes("/v1/completions", lora_raw, None) == [
        blockhash.external(x) for x in h.hasher.block_hashes(ids, lora=lora)
    ]


def test_what_the_router_cannot_reproduce_is_none():
    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {}, "tokenizer": {"kind": "words"}}  # fmt: skip
    h = PromptHasher.from_description(desc)
    assert h is not None
    for path, body in [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
        ("/v1/completions", json.dumps({"prompt": "a b", "cache_salt": "x/y"}).encode()),
        ("/v1/embeddings", json.dumps({"input": "a b c d e"}).encode()),
        ("/v1/stream", b""),
    ]:
        assert h.hashes(path, body, None) is None, (path, body)
    # Off, or a seed the router cannot know: no hasher at all.
    assert PromptHasher.from_description({**desc, "enabled": False}) is None
    assert PromptHasher.from_description({**desc, "none_hash_seed": None}) is None


def test_a_model_under_a_path_prefix_is_hashed_as_its_pod_serves_it():
    """The route's path prefix reaches the router and the pod strips it: the same hashes."""
    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {}, "tokenizer": {"kind": "words"}}  # fmt: skip
    h = PromptHasher.from_description(desc)
    assert h is not None
    body = json.dumps({"messages": [{"role": "user", "content": "w " * (3 * BS)}]}).encode()
    plain = h.hashes("/v1/chat/completions", body, None)
    assert plain and h.hashes("/mistral/v1/chat/completions", body, None) == plain
    completion = json.dumps({"prompt": "w " * (3 * BS)}).encode()
    assert h.hashes("/mistral/v1/completions", completion, None) == h.hashes(
        "/v1/completions", completion, None
    )
    assert h.hashes("/mistral/v1/chat/completions/x", body, None) is None


class _Template:
    """A tokenizer whose chat template records the conversation vLLM's renderer would get."""

    def __init__(self) -> None:
        self.conversations: list[list[dict]] = []

    def apply_chat_template(self, conversation, **kwargs):
        assert kwargs["add_generation_prompt"] and not kwargs["continue_final_message"]
        self.conversations.append(conversation)
        if not kwargs["tokenize"]:
            return json.dumps(conversation)
        return [len(self.conversations)] * (2 * BS)

    def encode(self, text, add_special_tokens):
        return [0] * add_special_tokens + [len(self.conversations)] * (2 * BS)


def hf_hasher(content_format: str = "string") -> tuple[PromptHasher, _Template]:
    from sluice_server.router.prompts import _HfTokens

    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {}}  # fmt: skip
    tok = _Template()
    hasher = PromptHasher.from_description(
        {**desc, "tokenizer": {"kind": "hf", "class": "X", "chat_template": "t",
                               "content_format": content_format}},
        files_dir=Path("."), load_tokenizer=lambda cls, folder: tok,
    )  # fmt: skip
    assert hasher is not None and isinstance(hasher.tokens, _HfTokens)
    return hasher, tok


def rendered(path: str, body: dict, content_format: str = "string") -> list[dict] | None:
    """The conversation the router renders for a vLLM model (None: not hashed)."""
    hasher, tok = hf_hasher(content_format)
    if hasher.hashes(path, json.dumps(body).encode(), None) is None:
        return None
    (conversation,) = tok.conversations
    return conversation


def test_responses_are_rendered_as_vllms_chat():
    """`construct_input_messages`: instructions as the system message, a string input as
    one user message, message items with `input_text` parts as text parts."""
    sys_ = {"role": "system", "content": "Be terse."}
    assert rendered("/v1/responses", {"instructions": "Be terse.", "input": "Hi there"}) == [
        sys_, {"role": "user", "content": "Hi there"}]  # fmt: skip
    assert rendered("/v1/responses", {"instructions": "", "input": "Hi"}) == [
        {"role": "user", "content": "Hi"}]  # fmt: skip
    items = {"input": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]}  # fmt: skip
    assert rendered("/v1/responses", items) == [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "a\nb"}]  # fmt: skip
    assert rendered("/v1/responses", items, "openai")[2] == {
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}  # fmt: skip


def test_anthropic_messages_are_rendered_as_vllms_chat():
    """`to_chat_completion_request`: the system blocks' texts joined with "" (Claude Code's
    billing header block dropped), one text block as a string, several as text parts."""
    body = {"max_tokens": 4,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                       {"type": "text", "text": "You are "},
                       {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": [{"type": "text", "text": "Yes"}]},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": ""},
                                                      {"type": "text", "text": "b"}]}]}  # fmt: skip
    assert rendered("/v1/messages", body) == [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yes"}, {"role": "user", "content": "a\nb"}]  # fmt: skip
    plain = {"max_tokens": 4, "system": "S", "messages": [{"role": "user", "content": "Hi"}]}
    assert rendered("/v1/messages", plain) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]  # fmt: skip


def test_what_the_router_cannot_render_for_a_vllm_model_is_none():
    """Tools, images, reasoning, stored history, options that change the prompt."""
    text = {"type": "input_text", "text": "a"}
    image = {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}
    for body in [
        {"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"input": "Hi", "tool_choice": "required"},
        {"input": "Hi", "previous_response_id": "resp_1"},
        {"input": "Hi", "reasoning": {"effort": "low"}},
        {"input": "Hi", "chat_template_kwargs": {"enable_thinking": False}},
        {"input": "Hi", "truncation": "auto"},
        {"input": "Hi", "kv_transfer_params": {"do_remote_prefill": True}},
        {"input": [{"role": "user", "content": [text, image]}]},
        {"input": [{"role": "developer", "content": "d"}]},
        {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]},
        {"input": [{"role": "assistant", "content": "x", "status": "in_progress"}]},
        {"input": [{"type": "reasoning", "id": "r", "summary": []}]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
        {"input": []},
        {"instructions": 3, "input": "Hi"},
    ]:
        assert rendered("/v1/responses", body) is None, body
    hi = [{"role": "user", "content": "Hi"}]
    for body in [
        {"messages": hi, "tools": [{"name": "f", "input_schema": {}}]},
        {"messages": hi, "tool_choice": {"type": "auto"}},
        {"messages": hi, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"messages": hi, "output_config": {"effort": "low"}},
        {"messages": hi, "chat_template_kwargs": {"x": 1}},
        {"messages": [*hi, {"role": "system", "content": "inline"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
                    ],
                }
            ]
        },
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}],
                }
            ]
        },
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        {"system": [{"type": "image", "source": {}}], "messages": hi},
        {"system": "x-anthropic-billing-header: cc=1;\nS", "messages": hi},
        {"messages": []},
    ]:
        assert rendered("/v1/messages", {"max_tokens": 4, **body}) is None, body


def test_a_chat_vllm_renders_otherwise_than_by_its_template_gets_no_hasher(tmp_path):
    """gpt-oss chats go through Harmony, not the template: the pod says so and the router
    places such a model by load."""
    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {},
            "tokenizer": {"kind": "hf", "class": "Any", "chat_template": "{{ x }}",
                          "content_format": "string", "chat_rendering": "template",
                          "default_chat_template_kwargs": {}}}  # fmt: skip

    def loaded(cls: str, folder):
        return object()  # a stand-in tokenizer: only whether a hasher is made matters

    assert PromptHasher.from_description(desc, tmp_path, loaded) is not None  # control
    harmony = {**desc, "tokenizer": {**desc["tokenizer"], "chat_rendering": "harmony"}}
    assert PromptHasher.from_description(harmony, tmp_path, loaded) is None


def test_the_servers_default_template_arguments_reach_the_template(tmp_path):
    """vLLM renders every chat with the server's default template arguments (under the
    request's own): the router renders with them too."""
    seen: list[dict] = []

    class Recording:
        def apply_chat_template(self, conversation, **kwargs):
            seen.append(kwargs)
            return [7] * (2 * BS)

    desc = {"enabled": True, "block_size": BS, "hash_algo": "sha256",
            "none_hash_seed": "vllm-none-hash", "loras": {},
            "tokenizer": {"kind": "hf", "class": "Any", "chat_template": "{{ x }}",
                          "content_format": "string", "chat_rendering": "template",
                          "default_chat_template_kwargs": {"enable_thinking": False,
                                                           "add_generation_prompt": False}}}  # fmt: skip
    h = PromptHasher.from_description(desc, tmp_path, lambda cls, folder: Recording())
    assert h is not None
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert h.hashes("/v1/chat/completions", body, None)
    assert seen[-1]["enable_thinking"] is False
    assert seen[-1]["add_generation_prompt"] is True  # the request's (default) decides
