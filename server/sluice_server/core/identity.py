"""Who is calling and what they may use: a `Principal` with its tenant and `Plan`.

Limits are keyed by `Principal.id` (a hash for API keys, never the key itself); metrics and
logs name the `tenant` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def valid_tenant(name: str) -> bool:
    """Tenants become metric labels: short, plain names only."""
    return TENANT.fullmatch(name) is not None


@dataclass(frozen=True)
class Plan:
    """Requests and tokens per minute; 0 turns a limit off."""

    rpm: int = 0
    tpm: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)


@dataclass(frozen=True)
class Principal:
    id: str
    tenant: str
    plan: Plan


ANONYMOUS_TENANT = "anonymous"
DEFAULT_TENANT = "default"
NO_LIMITS = Plan()
