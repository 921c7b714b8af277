"""A model's versions sharing its traffic (router/models.py `split`, router/split.py): the
file's checks, the session key of every protocol, and the chooser's share and stickiness
over many conversations."""

from __future__ import annotations

import json
import random
from urllib.parse import urlencode

import pytest
from sluice_server.router.models import Split, Version, parse
from sluice_server.router.split import SCALE, BadSession, bucket, choose, session

OWNER, CANARY = "team-a/chat", "team-a/chat-v2"


def split_file(*weights: int, keys=(OWNER, CANARY)) -> dict:
    versions = [{"model": k, "weight": w} for k, w in zip(keys, weights, strict=True)]
    return {
        OWNER: {"host": "chat.team-a.svc", "split": {"versions": versions}},
        CANARY: {"host": "chat-v2.team-a.svc"},
    }


def test_a_split_is_read_with_the_owner_first():
    models = parse(split_file(90, 10))
    owner = models.by_key[OWNER]
    assert owner.split == Split((Version(OWNER, 90), Version(CANARY, 10)))
    assert models.by_key[CANARY].split is None
    assert models.find("chat.team-a.svc", None) is owner  # the owner's host: split
    assert models.find(None, CANARY) is models.by_key[CANARY]  # a version named directly


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ([{"model": OWNER, "weight": 90}, {"model": CANARY, "weight": 20}],
         "split weights must sum to 100, not 110 (team-a/chat=90, team-a/chat-v2=20)"),
        ([{"model": CANARY, "weight": 10}, {"model": OWNER, "weight": 90}],
         "must list the owner 'team-a/chat' first, not 'team-a/chat-v2'"),
        ([{"model": OWNER, "weight": 90}, {"model": "chat-v2", "weight": 10}],
         "split version 'chat-v2' must be <namespace>/<name>"),
        ([{"model": OWNER, "weight": 50}, {"model": OWNER, "weight": 50}],
         "lists team-a/chat more than once"),
        ([{"model": OWNER, "weight": 110}, {"model": CANARY, "weight": -10}],
         "split.versions.0.weight: Input should be less than or equal to 100"),
        ([{"model": OWNER, "weight": 90.5}, {"model": CANARY, "weight": 9.5}],
         "split.versions.0.weight: Input should be a valid integer"),
        ([], "split.versions: List should have at least 1 item"),
    ],
)  # fmt: skip
def test_a_split_the_router_cannot_use_is_named(versions, message):
    data = split_file(0, 0)
    data[OWNER]["split"] = {"versions": versions}
    with pytest.raises(ValueError, match="entry 'team-a/chat': .*" + _re(message)):
        parse(data)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_each_version_takes_the_next_range_and_a_missing_one_goes_to_the_owner():
    split = Split((Version(OWNER, 80), Version("team-a/b", 10), Version(CANARY, 10)))
    present = {OWNER, "team-a/b", CANARY}
    assert choose(split, 0, present) == OWNER
    assert choose(split, 80 * SCALE - 1, present) == OWNER
    assert choose(split, 80 * SCALE, present) == "team-a/b"
    assert choose(split, 90 * SCALE, present) == CANARY
    assert choose(split, 100 * SCALE - 1, present) == CANARY
    assert choose(split, 85 * SCALE, {OWNER, CANARY}) == OWNER  # b is not in the file
    zero = Split((Version(OWNER, 100), Version(CANARY, 0)))
    assert {choose(zero, at, present) for at in range(0, 100 * SCALE, 997)} == {OWNER}


def conversation(kind: str, i: int) -> list[tuple[str, dict, dict, bytes]]:
    """Turns of conversation `i` with a session key of `kind`: (path, headers, body, query)."""
    headers = {"authorization": f"Bearer key-{i % 7}"}
    system = {"role": "system", "content": "You are helpful."}
    turns = []
    history: list[dict] = [system]
    for turn in range(2 + i % 2):  # 2 or 3 turns
        history = [*history, {"role": "user", "content": f"question {turn} of {i}"}]
        if kind == "header":
            turns.append(("/v1/chat/completions", {"x-sluice-session": f"s-{i}"},
                          {"messages": list(history)}, b""))  # fmt: skip
        elif kind == "user":
            turns.append(("/v1/chat/completions", {}, {"messages": list(history),
                          "user": f"u-{i}"}, b""))  # fmt: skip
        elif kind == "anthropic-user":
            turns.append(("/v1/messages", {}, {"system": "x", "messages": history[1:],
                          "metadata": {"user_id": f"u-{i}"}}, b""))  # fmt: skip
        elif kind == "chat":
            turns.append(("/v1/chat/completions", headers, {"messages": list(history)}, b""))
        elif kind == "anthropic":
            turns.append(("/v1/messages", headers, {"system": "be brief",
                          "messages": history[1:]}, b""))  # fmt: skip
        elif kind == "responses":
            turns.append(("/v1/responses", headers, {"instructions": "be brief",
                          "input": history[1:]}, b""))  # fmt: skip
        elif kind == "completions":  # a preamble past 512 characters, then the history
            preamble = f"Notes of conversation {i}. " + "context " * 64
            prompt = preamble + " ".join(m["content"] for m in history[1:])
            turns.append(("/v1/completions", headers, {"prompt": prompt}, b""))
        elif kind == "tokens-get":
            turns.append(("/v1/stream", headers, {},
                          urlencode({"prompt": f"question 0 of {i}", "max_tokens": turn + 1})
                          .encode()))  # fmt: skip
        history = [*history, {"role": "assistant", "content": f"answer {turn}"}]
    return turns


KINDS = ("header", "user", "anthropic-user", "chat", "anthropic", "responses", "completions",
         "tokens-get")  # fmt: skip


def version_of(split: Split, path: str, headers: dict, body: dict, query: bytes) -> tuple:
    raw = json.dumps(body).encode() if body else b""
    hdrs = [(k.encode(), v.encode()) for k, v in headers.items()]
    s = session(hdrs, query, path, raw)
    assert s is not None
    return choose(split, bucket(OWNER, s.key), {OWNER, CANARY}), s.by


def test_1000_conversations_share_10_percent_and_none_splits():
    split = parse(split_file(90, 10)).by_key[OWNER].split
    assert split is not None
    canary, by = 0, set()
    for i in range(1000):
        kind = KINDS[i % len(KINDS)]
        chosen = {version_of(split, *turn) for turn in conversation(kind, i)}
        assert len({v for v, _ in chosen}) == 1, (kind, i, chosen)  # never split
        (version, how), *_ = chosen
        by.add(how)
        canary += version == CANARY
    assert by == {"header", "user", "fallback"}
    print(f"split: {canary} of 1000 conversations on the version at weight 10")
    assert 70 <= canary <= 130  # 10% +- 3%


def test_raising_a_weight_moves_conversations_only_towards_the_version():
    before = parse(split_file(90, 10)).by_key[OWNER].split
    after = parse(split_file(50, 50)).by_key[OWNER].split
    assert before is not None and after is not None
    rng = random.Random(7)
    moved = 0
    for _ in range(2000):
        at = bucket(OWNER, rng.randbytes(16))
        old, new = choose(before, at, {OWNER, CANARY}), choose(after, at, {OWNER, CANARY})
        assert not (old == CANARY and new == OWNER)
        moved += old != new
    assert 700 <= moved <= 900  # about 40%


def test_the_session_key_in_order_and_a_bad_header_refused():
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "user": "u1"}).encode()
    bearer = (b"authorization", b"Bearer k")
    assert session([(b"x-sluice-session", b"s1"), bearer], b"", "/v1/chat/completions", chat).by \
        == "header"  # fmt: skip
    assert session([bearer], b"", "/v1/chat/completions", chat).by == "user"
    # The same value as a header or as `user` is the same session.
    assert (
        session([(b"x-sluice-session", b"u1")], b"", "/x", None).key
        == session([], b"", "/v1/chat/completions", chat).key
    )
    # `user` is not an Anthropic field: its metadata.user_id is.
    assert session([bearer], b"", "/v1/messages", chat).by == "fallback"
    with pytest.raises(BadSession, match="257 bytes; at most 256"):
        session([(b"x-sluice-session", b"x" * 257)], b"", "/v1/chat/completions", chat)
    assert session([(b"x-sluice-session", b"  ")], b"", "/v1/chat/completions", chat).by == "user"
    # A WebSocket's connect: the header, else the credential, else nothing (the owner).
    assert session([bearer], b"", "/v1/ws", None).by == "fallback"
    assert session([], b"api_key=k", "/v1/ws", None) == session([bearer], b"", "/v1/ws", None)
    assert session([], b"", "/v1/ws", None) is None
    # The fallback: another credential is another conversation; a body that does not parse
    # still has one.
    other = session([(b"authorization", b"Bearer j")], b"", "/v1/completions", b'{"prompt":"a"}')
    mine = session([bearer], b"", "/v1/completions", b'{"prompt":"a"}')
    assert other is not None and mine is not None and other.key != mine.key
    assert session([bearer], b"", "/v1/completions", b"{nope").by == "fallback"
    # Only the first 512 characters of a prompt count.
    long = [json.dumps({"prompt": "a" * 512 + tail}).encode() for tail in ("b", "c")]
    assert session([], b"", "/v1/completions", long[0]) == session([], b"", "/v1/completions",
                                                                   long[1])  # fmt: skip
