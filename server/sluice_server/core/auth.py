"""API keys from a file, compared in constant time, each with its tenant and plan.

One key per line; `#` comments and blank lines are ignored. After the key, optional
`name=value` attributes, each at most once, in any order (this is the one grammar of the
key file; `ATTRIBUTES` lists them):

    sk-plain-key                               # tenant "default", the --rate-limit-* plan
    sk-acme-1  tenant=acme  rpm=600  tpm=200000
    sk-free    tenant=free  rpm=10                # tpm: --rate-limit-tpm
    sk-legal   tenant=legal models=legal-v2,base  # only these served names (else 403)

- `tenant=NAME`: the tenant metrics and logs name (default `default`).
- `rpm=N`, `tpm=N`: that key's requests and tokens per minute (0 turns a limit off).
- `models=A,B`: the served names (the base model's, LoRA adapters') the key may use; any
  other gets 403 `model_not_allowed`, and `/v1/models` lists only these. Absent: every
  served name.

Keys are never logged nor put in metrics: the limiter sees `key_id` (a short hash), metrics
and logs the tenant. A file that cannot be parsed is refused as a whole, with the line
number (never the line) in the message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ApiError
from .identity import (
    ANONYMOUS_TENANT,
    DEFAULT_TENANT,
    NO_LIMITS,
    TENANT,
    Plan,
    Principal,
    parse_models,
    valid_tenant,
)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _tenant(value: str) -> str:
    if not valid_tenant(value):
        raise ValueError(f"tenant must match {TENANT.pattern}")
    return value


def _count(name: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.isdigit():
            raise ValueError(f"{name} must be a whole number >= 0")
        return int(value)

    return parse


# The key file's attributes: name -> parser of its value (ValueError: the line is refused).
ATTRIBUTES: dict[str, Callable[[str], Any]] = {
    "tenant": _tenant,
    "rpm": _count("rpm"),
    "tpm": _count("tpm"),
    "models": parse_models,
}
USAGE = "KEY [tenant=NAME] [rpm=N] [tpm=N] [models=A,B]"


def parse_key_line(line: str, number: int, default: Plan) -> tuple[str, Principal] | None:
    """(key, principal) of one line, None for a blank or comment line; ValueError naming
    the line number (never its text: it holds a key)."""
    text = line.split(" #", 1)[0].strip()
    if not text or text.startswith("#"):
        return None
    key, *fields = text.split()
    given: dict[str, Any] = {}
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or name not in ATTRIBUTES or name in given:
            raise ValueError(f"line {number}: expected `{USAGE}` (each at most once)")
        try:
            given[name] = ATTRIBUTES[name](value)
        except ValueError as e:
            raise ValueError(f"line {number}: {e}") from None
    plan = Plan(given.get("rpm", default.rpm), given.get("tpm", default.tpm))
    who = Principal(key_id(key), given.get("tenant", DEFAULT_TENANT), plan, given.get("models"))
    return key, who


class KeyStore:
    def __init__(self, keys: dict[str, Principal]) -> None:
        if not keys:
            raise ValueError("the API key file holds no keys")
        self._keys = [(k.encode(), who) for k, who in keys.items()]

    @classmethod
    def parse(cls, text: str, default: Plan = NO_LIMITS) -> KeyStore:
        keys: dict[str, Principal] = {}
        for number, line in enumerate(text.splitlines(), 1):
            entry = parse_key_line(line, number, default)
            if entry is None:
                continue
            if entry[0] in keys:
                raise ValueError(f"line {number}: the same key appears twice")
            keys[entry[0]] = entry[1]
        return cls(keys)

    @classmethod
    def from_file(cls, path: Path, default: Plan = NO_LIMITS) -> KeyStore:
        return cls.parse(path.read_text(), default)

    @property
    def tenants(self) -> set[str]:
        return {who.tenant for _, who in self._keys}

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, presented: str | None) -> Principal | None:
        """The matching key's principal, or None. Compares against every key (no early exit)
        so timing reveals neither which key matched nor how much of a key was right."""
        if not presented:
            return None
        raw = presented.encode()
        found = None
        for key, who in self._keys:
            if hmac.compare_digest(raw, key):
                found = who
        return found


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def anonymous(plan: Plan) -> Principal:
    return Principal("anonymous", ANONYMOUS_TENANT, plan)


def missing_credential() -> ApiError:
    return ApiError(
        401,
        "Missing API key: send `Authorization: Bearer <key>`.",
        reason="auth",
        code="missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def authenticate(keys: KeyStore | None, presented: str | None, plan: Plan = NO_LIMITS) -> Principal:
    """The caller (anonymous, with `plan`, when auth is off); 401 otherwise."""
    if keys is None:
        return anonymous(plan)
    if presented is None:
        raise missing_credential()
    who = keys.match(presented)
    if who is None:
        raise ApiError(
            401,
            "Invalid API key.",
            reason="auth",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return who
