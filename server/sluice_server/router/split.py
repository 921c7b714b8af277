"""Which version of a model a conversation goes to when the model shares its traffic with
versions (models.py `split`): a sticky session key, a stable bucket, consecutive ranges by
weight (pure; docs/placement.md, Versions sharing one model name).

A request that names a model with a `split` (models.py: the owner of a public host, and the
versions that share its traffic) goes to one of the versions, chosen per conversation so
that one conversation never bounces between them:

- its session key (`session`): the `X-Sluice-Session` header (any non-empty value up to
  256 bytes; a longer one is refused, 400); else the body's `user` (OpenAI chat,
  completions, Responses, the token stream) or `metadata.user_id` (Anthropic Messages);
  else the caller's credential (tenants.py `credential`, hashed) with the conversation's
  first turn, which every later turn of it repeats: chat (and the token stream's) messages
  up to the first that is not a system or developer message, Anthropic `system` and
  `messages[0]`, Responses `instructions` and its input up to the same point (or the input
  string), completions and the token stream `prompt` (its first 512 characters; a GET's
  from its query). A WebSocket has no body at connect time: the header, else the
  credential, else it goes to the owner.
- its bucket (`bucket`): SHA-256 of the owner's key and the session key, mapped to
  [0, 100) in steps of 1/10,000 of a percent; every router replica computes the same.
- the version (`choose`): each takes the next `weight` of [0, 100) in the split's order,
  the owner first. Raising the last version's weight from 10 to 20 therefore moves only the
  conversations in [80, 90), from the owner to it; none moves the other way. A version not
  in the models file takes no share: its range goes to the owner.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs

from .models import Split
from .tenants import credential

SESSION_HEADER = b"x-sluice-session"
MAX_SESSION_BYTES = 256
FIRST_PROMPT_CHARS = 512
SCALE = 10_000  # buckets per percent
By = Literal["header", "user", "fallback"]
_LEADING_ROLES = frozenset({"system", "developer"})
_ROUTES = (
    ("/v1/chat/completions", "chat"), ("/v1/completions", "completion"),
    ("/v1/responses", "responses"), ("/v1/messages", "messages"), ("/v1/stream", "stream"),
)  # fmt: skip


class BadSession(ValueError):
    """An `X-Sluice-Session` the router does not take (the client's to fix: 400)."""


@dataclass(frozen=True)
class Session:
    key: bytes
    by: By


def conversational(path: str, websocket: bool = False) -> bool:
    """Whether a request on `path` is a conversation's turn, which the owner's split sends
    to a version: the generation routes and WebSocket generations. Any other route
    (`/v1/models`, tokenizing, ...) is the owner's, and is no conversation's pick."""
    return websocket or any(path.endswith(suffix) for suffix, _ in _ROUTES)


def session(
    headers: Iterable[tuple[bytes, bytes]], query: bytes, path: str, body: bytes | None
) -> Session | None:
    """The request's session key and what gave it; `body` None: a WebSocket's connect
    (None when it has neither a session header nor a credential: it goes to the owner).
    The same value as `X-Sluice-Session` or as `user` is the same session."""
    headers = list(headers)
    for name, value in headers:
        if name == SESSION_HEADER and value.strip():
            if len(value) > MAX_SESSION_BYTES:
                raise BadSession(
                    f"X-Sluice-Session has {len(value)} bytes; at most {MAX_SESSION_BYTES}."
                )
            return Session(value.strip(), "header")
    route = next((r for suffix, r in _ROUTES if path.endswith(suffix)), None)
    parsed: Any = None
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the pod answers it (400); the raw bytes stand for the first turn
    if isinstance(parsed, dict) and (user := _user(route, parsed)) is not None:
        return Session(user.encode(), "user")
    cred = credential(headers, query) or b""
    if body is None:
        return Session(b"\0" + cred, "fallback") if cred else None
    if isinstance(parsed, dict):
        turn = _first_turn(route, parsed)
    elif parsed is None and body:
        turn = body[:FIRST_PROMPT_CHARS]
    else:  # a GET (the token stream's EventSource): its prompt is in the query
        turn = _query_prompt(query)
    return Session(b"\0" + cred + b"\0" + turn, "fallback")


def bucket(owner: str, key: bytes) -> int:
    """The session's place in [0, 100 * SCALE): the same on every router replica."""
    digest = hashlib.sha256(owner.encode() + b"\0" + key).digest()
    return (int.from_bytes(digest[:8], "big") * 100 * SCALE) >> 64


def choose(split: Split, at: int, present: Container[str]) -> str:
    """The key of the version whose range holds `at` (a `bucket`); one not `present` (not
    in the models file): the owner."""
    owner = split.versions[0].key
    end = 0
    for version in split.versions:
        end += version.weight * SCALE
        if at < end:
            return version.key if version.key in present else owner
    return owner  # unreachable: the weights sum to 100


def _user(route: str | None, body: dict[str, Any]) -> str | None:
    if route == "messages":
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        user = body.get("user")
    return user if isinstance(user, str) and user else None


def _first_turn(route: str | None, body: dict[str, Any]) -> bytes:
    if route == "messages":
        messages = body.get("messages")
        first = messages[:1] if isinstance(messages, list) else messages
        turn: Any = [body.get("system"), first]
    elif route == "responses":
        given = body.get("input")
        turn = [body.get("instructions"), _opening(given) if isinstance(given, list) else given]
    elif isinstance(body.get("messages"), list):  # chat, and the token stream's messages
        turn = _opening(body["messages"])
    else:  # completions, the token stream: the prompt
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else _dumps(prompt)
        return text[:FIRST_PROMPT_CHARS].encode()
    return _dumps(turn).encode()


def _opening(items: list[Any]) -> list[Any]:
    """The leading system and developer messages and the first after them: what every turn
    of the conversation repeats."""
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("role") in _LEADING_ROLES):
            return items[: i + 1]
    return items


def _query_prompt(query: bytes) -> bytes:
    prompts = parse_qs(query.decode("latin-1")).get("prompt") or [""]
    return prompts[0][:FIRST_PROMPT_CHARS].encode()


def _dumps(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
