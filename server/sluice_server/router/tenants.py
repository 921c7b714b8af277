"""Which tenant's `cache_salt` a pod applies to a caller, as the router learns it.

The pod establishes the caller's identity (it holds the keys and the JWT settings; the
router is given no Secret), and salts the caller's prompts with its tenant
(core/auth/cachesalt.py). To hash a prompt as the pod will, the router needs that tenant:
every request it forwards carries `ROUTER_HEADER`, and the pod's answer names the tenant in
`CACHE_TENANT_HEADER` (absent: no tenant salt, with auth off or sharing on). `Tenants`
remembers the answer per credential and the router strips the header before the client
sees the answer.

A credential is remembered by its SHA-256 only, in a bounded LRU: the router keeps no key
or token. A credential not seen yet is *unknown*: its first request is placed by load
alone, and the answer teaches the router. A request with no credential is the anonymous
caller (no tenant salt; with auth on, the pod refuses it anyway). A key whose tenant
changes (a keys file edited) is learned again from its next answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from urllib.parse import unquote

from ..core.auth.cachesalt import CACHE_TENANT_HEADER, ROUTER_HEADER

ROUTER_MARK = (ROUTER_HEADER.encode(), b"1")
TENANT_HEADER = CACHE_TENANT_HEADER.encode()
UNKNOWN = object()  # `Tenants.of`: this credential's tenant is not known yet
DEFAULT_SIZE = 65_536  # credentials remembered per model (about 200 bytes each)


def credential(headers: Iterable[tuple[bytes, bytes]], query: bytes = b"") -> bytes | None:
    """The caller's credential as the pod reads it (`Authorization: Bearer`, else
    `X-API-Key`, else `?api_key=`), hashed; None without one."""
    found = None
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found = token.strip()
                break
        elif k == b"x-api-key" and found is None and v:
            found = v
    if found is None and b"api_key=" in query:
        for part in query.split(b"&"):
            if part.startswith(b"api_key="):
                found = unquote(part[8:].decode("latin-1")).encode("latin-1")
                break
    return None if found is None else hashlib.sha256(found).digest()


class Tenants:
    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.size = size
        self._known: OrderedDict[bytes, str | None] = OrderedDict()

    def of(self, cred: bytes | None) -> str | None | object:
        """The tenant a pod salts this credential's prompts with (None: no tenant salt), or
        `UNKNOWN`."""
        if cred is None:
            return None
        tenant = self._known.get(cred, UNKNOWN)
        if tenant is not UNKNOWN:
            self._known.move_to_end(cred)
        return tenant

    def learn(self, cred: bytes | None, status: int, answer: Iterable[tuple[bytes, bytes]]) -> None:
        """A pod's answer to a request with this credential. Only an accepted request (a
        2xx, or 101 for a WebSocket) says anything: a 401 names no tenant."""
        if cred is None or not (200 <= status < 300 or status == 101):
            return
        tenant = next(
            (unquote(v.decode("latin-1")) for k, v in answer if k.lower() == TENANT_HEADER), None
        )
        self._known[cred] = tenant
        self._known.move_to_end(cred)
        while len(self._known) > self.size:
            self._known.popitem(last=False)

    def __len__(self) -> int:
        return len(self._known)
