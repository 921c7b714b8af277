"""An issuer for tests: RSA and EC key pairs, their JWKS, and tokens good and bad
(expired, not yet valid, wrong issuer/audience/key, `alg: none`, HS256 signed with the
public key: the HS/RS confusion attack)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "https://issuer.example"
AUDIENCE = "sluice-chat"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Issuer:
    def __init__(self, kid: str = "rsa-1", kind: str = "rsa") -> None:
        self.kid, self.kind = kid, kind
        if kind == "rsa":
            self.private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.alg = "RS256"
            jwk = RSAAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        else:
            self.private = ec.generate_private_key(ec.SECP256R1())
            self.alg = "ES256"
            jwk = ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        self.jwk = {**jwk, "kid": kid, "use": "sig", "alg": self.alg}

    @property
    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def token(self, ttl: float = 300, **claims) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "iat": now,
                "exp": now + ttl, **claims}  # fmt: skip
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(body, self.private, algorithm=self.alg, headers={"kid": self.kid})

    def unsigned(self, alg: str, secret: bytes | None = None, **claims) -> str:
        """A token whose header names `alg`, signed by hand: `none` (no signature) or HS256
        with `secret` (e.g. the public key's PEM)."""
        now = int(time.time())
        head = _b64(json.dumps({"alg": alg, "typ": "JWT", "kid": self.kid}).encode())
        body = _b64(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1",
                                "exp": now + 300, **claims}).encode())  # fmt: skip
        signing = f"{head}.{body}".encode()
        sig = "" if secret is None else _b64(hmac.new(secret, signing, hashlib.sha256).digest())
        return f"{head}.{body}.{sig}"


def jwks(*issuers: Issuer) -> dict:
    return {"keys": [i.jwk for i in issuers]}


def bad_tokens(good: Issuer) -> dict[str, str]:
    """Every way a token must be refused, by name."""
    stranger = Issuer(kid=good.kid)  # same kid, another key
    now = int(time.time())
    return {
        "expired": good.token(ttl=-120),
        "not yet valid": good.token(nbf=now + 600),
        "wrong issuer": good.token(iss="https://evil.example"),
        "wrong audience": good.token(aud="another-app"),
        "no exp": good.token(exp=None),
        "no sub": good.token(sub=None),
        "wrong key": stranger.token(),
        "unknown kid": Issuer(kid="other").token(),
        "alg none": good.unsigned("none"),
        "HS256 with the public key": good.unsigned("HS256", secret=good.public_pem),
        "tampered": good.token()[:-4] + "AAAA",
    }
