"""The prefix cache and tenants: the `cache_salt` a request's prompt is hashed with.

vLLM reuses cached prefixes between requests whose first block hashes alike, and its
`cache_salt` is part of that first block's hash: requests with different salts never share
a cached prefix. Without a salt, a caller could tell from its time to first token whether
another tenant recently sent the same prompt. So each tenant gets its own salt by default:

- `tenant` None (auth is off: every caller is the one anonymous tenant): no salt of ours;
  the client's own `cache_salt`, if it sends one, passes through as vLLM would take it.
- `shared` (`--share-prefix-cache-across-tenants`, for tenants that trust each other): the
  same, every tenant reuses every other's prefixes unless a client salts its own requests.
- otherwise a hash of the tenant and the client's salt together: the client's salt narrows
  its tenant's cache further and never replaces the tenant's part, so no client can name
  its way into another tenant's cache.

A hash rather than the tenant's name in clear: a client's salt is its secret (vLLM reports
salted block hashes in its KV events and may log requests), the result stays within vLLM's
128 characters whatever the client sent, and the tenant and the client's salt cannot run
into each other (`a` + `b:c` against `a:b` + `c`). Tenant names are not secrets: logs and
metrics name the tenant, never a key and never this salt.

Pure (hashlib only, so a router may import it without the server's dependencies): the
server applies it to every generating request (`Services.cache_salt`), and a router that
scores pods by their cached prefixes computes the same salt with the same function.

The caller's identity is established on the pod (it holds the keys and JWT settings; the
router is given no Secret). A router learns each credential's tenant from the pod's first
answer to it: a request carrying `ROUTER_HEADER` is answered with `CACHE_TENANT_HEADER`,
the tenant whose salt the pod applies (percent-encoded; absent when no tenant salt applies:
auth off, or sharing on). The router strips it before the client sees the answer.
"""

from __future__ import annotations

import hashlib

# What vLLM accepts as a client's `cache_salt` (vllm/entrypoints/generate/base/protocol.py,
# validate_cache_salt): a non-empty string of at most 128 characters without these.
MAX_CLIENT_SALT = 128
FORBIDDEN = frozenset("@/\\\x00")
PREFIX = "sluice-tenant-"  # then 32 hex digits (128 bits of SHA-256)
ROUTER_HEADER = "x-sluice-router"  # set by the Sluice router on what it forwards
CACHE_TENANT_HEADER = "x-sluice-cache-tenant"  # the pod's answer to it (see above)


def check_client_salt(salt: object) -> str | None:
    """A client's own `cache_salt` (None: it sent none); ValueError saying what is wrong
    with one vLLM would refuse."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("must be a non-empty string")
    if len(salt) > MAX_CLIENT_SALT or not FORBIDDEN.isdisjoint(salt):
        raise ValueError(
            f"must be at most {MAX_CLIENT_SALT} characters without '@', '/', '\\' or NUL"
        )
    return salt


def cache_salt_for(tenant: str | None, client_salt: str | None, shared: bool) -> str | None:
    """The `cache_salt` the engine hashes a request's prompt with: None (no salt), the
    client's own, or the tenant's combined with the client's (see the module docstring)."""
    if tenant is None or shared:
        return client_salt
    parts = tenant if client_salt is None else f"{tenant}\0{client_salt}"
    return PREFIX + hashlib.sha256(parts.encode()).hexdigest()[:32]
