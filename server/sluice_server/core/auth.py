"""API keys from a file (one per line, `#` comments), compared in constant time.

Keys are never logged; the rate limiter and logs see only `key_id` (a short hash).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from .errors import ApiError


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyStore:
    def __init__(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("the API key file holds no keys")
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: Path) -> KeyStore:
        lines = path.read_text().splitlines()
        return cls([s for line in lines if (s := line.strip()) and not s.startswith("#")])

    def match(self, presented: str | None) -> str | None:
        """key_id of the matching key, or None. Compares against every key (no early exit)
        so timing reveals neither which key matched nor how much of a key was right."""
        if not presented:
            return None
        raw = presented.encode()
        found = None
        for key in self._keys:
            if hmac.compare_digest(raw, key):
                found = key
        return key_id(found.decode()) if found is not None else None


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def authenticate(keys: KeyStore | None, presented: str | None) -> str:
    """The caller's key_id ("anonymous" when auth is off); 401 otherwise."""
    if keys is None:
        return "anonymous"
    if presented is None:
        raise ApiError(
            401,
            "Missing API key: send `Authorization: Bearer <key>`.",
            reason="auth",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    kid = keys.match(presented)
    if kid is None:
        raise ApiError(
            401,
            "Invalid API key.",
            reason="auth",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return kid
