"""API keys from a file, compared in constant time, each with its tenant and plan.

One key per line; `#` comments and blank lines are ignored. After the key, optional
`name=value` fields give that key its own limits and tenant:

    sk-plain-key                               # tenant "default", the --rate-limit-* plan
    sk-acme-1  tenant=acme  rpm=600  tpm=200000
    sk-free    tenant=free  rpm=10                # tpm: --rate-limit-tpm

`rpm`/`tpm` of 0 turn that limit off for the key. Keys are never logged nor put in
metrics: the limiter sees `key_id` (a short hash), metrics and logs the tenant. A file
that cannot be parsed is refused as a whole, with the line number (never the line) in the
message.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from .errors import ApiError
from .identity import (
    ANONYMOUS_TENANT,
    DEFAULT_TENANT,
    NO_LIMITS,
    TENANT,
    Plan,
    Principal,
    valid_tenant,
)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_line(line: str, number: int, default: Plan) -> tuple[str, Principal] | None:
    """(key, principal) of one line, None for a blank or comment line; ValueError naming
    the line number (never its text: it holds a key)."""
    text = line.split(" #", 1)[0].strip()
    if not text or text.startswith("#"):
        return None
    key, *fields = text.split()
    tenant, rpm, tpm = DEFAULT_TENANT, default.rpm, default.tpm
    seen = set()
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or name not in ("tenant", "rpm", "tpm") or name in seen:
            raise ValueError(f"line {number}: expected `KEY [tenant=NAME] [rpm=N] [tpm=N]`")
        seen.add(name)
        if name == "tenant":
            if not valid_tenant(value):
                raise ValueError(f"line {number}: tenant must match {TENANT.pattern}")
            tenant = value
        elif not value.isdigit():
            raise ValueError(f"line {number}: {name} must be a whole number >= 0")
        elif name == "rpm":
            rpm = int(value)
        else:
            tpm = int(value)
    return key, Principal(key_id(key), tenant, Plan(rpm, tpm))


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
