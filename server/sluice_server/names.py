"""The names flags, key files and tokens share: tenants, priority classes and weights (they
become metric labels and engine priorities, so each has one grammar, checked here)."""

from __future__ import annotations

import re

TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
PRIORITY_NAME = re.compile(r"[a-z][a-z0-9-]{0,30}")
MAX_PRIORITY_CLASSES = 16
MAX_WEIGHT = 1000


def valid_tenant(name: str) -> bool:
    """Tenants become metric labels: short, plain names only."""
    return TENANT.fullmatch(name) is not None


def check_priority_classes(classes: tuple[str, ...] | list[str]) -> None:
    """ValueError unless `classes` are distinct plain names, at most 16."""
    bad = [c for c in classes if PRIORITY_NAME.fullmatch(c) is None]
    if bad:
        raise ValueError(
            f"priority class names must match {PRIORITY_NAME.pattern}: {', '.join(map(repr, bad))}"
        )
    if len(set(classes)) != len(classes):
        raise ValueError("priority classes must not repeat a name")
    if len(classes) > MAX_PRIORITY_CLASSES:
        raise ValueError(f"at most {MAX_PRIORITY_CLASSES} priority classes")


def check_weight(value: int) -> int:
    if isinstance(value, bool) or not 1 <= value <= MAX_WEIGHT:
        raise ValueError(f"a tenant's weight is a whole number from 1 to {MAX_WEIGHT}")
    return value
