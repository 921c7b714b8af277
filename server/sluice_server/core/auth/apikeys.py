"""API keys from a file, compared in constant time, each with its tenant, plan, priority
class and its tenant's weight.

The key file's one grammar, parsed here and nowhere else (documented for users in
server/README.md, "API keys: tenants, plans, priorities and weights"): a key per line, `#`
comments and blank lines ignored, then `name=value` attributes, each at most once a line:

    sk-plain-key                               # tenant "default", the --rate-limit-* plan
    sk-acme-1  tenant=acme  rpm=600  tpm=200000  priority=interactive  weight=3
    sk-legal   tenant=legal models=legal-v2,base  # only these served names (else 403)

`ATTRIBUTES` is the table: an attribute is one row (its value's shape and a parser that
raises ValueError saying what the value must be) and one `Principal` field. `models=A,B`:
the served names (the base model's, LoRA adapters') the key may use; any other gets 403
`model_not_allowed` (and `/v1/models` lists only these); absent: every served name. A tenant's weight is checked across lines
(and against `--tenant-weights`) once the file is read.

Keys are never logged nor put in metrics: the limiter sees `key_id` (a short hash), metrics
and logs the tenant. A file that cannot be parsed is refused as a whole, with the line
number (never the line) in the message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...names import MAX_WEIGHT, PRIORITY_NAME, TENANT, valid_tenant
from ..errors import ApiError
from .identity import (
    ANONYMOUS_TENANT,
    DEFAULT_PRIORITY,
    DEFAULT_TENANT,
    NO_LIMITS,
    CallerRules,
    Plan,
    Principal,
    parse_models,
)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


# Each parser takes the value's text and raises ValueError saying what the value must be
# (the message follows the attribute's name: "line 3: rpm must be ...").
def _tenant(value: str, rules: CallerRules) -> str:
    if not valid_tenant(value):
        raise ValueError(f"must match {TENANT.pattern}")
    return value


def _whole(value: str, rules: CallerRules) -> int:
    if not value.isdigit():
        raise ValueError("must be a whole number >= 0")
    return int(value)


def _priority(value: str, rules: CallerRules) -> str:
    if not rules.priorities.configured:
        raise ValueError("needs --priority-classes (no priority classes are configured)")
    if PRIORITY_NAME.fullmatch(value) is None or value not in rules.priorities.classes:
        raise ValueError(f"must be one of the priority classes ({rules.priorities.spelled})")
    return value


def _models(value: str, rules: CallerRules) -> frozenset[str]:
    return parse_models(value)


def _weight(value: str, rules: CallerRules) -> int:
    if not value.isdigit() or not 1 <= int(value) <= MAX_WEIGHT:
        raise ValueError(f"must be a whole number from 1 to {MAX_WEIGHT}")
    return int(value)


# name -> (what its value looks like, parser: value text -> value, ValueError saying why).
ATTRIBUTES: dict[str, tuple[str, Callable[[str, CallerRules], Any]]] = {
    "tenant": ("NAME", _tenant),
    "rpm": ("N", _whole),
    "tpm": ("N", _whole),
    "models": ("A,B", _models),
    "priority": ("CLASS", _priority),
    "weight": ("N", _weight),
}
GRAMMAR = "KEY " + " ".join(f"[{name}={shape}]" for name, (shape, _) in ATTRIBUTES.items())


def parse_key_line(line: str, number: int, rules: CallerRules) -> tuple[str, dict[str, Any]] | None:
    """(key, attributes) of one line, None for a blank or comment line; ValueError naming
    the line number (never its text: it holds a key)."""
    text = line.split(" #", 1)[0].strip()
    if not text or text.startswith("#"):
        return None
    key, *fields = text.split()
    attrs: dict[str, Any] = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or name not in ATTRIBUTES or name in attrs:
            raise ValueError(f"line {number}: expected `{GRAMMAR}`, each attribute once")
        try:
            attrs[name] = ATTRIBUTES[name][1](value, rules)
        except ValueError as e:
            raise ValueError(f"line {number}: {name} {e}") from None
    return key, attrs


def _tenant_weights(lines: list[tuple[int, dict[str, Any]]], rules: CallerRules) -> dict[str, int]:
    """Each tenant's one weight: its lines' `weight=` and `--tenant-weights` must agree."""
    weights = dict(rules.weights)
    given: dict[str, tuple[int, str]] = {t: (w, "--tenant-weights") for t, w in weights.items()}
    for number, attrs in lines:
        if "weight" not in attrs:
            continue
        tenant, weight = attrs.get("tenant", DEFAULT_TENANT), attrs["weight"]
        if tenant in given and given[tenant][0] != weight:
            w, where = given[tenant]
            raise ValueError(
                f"line {number}: tenant {tenant} gets weight {weight} here and "
                f"{w} on {where}: one tenant has one weight"
            )
        given.setdefault(tenant, (weight, f"line {number}"))
        weights[tenant] = weight
    return weights


class KeyStore:
    def __init__(self, keys: dict[str, Principal]) -> None:
        if not keys:
            raise ValueError("the API key file holds no keys")
        self._keys = [(k.encode(), who) for k, who in keys.items()]
        self.weights: dict[str, int] = {}  # tenant -> weight, from the file and the flags

    @classmethod
    def parse(cls, text: str, rules: CallerRules | Plan = NO_LIMITS) -> KeyStore:
        """`rules` (a bare `Plan` reads as rules with just that plan)."""
        if isinstance(rules, Plan):
            rules = CallerRules(plan=rules)
        lines: list[tuple[int, str, dict[str, Any]]] = []
        seen: set[str] = set()
        for number, line in enumerate(text.splitlines(), 1):
            entry = parse_key_line(line, number, rules)
            if entry is None:
                continue
            if entry[0] in seen:
                raise ValueError(f"line {number}: the same key appears twice")
            seen.add(entry[0])
            lines.append((number, *entry))
        weights = _tenant_weights([(n, attrs) for n, _, attrs in lines], rules)
        keys: dict[str, Principal] = {}
        for _, key, attrs in lines:
            tenant = attrs.get("tenant", DEFAULT_TENANT)
            plan = Plan(attrs.get("rpm", rules.plan.rpm), attrs.get("tpm", rules.plan.tpm))
            priority = rules.priorities.resolve(attrs.get("priority"))
            keys[key] = Principal(
                key_id(key), tenant, plan, priority, weights.get(tenant, 1), attrs.get("models")
            )
        store = cls(keys)
        store.weights = weights
        return store

    @classmethod
    def from_file(cls, path: Path, rules: CallerRules | Plan = NO_LIMITS) -> KeyStore:
        return cls.parse(path.read_text(), rules)

    @property
    def tenants(self) -> set[str]:
        return {who.tenant for _, who in self._keys}

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, presented: str | None) -> Principal | None:
        """The matching key's principal, or None. Compares against every key (no early exit)
        so timing reveals neither which key matched nor how much of a key was right."""
        if not presented:
            return None
        raw = presented.encode()
        found = None
        for key, who in self._keys:
            if hmac.compare_digest(raw, key):
                found = who
        return found


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def anonymous(plan: Plan, priority: str = DEFAULT_PRIORITY, weight: int = 1) -> Principal:
    return Principal("anonymous", ANONYMOUS_TENANT, plan, priority, weight)


def missing_credential() -> ApiError:
    return ApiError(
        401,
        "Missing API key: send `Authorization: Bearer <key>`.",
        reason="auth",
        code="missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def authenticate(keys: KeyStore | None, presented: str | None, plan: Plan = NO_LIMITS) -> Principal:
    """The caller (anonymous, with `plan`, when auth is off); 401 otherwise."""
    if keys is None:
        return anonymous(plan)
    if presented is None:
        raise missing_credential()
    who = keys.match(presented)
    if who is None:
        raise ApiError(
            401,
            "Invalid API key.",
            reason="auth",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return who
