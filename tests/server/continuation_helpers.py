"""Reading streams the router relays and splicing a continuation into them, as the router
does: the first replica's SSE events up to a cut, then what `POST /internal/continue` on
another replica sends (docs/migration.md)."""

from __future__ import annotations

import json
import uuid

import httpx

ROUTER = {"X-Sluice-Router": "1"}
KEY = "router-continuation-key"
KEYED = {"X-Sluice-Continuation-Key": KEY}  # a router's request to a pod's internal entries
_WORDS = "river stone lamp forest cloud window garden bridge paper candle".split()


MARK = ": sluice-id "


def fresh_prompt() -> str:
    """About 320-330 tokens of the tiny model, new to every engine's cache (a uuid first)."""
    return uuid.uuid4().hex + " " + " ".join(_WORDS[i % 10] for i in range(75))


def events_of(raw: str) -> list[str]:
    """The SSE events of a response body, comments (pings) left out but the router's
    `: sluice-id` mark."""
    out = []
    for block in raw.split("\n\n"):
        lines = [ln for ln in block.split("\n")
                 if ln and (not ln.startswith(":") or ln.startswith(MARK))]  # fmt: skip
        if lines:
            out.append("\n".join(lines))
    return out


def field_of(event: str, name: str) -> str | None:
    for line in event.split("\n"):
        if line.startswith(name + ": "):
            return line[len(name) + 2 :]
    return None


def mark_of(event: str) -> str | None:
    """The router's event id: the token stream's `id:` field, the APIs' `: sluice-id`."""
    for line in event.split("\n"):
        if line.startswith(MARK):
            return line[len(MARK) :]
    value = field_of(event, "id")
    return value if value is not None and ";" in value else None


def parse_id(value: str) -> tuple[str, int, list[int]]:
    """`<stream>:<n>;<ids>` -> (stream, n, ids)."""
    head, _, ids = value.rpartition(";")
    stream, _, n = head.rpartition(":")
    return stream, int(n), [int(i) for i in ids.split(",") if i]


def split_name(stream: str) -> tuple[str, int | None]:
    """`<response id>@<created>` -> (response id, created)."""
    rid, at, created = stream.rpartition("@")
    return (rid, int(created)) if at and created.isdigit() else (stream, None)


def cut(raw: str, k: int) -> tuple[list[str], dict]:
    """The events a client got before the `k`-th event id (1-based) and what the router
    sends to continue after them."""
    events, seen, ids = events_of(raw), 0, []
    for i, event in enumerate(events):
        value = mark_of(event)
        if value is None:
            continue
        stream, n, tokens = parse_id(value)
        ids += tokens
        seen += 1
        if seen == k:
            rid, created = split_name(stream) if "@" in stream else (stream, None)
            return events[: i + 1], {"token_ids": ids, "next_event": n + 1,
                                     "response_id": rid, "created": created}  # fmt: skip
    raise AssertionError(f"the stream has fewer than {k} event ids")


async def continue_on(
    c: httpx.AsyncClient, path: str, body: dict | None, state: dict, headers: dict | None = None
) -> httpx.Response:
    method = "GET" if body is None else "POST"
    payload = {"method": method, "path": path, "body": body, **state}
    hdrs = {**ROUTER, "X-Sluice-Continuation-Key": KEY, **(headers or {})}
    return await c.post("/internal/continue", json=payload, headers=hdrs)


def datas(events: list[str]) -> list[dict]:
    out = []
    for event in events:
        data = field_of(event, "data")
        if data is not None and data != "[DONE]":
            out.append(json.loads(data))
    return out


def text_and_usage(path: str, events: list[str], strict: bool = True) -> tuple[str, dict | None]:
    """The answer's text (its deltas joined) and its usage, in each protocol's shape;
    `strict`: Responses' final text must be the deltas'."""
    text, usage = [], None
    for d in datas(events):
        if path == "/v1/stream":
            text.append(d.get("token", ""))
            usage = d.get("usage") or usage
        elif path in ("/v1/chat/completions", "/v1/completions"):
            for choice in d.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
            usage = d.get("usage") or usage
        elif path == "/v1/responses":
            if d["type"] == "response.output_text.delta":
                text.append(d["delta"])
            if d["type"] == "response.completed":
                usage = d["response"]["usage"]
                final = d["response"]["output"][0]["content"][0]["text"]
                assert final == "".join(text) or not strict
        elif path == "/v1/messages":
            if d["type"] == "content_block_delta":
                text.append(d["delta"]["text"])
            if d["type"] == "message_delta":
                usage = d["usage"]
    return "".join(text), usage


TERMINAL = {
    "/v1/stream": "data: [DONE]",
    "/v1/chat/completions": "data: [DONE]",
    "/v1/completions": "data: [DONE]",
    "/v1/responses": "event: response.completed",
    "/v1/messages": "event: message_stop",
}


def check_one_stream(path: str, events: list[str]) -> None:
    """What makes the events one stream: every event id's index is the event's position
    (contiguous across a seam), one terminal event, last; one response id and creation time
    throughout; Responses' sequence numbers 0, 1, 2, ..."""
    names = set()
    for i, event in enumerate(events):
        value = mark_of(event)
        if value is not None:
            stream, n, _ = parse_id(value)
            assert n == i, (i, event)
            names.add(stream)
    assert len(names) == 1, names
    terminal = TERMINAL[path]
    assert [terminal in e for e in events].count(True) == 1 and terminal in events[-1]
    ids = set()
    for d in datas(events):
        holder = d.get("response") or d.get("message") or d
        if "id" in holder:
            ids.add((holder["id"], holder.get("created", holder.get("created_at"))))
    assert len(ids) == 1, ids
    if path == "/v1/responses":
        assert [d["sequence_number"] for d in datas(events)] == list(range(len(events)))
