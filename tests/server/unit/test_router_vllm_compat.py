"""The router's pure parts against vLLM 0.32's own code (imports vLLM: one module, ~8 s).

* `kvcache.kvevents` decodes what vLLM's `ZmqEventPublisher` sends (its structs, its msgspec
  encoder, its framing), for every event type, and vLLM's decoder reads what ours encodes
  (the simulator engine publishes with our structs).
* `kvcache.blockhash` equals vLLM's request block hasher (`get_request_block_hasher` over a
  real `vllm.v1.request.Request`) on random prompts, with and without a cache salt and a
  LoRA adapter, for every hash algorithm vLLM offers that is installed, under a fixed
  PYTHONHASHSEED and without one.
* `router.prompts` turns Responses and Anthropic Messages requests into the chat messages
  vLLM's own conversions make.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from sluice_server.kvcache import blockhash, kvevents

vllm_events = pytest.importorskip("vllm.distributed.kv_events")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

H1, H2 = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321


def vllm_batches():
    """One batch per event type vLLM sends, with hashes as ints (its default) and bytes."""
    E = vllm_events
    stored = E.BlockStored(
        block_hashes=[H1, H2], parent_block_hash=None, token_ids=list(range(32)),
        block_size=16, lora_id=None, medium=E.MEDIUM_GPU, lora_name=None,
        extra_keys=[("tenant-a",), None], group_idx=0,
    )  # fmt: skip
    stored_lora = E.BlockStored(
        block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32, token_ids=[7] * 16,
        block_size=16, lora_id=3, medium=E.MEDIUM_GPU, lora_name="sql", extra_keys=[("sql",)],
        group_idx=0, session_id="s1",
    )  # fmt: skip
    removed = E.BlockRemoved(block_hashes=[H2], medium=E.MEDIUM_GPU, group_idx=0)
    return [
        E.KVEventBatch(ts=1.5, events=[stored], data_parallel_rank=0),
        E.KVEventBatch(ts=2.5, events=[stored_lora, removed]),
        E.KVEventBatch(ts=3.5, events=[E.AllBlocksCleared()], data_parallel_rank=1),
    ]


def test_our_decoder_reads_what_vllms_publisher_sends():
    """Framed as `ZmqEventPublisher._publisher_thread` frames: topic, 8-byte sequence,
    payload from its own `msgspec.msgpack.Encoder()`."""
    pack = msgspec.msgpack.Encoder()
    kinds = set()
    for seq, batch in enumerate(vllm_batches()):
        frames = [b"kv", seq.to_bytes(8, "big"), pack.encode(batch)]
        got_seq, got = kvevents.decode_message(frames)
        assert got_seq == seq
        assert got.ts == batch.ts and got.data_parallel_rank == batch.data_parallel_rank
        assert len(got.events) == len(batch.events)
        for ours, theirs in zip(got.events, batch.events, strict=True):
            assert type(ours).__name__ == type(theirs).__name__
            kinds.add(type(ours).__name__)
            for name in theirs.__struct_fields__:
                value = getattr(theirs, name)
                mine = getattr(ours, name)
                if name == "extra_keys" and value is not None:  # msgpack has no tuples
                    value = [None if k is None else list(k) for k in value]
                    mine = [None if k is None else list(k) for k in mine]
                assert mine == value, name
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert {f for f in vllm_events.BlockStored.__struct_fields__} == set(
        kvevents.BlockStored.__struct_fields__
    ), "vLLM's BlockStored changed fields: mirror them"
    assert set(vllm_events.BlockRemoved.__struct_fields__) == set(
        kvevents.BlockRemoved.__struct_fields__
    )


def test_vllms_decoder_reads_what_we_encode():
    ours = kvevents.KVEventBatch(
        ts=1.0,
        events=[
            kvevents.BlockStored(
                block_hashes=[H1],
                parent_block_hash=H2,
                token_ids=[1] * 16,
                block_size=16,
                lora_id=None,
                medium=kvevents.MEDIUM_GPU,
                lora_name=None,
            ),
            kvevents.BlockRemoved(block_hashes=[H2], medium=kvevents.MEDIUM_GPU),
            kvevents.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    theirs = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(
        kvevents.encode_batch(ours)
    )
    assert [type(e).__name__ for e in theirs.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared",
    ]  # fmt: skip
    assert theirs.events[0].block_hashes == [H1] and theirs.events[0].parent_block_hash == H2
    assert theirs.events[1].block_hashes == [H2]


def test_malformed_messages_are_refused():
    with pytest.raises(kvevents.KVEventsError):
        kvevents.decode_message([b"", b"\x00" * 8])
    with pytest.raises(kvevents.KVEventsError):
        kvevents.decode_message([b"", b"\x00" * 8, b"\x93not msgpack"])


def installed_algos() -> list[str]:
    algos = []
    for algo in blockhash.HASH_ALGOS:
        try:
            get_hash_fn_by_name(algo)(b"probe")
        except ModuleNotFoundError:  # xxhash is optional for vLLM too
            continue
        algos.append(algo)
    return algos


def vllm_block_hashes(algo, token_ids, *, salt, lora, block_size):
    """vLLM's own: `init_none_hash` (reads PYTHONHASHSEED) and the request block hasher
    over a real `Request`."""
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    request = Request(
        request_id="r", prompt_token_ids=list(token_ids), sampling_params=SamplingParams(),
        pooling_params=None, lora_request=lora, cache_salt=salt,
        block_hasher=kv_cache_utils.get_request_block_hasher(block_size, fn),
    )  # fmt: skip
    return list(request.block_hashes)


@pytest.mark.parametrize("seed", ["0", "1234", None], ids=["seed-0", "seed-1234", "no-seed"])
@pytest.mark.parametrize("algo", installed_algos())
def test_block_hashes_equal_vllms(monkeypatch, algo, seed):
    if seed is None:
        if algo.startswith("xxhash"):
            pytest.skip("vLLM seeds xxhash randomly per process without PYTHONHASHSEED")
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    import os

    hasher = blockhash.BlockHasher(algo, blockhash.none_hash_seed(algo, os.environ))
    assert hasher.none_hash == vllm_none_hash(algo)
    rng = random.Random(f"{algo}-{seed}")
    lora_request = LoRARequest("sql-adapter", 7, "/adapters/sql")
    lora = blockhash.Lora("sql-adapter", "/adapters/sql")
    for case in range(24):
        n = rng.randrange(0, 200)
        ids = [rng.randrange(0, 150_000) for _ in range(n)]
        salt = rng.choice([None, "", "tenant-a", "tenant-b:client-salt"])
        with_lora = case % 3 == 0
        want = vllm_block_hashes(algo, ids, salt=salt, lora=lora_request if with_lora else None,
                                 block_size=16)  # fmt: skip
        got = hasher.block_hashes(ids, cache_salt=salt, lora=lora if with_lora else None)
        assert got == want, (case, n, salt, with_lora)
        assert len(got) == n // 16
    # Controls: the salt, the adapter (its path too) and the seed each change every hash.
    ids = [rng.randrange(0, 150_000) for _ in range(64)]
    plain = hasher.block_hashes(ids)
    assert all(a != b for a, b in zip(plain, hasher.block_hashes(ids, cache_salt="t"), strict=True))
    assert all(a != b for a, b in zip(plain, hasher.block_hashes(ids, lora=lora), strict=True))
    moved = blockhash.Lora("sql-adapter", "/adapters/sql-v2")
    assert hasher.block_hashes(ids, lora=lora) != hasher.block_hashes(ids, lora=moved)
    other = blockhash.BlockHasher(algo, "another-seed")
    assert all(a != b for a, b in zip(plain, other.block_hashes(ids), strict=True))


def vllm_none_hash(algo):
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
    return kv_cache_utils.NONE_HASH


def test_chained_hashes_continue_a_chain():
    """Hashing a prompt's continuation (its output's blocks) from the last prompt block's
    hash gives the hashes of the whole sequence, as vLLM's hasher extends a request."""
    hasher = blockhash.BlockHasher()
    ids = list(range(100))
    whole = hasher.block_hashes(ids, cache_salt="s")
    head = hasher.block_hashes(ids[:48], cache_salt="s")
    tail = hasher.block_hashes(ids[48:96], cache_salt="s", parent=head[-1], start_block=3)
    assert head + tail == whole


def test_external_hash_is_vllms_int_form():
    digest = blockhash.BlockHasher().block_hashes(list(range(16)))[0]
    assert blockhash.external(digest) == kv_cache_utils.maybe_convert_block_hash(digest)


RESPONSES = [
    {"instructions": "Be terse.", "input": "Hi there"},
    {"instructions": "", "input": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "one"},
        {"type": "message", "role": "assistant", "content": "two"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]},
]  # fmt: skip
ANTHROPIC = [
    {"system": "S", "messages": [{"role": "user", "content": "Hi"}]},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                {"type": "text", "text": "You are "},
                {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}}],
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Yes"}]},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": ""},
                                               {"type": "text", "text": "b"}]}]},
]  # fmt: skip


def test_responses_and_anthropic_become_vllms_chat_messages():
    """`router.prompts` turns a Responses or Anthropic request into the chat messages vLLM's
    own conversion makes (`construct_input_messages`, `to_chat_completion_request`); the
    chat rendering after it is the chat route's (checked against the engine)."""
    from sluice_server.router import prompts
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    def chat_form(message: dict) -> dict:
        """What vLLM's chat parsing reads of a Responses message: role and content, with
        `input_text` parts as text parts (`chat_utils.MM_PARSER_MAP`)."""
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "text", "text": p["text"]} for p in content]
        return {"role": message["role"], "content": content}

    for body in RESPONSES:
        req = ResponsesRequest.model_validate({"model": "m", **body})
        theirs = construct_input_messages(request_instructions=req.instructions,
                                          request_input=req.input)  # fmt: skip
        assert prompts._responses_messages(body) == [chat_form(m) for m in theirs], body
    for body in ANTHROPIC:
        body = {"model": "m", "max_tokens": 4, **body}
        req = AnthropicServingMessages.to_chat_completion_request(
            AnthropicMessagesRequest.model_validate(body)
        )
        assert req.add_generation_prompt and not req.continue_final_message
        assert prompts._anthropic_messages(body) == req.messages, body
