"""Who is calling: an API key from the key file or a JWT checked against the JWKS file
(either, both, or neither: then everyone is anonymous with the flags' plan).

A credential that looks like a JWT goes to the JWT verifier when one is configured;
anything else is an API key.
"""

from __future__ import annotations

from dataclasses import dataclass

from .auth import KeyStore, anonymous, authenticate, missing_credential
from .identity import NO_LIMITS, Plan, Principal
from .jwks import JwtVerifier, looks_like_jwt


@dataclass
class Credentials:
    keys: KeyStore | None = None
    jwt: JwtVerifier | None = None
    plan: Plan = NO_LIMITS  # for keys the file gives no plan, tokens without limit claims

    @property
    def enabled(self) -> bool:
        return self.keys is not None or self.jwt is not None

    def authenticate(self, presented: str | None) -> Principal:
        """The caller, or ApiError 401 (counted by the caller)."""
        if not self.enabled:
            return anonymous(self.plan)
        if presented is None:
            raise missing_credential()
        if self.jwt is not None and (self.keys is None or looks_like_jwt(presented)):
            return self.jwt.verify(presented)
        return authenticate(self.keys, presented, self.plan)
