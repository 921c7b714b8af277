"""The hook through which the router learns a request's prompt blocks: `PromptHashes`.

A provider is given a request as the router received it (path, raw body) and the tenant
whose `cache_salt` the pod applies to its caller (tenants.py: None for no tenant salt; a
caller whose tenant the router has not learned yet is placed by load without asking), and
returns the block hashes of its prompt, in order, as the model's engine computes them and
its KV events carry them (`kvcache.blockhash.external` of vLLM's chained hashes: the block
size, hash algorithm and seed of the model's engine). None says the prompt's blocks are
unknown (a route the provider does not read, a body it cannot parse): that request is
placed by load alone. A provider that raises counts as None (the request is still served).

The router calls it once per HTTP request, before the request waits for a pod, on a thread
of its own (one: calls never overlap, and the event loop keeps relaying meanwhile);
WebSocket connections are placed without hashes. The router itself never parses tokens:
the provider is the one place that reads a prompt. The router's own provider is
hashers.py's `ModelHasher` (the hasher a model's pods describe); tests hand it others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias

from .models import Model
from .prefixindex import BlockHash


class PromptHashes(Protocol):
    def __call__(self, path: str, body: bytes, tenant: str | None) -> Sequence[BlockHash] | None:
        """The prompt's block hashes, first block first; None: unknown."""
        ...


# The router's provider per model (None for a model: its requests are placed by load).
HashesFor: TypeAlias = Callable[[Model], PromptHashes | None]
