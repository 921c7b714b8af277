"""The `sluice-pin` cookie: how a resumed token SSE stream comes back, through any router
pod, to the model pod that holds it (pure).

A token SSE stream the router sent to a pod gets `Set-Cookie: sluice-pin=<pod>.<expiry>.<mac>`
on its 200, the MAC an HMAC-SHA256 over (model key, pod name, expiry) with the key of
`--pin-key-file` (one Secret shared by every router pod). A reconnect with `Last-Event-ID`
and a valid cookie goes to that pod while it is a candidate of that model (`Upstream.pick`):
the cookie names a pod, never an address, so it can only choose among the model's own
Ready pods. A cookie that is malformed, forged, for another model or past its expiry is
ignored (the request is placed as any other), never an error: a client cannot tell a
pin that lapsed from one it never had.

The key is rotated without a restart (`rotate`, from the router's reload of the key file
when the Secret changes): new cookies are signed with the new key, and cookies signed with
the key before it are still honoured, so the pins of streams running across a rotation
stay valid, and replicas whose mounted Secret the kubelet updates a little apart accept
each other's cookies signed with the old key meanwhile.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from http.cookies import CookieError, SimpleCookie
from pathlib import Path

COOKIE = "sluice-pin"
MIN_KEY_BYTES = 32


class Pins:
    def __init__(self, key: bytes, seconds: float) -> None:
        self.key, self.seconds = _checked(key), seconds
        self.previous: bytes | None = None  # the key before the last rotation

    @classmethod
    def load(cls, path: Path, seconds: float) -> Pins:
        """The key file's bytes (surrounding whitespace dropped: a Secret edited by hand)."""
        return cls(read_key(path), seconds)

    def rotate(self, key: bytes) -> None:
        """Sign with `key` from now on; the current key is still honoured (not older ones)."""
        if _checked(key) != self.key:
            self.key, self.previous = key, self.key

    def _mac(self, model: str, pod: str, expiry: int, key: bytes | None = None) -> str:
        message = f"{model}\n{pod}\n{expiry}".encode()
        return hmac.new(key or self.key, message, hashlib.sha256).hexdigest()

    def sign(self, model: str, pod: str, now: float | None = None) -> str:
        expiry = int((time.time() if now is None else now) + self.seconds)
        return f"{pod}.{expiry}.{self._mac(model, pod, expiry)}"

    def verify(self, value: str, model: str, now: float | None = None) -> str | None:
        """The pod a cookie value names for `model`; None unless valid and unexpired."""
        pod, _, rest = value.rpartition(".")  # pod names may hold dots: split from the right
        pod, _, expiry_text = pod.rpartition(".")
        mac = rest
        if not pod or not expiry_text.isdigit():
            return None
        expiry = int(expiry_text)
        keys = (self.key,) if self.previous is None else (self.key, self.previous)
        if not any(hmac.compare_digest(mac, self._mac(model, pod, expiry, k)) for k in keys):
            return None
        return pod if expiry > (time.time() if now is None else now) else None

    def pinned(self, headers: list[tuple[bytes, bytes]], model: str) -> str | None:
        """The pod the request's `sluice-pin` cookie names for `model`, if any is valid."""
        for name, value in headers:
            if name != b"cookie":
                continue
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except CookieError:
                continue
            morsel = jar.get(COOKIE)
            if morsel is not None and (pod := self.verify(morsel.value, model)) is not None:
                return pod
        return None

    def set_cookie(self, model: str, pod: str) -> tuple[bytes, bytes]:
        """The `Set-Cookie` header that pins the client to `pod`."""
        value = (
            f"{COOKIE}={self.sign(model, pod)}; Max-Age={int(self.seconds)}; Path=/; "
            "HttpOnly; SameSite=Lax"
        )
        return b"set-cookie", value.encode("latin-1")


def read_key(path: Path) -> bytes:
    """A key file's bytes, surrounding whitespace dropped (OSError when unreadable,
    ValueError when too short)."""
    return _checked(path.read_bytes().strip())


def _checked(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the pin key must have at least {MIN_KEY_BYTES} bytes")
    return key
