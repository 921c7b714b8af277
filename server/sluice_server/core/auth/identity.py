"""Who is calling and what they may use: a `Principal` with its tenant, `Plan`, priority
class and its tenant's weight.

Limits are keyed by `Principal.id` (a hash for API keys, never the key itself); metrics and
logs name the `tenant` only. `Priorities` are the priority classes the server was started
with (highest first): fixed for the process, because the engine's scheduling policy is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...names import check_priority_classes


@dataclass(frozen=True)
class Plan:
    """Requests and tokens per minute; 0 turns a limit off."""

    rpm: int = 0
    tpm: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)


DEFAULT_PRIORITY = "default"  # the one class when none are configured


@dataclass(frozen=True)
class Priorities:
    """The priority classes, highest first, and the class of a caller that names none.
    Without classes there is one, `default`, and every caller is in it."""

    classes: tuple[str, ...] = ()
    default_class: str | None = None

    def __post_init__(self) -> None:
        check_priority_classes(self.classes)
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(
                f"default priority {self.default_class!r} is not one of the "
                f"priority classes ({self.spelled})"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return self.classes or (DEFAULT_PRIORITY,)

    @property
    def configured(self) -> bool:
        return bool(self.classes)

    @property
    def default(self) -> str:
        """`--default-priority`, else the lowest class."""
        return self.default_class or self.names[-1]

    @property
    def spelled(self) -> str:
        return ", ".join(self.classes) or "none configured: --priority-classes"

    def resolve(self, name: str | None) -> str:
        """The class a caller is in: `name`, or the default when it names none;
        ValueError for a name that is not a class."""
        if name is None:
            return self.default
        if name not in self.classes:
            raise ValueError(
                f"priority {name!r} is not one of the priority classes ({self.spelled})"
            )
        return name

    def rank(self, name: str) -> int:
        """0 for the highest class: the engine's priority value (lower runs first)."""
        return self.names.index(name)


@dataclass(frozen=True)
class Principal:
    id: str
    tenant: str
    plan: Plan
    priority: str = DEFAULT_PRIORITY  # its priority class
    weight: int = 1  # its tenant's share of the pod, against other tenants' weights
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
        raise ValueError(f"must be served names separated by commas ({MODEL_NAME.pattern})")
    return frozenset(names)


ANONYMOUS_TENANT = "anonymous"
DEFAULT_TENANT = "default"
NO_LIMITS = Plan()
NO_PRIORITIES = Priorities()


@dataclass(frozen=True)
class CallerRules:
    """What credentials are read against: the plan of a caller that names no limits, the
    priority classes, and tenants' weights given by `--tenant-weights`."""

    plan: Plan = NO_LIMITS
    priorities: Priorities = NO_PRIORITIES
    weights: Mapping[str, int] = field(default_factory=dict)
