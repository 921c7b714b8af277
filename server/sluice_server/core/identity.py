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
    # The served names (base, LoRA adapters) this caller may use; None: every one.
    models: frozenset[str] | None = None

    def may_use(self, model: str) -> bool:
        """Whether this caller may name `model` (generate with it, see it in /v1/models)."""
        return self.models is None or model in self.models


# A served model name in a key file's `models=` or a token's `models` claim.
MODEL_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/:-]{0,126}[A-Za-z0-9])?")


def parse_models(value: str) -> frozenset[str]:
    """`a,b` -> {a, b}; ValueError for an empty list or a name that cannot be served."""
    names = [n for n in value.split(",") if n]
    if not names or not all(MODEL_NAME.fullmatch(n) for n in names):
        raise ValueError(f"models must be served names separated by commas ({MODEL_NAME.pattern})")
    return frozenset(names)


ANONYMOUS_TENANT = "anonymous"
DEFAULT_TENANT = "default"
NO_LIMITS = Plan()
