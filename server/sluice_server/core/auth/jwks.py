"""Bearer JWTs verified against a JWKS file: RS256 and ES256 only, `exp`, `nbf`, issuer and
audience checked, claims mapped to a tenant and a plan.

The algorithm comes from our list, never from the token: a token whose header names `none`,
an HMAC algorithm (the HS/RS confusion attack signs with the public key as an HMAC secret)
or anything else is refused before any key is tried, and each key only verifies the
algorithm of its own type (RSA: RS256, EC P-256: ES256). Claims: `exp`, `iss`, `aud` and
`sub` are required; the tenant comes from the configured claim (default `tenant`; absent:
tenant `default`), limits from `rpm`/`tpm` (absent: the `--rate-limit-*` flags), the served
names the token may use from `models` (a list, or one comma-separated string, as the key
file's `models=`; absent: every one), the priority class from the priority claim (default
`priority`; read only when priority classes are configured; absent: the default class; a
name that is no class refuses the token). Limits apply per subject (issuer + `sub`), as they
apply per key. A tenant's weight is never a claim (two tokens could disagree): it comes from
the key file or `--tenant-weights`. Refusals say what was wrong, never the token.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt

from ...names import valid_tenant
from ..errors import ApiError
from .identity import DEFAULT_TENANT, CallerRules, Plan, Principal, parse_models

if TYPE_CHECKING:
    from jwt.algorithms import AllowedPublicKeys

# Key type (and curve) -> the one algorithm that key verifies.
ALGORITHMS: dict[tuple[str | None, str | None], str] = {
    ("RSA", None): "RS256",
    ("EC", "P-256"): "ES256",
}
LEEWAY_SECONDS = 30  # clock skew allowed on exp/nbf


def invalid_token(why: str) -> ApiError:
    return ApiError(
        401,
        f"Invalid token: {why}.",
        reason="auth",
        code="invalid_token",
        headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
    )


def looks_like_jwt(credential: str) -> bool:
    """Three base64url parts, the first a JSON object (`eyJ` is `{"`): API keys never are."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class JwtVerifier:
    def __init__(
        self,
        jwks: dict[str, Any],
        issuer: str,
        audience: str,
        tenant_claim: str = "tenant",
        rules: CallerRules | Plan | None = None,
        priority_claim: str = "priority",
    ) -> None:
        self.issuer, self.audience = issuer, audience
        if isinstance(rules, Plan):
            rules = CallerRules(plan=rules)
        self.rules = rules or CallerRules()
        self.tenant_claim, self.priority_claim = tenant_claim, priority_claim
        self.keys: list[tuple[str | None, str, AllowedPublicKeys]] = []  # (kid, algorithm, key)
        entries = jwks.get("keys") if isinstance(jwks, dict) else None
        if not isinstance(entries, list):
            raise ValueError('a JWKS is a JSON object {"keys": [...]}')
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
                continue
            alg = ALGORITHMS.get((entry.get("kty"), entry.get("crv")))
            if alg is None or entry.get("alg", alg) != alg:
                continue  # not a key type we verify with (HMAC secrets never are)
            if "d" in entry:
                raise ValueError(
                    f"key {n} is a private key: a JWKS for verifying holds public keys only"
                )
            try:
                key = jwt.PyJWK(entry, algorithm=alg).key
            except jwt.PyJWKError as e:
                raise ValueError(f"key {n}: {e}") from None
            self.keys.append((entry.get("kid"), alg, key))
        if not self.keys:
            raise ValueError("the JWKS holds no RS256 or ES256 signing keys")

    @classmethod
    def from_file(
        cls,
        path: Path,
        issuer: str,
        audience: str,
        tenant_claim: str = "tenant",
        rules: CallerRules | Plan | None = None,
        priority_claim: str = "priority",
    ) -> JwtVerifier:
        try:
            jwks = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        return cls(jwks, issuer, audience, tenant_claim, rules, priority_claim)

    def verify(self, token: str) -> Principal:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise invalid_token("malformed") from None
        alg = header.get("alg")
        if alg not in ("RS256", "ES256"):
            raise invalid_token("only RS256 and ES256 are accepted")
        kid = header.get("kid")
        candidates = [k for k in self.keys if k[1] == alg and (kid is None or k[0] == kid)]
        if not candidates:
            raise invalid_token("signed with a key this server does not know")
        for _, _, key in candidates:
            try:
                claims = jwt.decode(
                    token,
                    key,
                    algorithms=[alg],
                    audience=self.audience,
                    issuer=self.issuer,
                    leeway=LEEWAY_SECONDS,
                    options={"require": ["exp", "iss", "aud", "sub"], "verify_nbf": True},
                )
                break
            except jwt.InvalidSignatureError:
                continue
            except jwt.ExpiredSignatureError:
                raise invalid_token("expired") from None
            except jwt.ImmatureSignatureError:
                raise invalid_token("not valid yet (nbf)") from None
            except jwt.InvalidAudienceError:
                raise invalid_token("wrong audience") from None
            except jwt.InvalidIssuerError:
                raise invalid_token("wrong issuer") from None
            except jwt.MissingRequiredClaimError as e:
                raise invalid_token(f"no `{e.claim}` claim") from None
            except jwt.PyJWTError:
                raise invalid_token("malformed") from None
        else:
            raise invalid_token("bad signature")
        return self._principal(claims)

    def _principal(self, claims: dict[str, Any]) -> Principal:
        tenant = claims.get(self.tenant_claim, DEFAULT_TENANT)
        if not isinstance(tenant, str) or not valid_tenant(tenant):
            raise invalid_token(f"`{self.tenant_claim}` must be a plain name")
        limits = {}
        rules = self.rules
        for name in ("rpm", "tpm"):
            value = claims.get(name, getattr(rules.plan, name))
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise invalid_token(f"`{name}` must be a whole number >= 0")
            limits[name] = value
        priority = rules.priorities.default
        if rules.priorities.configured and self.priority_claim in claims:
            named = claims[self.priority_claim]
            if not isinstance(named, str) or named not in rules.priorities.classes:
                raise invalid_token(
                    f"`{self.priority_claim}` must be one of the priority "
                    f"classes ({rules.priorities.spelled})"
                )
            priority = named
        models = claims.get("models")
        if models is not None:  # a list of served names, or one comma-separated string
            if isinstance(models, list) and all(isinstance(m, str) for m in models):
                models = ",".join(models)
            try:
                models = parse_models(models) if isinstance(models, str) else None
            except ValueError:
                models = None
            if models is None:
                raise invalid_token("`models` must list served model names")
        subject = f"{claims['iss']}\n{claims['sub']}".encode()
        return Principal(
            "jwt-" + hashlib.sha256(subject).hexdigest()[:16],
            tenant,
            Plan(**limits),
            priority,
            rules.weights.get(tenant, 1),
            models,
        )
