"""Who is calling: an API key from the key file or a JWT checked against the JWKS file
(either, both, or neither: then everyone is anonymous with the flags' plan).

A credential that looks like a JWT goes to the JWT verifier when one is configured;
anything else is an API key. A caller's tenant weight is the tenant's one weight, wherever
the caller came from: the key file's (which holds `--tenant-weights` too), else the flag's,
else 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .apikeys import KeyStore, anonymous, authenticate, missing_credential
from .identity import ANONYMOUS_TENANT, CallerRules, Plan, Principal
from .jwks import JwtVerifier, looks_like_jwt


@dataclass
class Credentials:
    keys: KeyStore | None = None
    jwt: JwtVerifier | None = None
    # The plan of keys the file gives none and tokens without limit claims, the priority
    # classes and --tenant-weights.
    rules: CallerRules = field(default_factory=CallerRules)

    @property
    def plan(self) -> Plan:
        return self.rules.plan

    @property
    def enabled(self) -> bool:
        return self.keys is not None or self.jwt is not None

    def weight_of(self, tenant: str) -> int:
        if self.keys is not None and tenant in self.keys.weights:
            return self.keys.weights[tenant]
        return self.rules.weights.get(tenant, 1)

    def authenticate(self, presented: str | None) -> Principal:
        """The caller, or ApiError 401 (counted by the caller)."""
        if not self.enabled:
            rules = self.rules
            return anonymous(rules.plan, rules.priorities.default, self.weight_of(ANONYMOUS_TENANT))
        if presented is None:
            raise missing_credential()
        if self.jwt is not None and (self.keys is None or looks_like_jwt(presented)):
            who = self.jwt.verify(presented)
            weight = self.weight_of(who.tenant)
            return who if weight == who.weight else replace(who, weight=weight)
        return authenticate(self.keys, presented)
