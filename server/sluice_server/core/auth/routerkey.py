"""The router's continuation key (`--continuation-key-file`): what lets a caller continue
on this replica a stream another replica started (docs/migration.md). Not an API key: the
client's own credential still names the caller."""

from __future__ import annotations

import hmac
from pathlib import Path

KEY_HEADER = b"x-sluice-continuation-key"


def key_refusal(key_file: Path | None, given: bytes | None) -> tuple[int, str] | None:
    """None when `given` is the key in `key_file` (its first line; read each time, so a
    rotated Secret applies at once), else (status, message): 404 with no key file, 401
    without the header, 403 for another key, 503 when the file cannot be read."""
    if key_file is None:
        return 404, "Continuations are not served here (no --continuation-key-file)."
    if given is None:
        return 401, "X-Sluice-Continuation-Key is missing."
    try:
        key = key_file.read_bytes().split(b"\n", 1)[0].strip()
    except OSError as e:
        return 503, f"The continuation key cannot be read: {e}."
    if not key or not hmac.compare_digest(given.strip(), key):
        return 403, "X-Sluice-Continuation-Key is not this model's key."
    return None


def model_key(master: bytes, namespace: str, name: str) -> bytes:
    """One model's continuation key, derived from the router's master key: what the
    operator writes into the model's own Secret (`<name>-continuation-key`) and what the
    router sends to that model's pods. Each namespace holds only its models' keys, and the
    router needs no Secret but its own. Hex of HMAC-SHA256(master, "<namespace>/<name>")."""
    return hmac.new(master.strip(), f"{namespace}/{name}".encode(), "sha256").hexdigest().encode()
