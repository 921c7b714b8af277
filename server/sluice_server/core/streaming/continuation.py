"""Streams that outlive their pod: event ids for the router, and continuing a generation
another replica started (the contract is in docs/migration.md).

Event ids. On a connection from the router (`X-Sluice-Router`) every SSE write of a stream
ends with a frame that carries `<stream>:<n>;<token ids>`: `n` is the index of that frame
among the stream's SSE events (from 0), the token ids (decimal, comma-separated, possibly
none) are those whose text the write carried. On `/v1/stream` it is the frame's `id:` field
(`<stream>` is the stream's id, as for `Last-Event-ID`); on the APIs the engine renders it
is a comment line, `: sluice-id <value>` (`with_mark`), and `<stream>` the response id the
frames carry, with `@<created>` when the API has a creation time (OpenAI chat and
completions, Responses). Only a pod that takes continuations (`--continuation-key-file`)
marks its streams (`marked`): requests without the header, and every request to a pod
without the key, get the bytes they always got.

Continuation. A second replica given the request, the token ids the client received, the
next event index, the response id and creation time renders the rest of the same stream.
One mechanism for every protocol: the engine replays the received tokens as if it had just
generated them (`StreamRequest.resume_ids`, `ApiServing.respond(resume=...)`), then
generates after prompt + them; the serving layer renders the whole answer (so usage counts
the prompt once and every completion token, and Responses' final text is whole); and
`continued` drops what the replay rendered (every Delta whose `completion_tokens` is at
most the replayed count: the opening events and the replayed text), then makes the frames
it keeps the first stream's: its response id, creation time and, for Responses, sequence
numbers. It relies on the serving layer rendering all frames of one engine output before
it asks for the next, which both serving layers do.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...engine.base import Delta

# The request paths a continuation may name (the streamed generating routes).
CONTINUABLE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/stream",
)
SCOPE_KEY = "sluice.continuation"  # the ASGI scope entry the routes read
# The response header of a marked stream: the router reads marks only where it is set (a
# pod without the key, or an older one, marks nothing) and never passes it to the client.
MARKED_HEADER = "x-sluice-marked"
_SEQ = re.compile(rb'(?<!\\)("sequence_number": ?)(\d+)')


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a continuing replica needs beyond the original request."""

    token_ids: list[int]  # the output tokens the client received, in order
    next_event: int  # the index of the first SSE event this replica sends
    response_id: str  # the stream's id (token SSE) or the response id the frames carry
    created: int | None = None  # the first stream's creation time, where the API has one


def marked(continuing: bool, via_router: bool, key_file: Path | None) -> bool:
    """Whether a stream's events carry their position and token ids: a continuation's, and
    one the router forwards to a pod that takes continuations."""
    return continuing or (via_router and key_file is not None)


def not_continuable(path: str, body: dict[str, Any], emitted: int) -> tuple[str, str] | None:
    """(param, why) for a request whose emitted output cannot be replayed exactly."""
    if path != "/v1/stream" and body.get("stream") is not True:
        return "stream", "Only streamed requests are continued (`stream: true`)."
    for name in ("n", "best_of"):
        if isinstance(body.get(name), int) and body[name] > 1:
            return name, f"{name} > 1: several choices are not continued."
    for name in ("logprobs", "top_logprobs", "echo", "use_beam_search"):
        if body.get(name) not in (None, False, 0):
            return name, f"{name}: its output cannot be continued from token ids alone."
    if body.get("tools") and body.get("tool_choice") != "none":
        return (
            "tools",
            "Requests with tools are not continued: the tool-call parser's state is not replayable.",
        )
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "stream_options", "continuous_usage_stats: per-chunk usage is not continued."
    if path == "/v1/completions" and not isinstance(body.get("prompt"), str):
        return "prompt", "Only a single string prompt is continued."
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(name)
        if isinstance(v, int) and v <= emitted:
            return "token_ids", (
                f"The stream already received {emitted} tokens of its {name}={v}: "
                "nothing is left to generate."
            )
    return None


def event_id(stream: str, index: int, ids: Sequence[int] | None) -> str:
    """The `id:` field's value for the router: `<stream>:<n>;<ids>`."""
    return f"{stream}:{index};{','.join(map(str, ids or ()))}"


def stream_name(response_id: str, created: int | None) -> str:
    return response_id if created is None else f"{response_id}@{created}"


MARK = ": sluice-id "  # the comment line that carries an event id on the engine's APIs


def with_mark(text: str, value: str) -> str:
    """Framed SSE text with the comment line `: sluice-id <value>` opening its last frame
    (the write's event index). A comment, not an `id:` field: the OpenAI and Anthropic
    Python SDKs, once they have seen an `id:`, turn every later blank line into an event,
    so a keep-alive comment (`: ping`) would reach them as an event with no data, which
    they fail to parse; comments they skip, as every SSE reader must."""
    cut = text.rfind("\n\n", 0, len(text) - 2)
    at = 0 if cut < 0 else cut + 2
    return f"{text[:at]}{MARK}{value}\n{text[at:]}"


def frame_identity(text: str) -> tuple[str | None, int | None]:
    """The response id and creation time the first frame of `text` that names one carries:
    OpenAI chat and completions chunks (`id`, `created`), Responses events (`response.id`,
    `response.created_at`), Anthropic's `message_start` (`message.id`, no time)."""
    for line in text.split("\n"):
        if not line.startswith("data: {"):
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            continue
        for holder, time_key in ((data, "created"), (data.get("response"), "created_at"),
                                 (data.get("message"), None)):  # fmt: skip
            if isinstance(holder, dict) and isinstance(holder.get("id"), str):
                created = holder.get(time_key) if time_key else None
                return holder["id"], created if isinstance(created, int) else None
    return None, None


async def continued(
    source: AsyncIterator[Delta], cont: Continuation, framed: bool
) -> AsyncGenerator[Delta, None]:
    """The continuing replica's Deltas without what the replay rendered; with `framed`
    (an API's SSE text) the kept frames carry the first stream's id, time and sequence."""
    k = len(cont.token_ids)
    dropped = 0  # SSE events the replay rendered
    own: tuple[str | None, int | None] | None = None
    fix: list[tuple[str, str]] = []
    try:
        async for d in source:
            if framed and own is None and d.text:
                own = frame_identity(d.text)
                fix = _replacements(own, cont)
            if d.completion_tokens <= k and not d.finished:
                dropped += d.text.count("\n\n")
                continue
            if framed and d.text:
                # The first stream's sequence numbers count the events it sent.
                d.text = _rewritten(d.text, fix, cont.next_event - dropped)
            yield d
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()  # aborts an unfinished engine request at once


def _replacements(own: tuple[str | None, int | None], cont: Continuation) -> list[tuple[str, str]]:
    own_id, own_created = own
    fix = []
    if own_id is not None and own_id != cont.response_id:
        fix.append((json.dumps(own_id), json.dumps(cont.response_id)))
    if own_created is not None and cont.created is not None and own_created != cont.created:
        for key in ("created", "created_at"):
            fix.append((f'"{key}":{own_created}', f'"{key}":{cont.created}'))
            fix.append((f'"{key}": {own_created}', f'"{key}": {cont.created}'))
    return fix


def _rewritten(text: str, fix: list[tuple[str, str]], shift: int) -> str:
    for old, new in fix:
        text = text.replace(old, new)
    if shift and '"sequence_number"' in text:
        raw = _SEQ.sub(lambda m: b"%s%d" % (m.group(1), int(m.group(2)) + shift), text.encode())
        text = raw.decode()
    return text
