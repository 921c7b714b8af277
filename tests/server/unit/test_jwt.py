"""JWT verification against a JWKS: only the valid token gets through; claims map to a
tenant and a plan; a JWKS that cannot verify anything is refused."""

from __future__ import annotations

import json

import pytest
from jwt_helpers import AUDIENCE, ISSUER, Issuer, bad_tokens, jwks
from sluice_server.core.auth.credentials import Credentials
from sluice_server.core.auth.identity import Plan
from sluice_server.core.auth.jwks import JwtVerifier
from sluice_server.core.errors import ApiError

RSA, EC = Issuer("rsa-1", "rsa"), Issuer("ec-1", "ec")


def verifier(*issuers: Issuer, **kw) -> JwtVerifier:
    return JwtVerifier(jwks(*(issuers or (RSA, EC))), ISSUER, AUDIENCE, **kw)


def test_valid_tokens_map_claims_to_tenant_and_plan():
    v = verifier(rules=Plan(rpm=5, tpm=50))
    who = v.verify(RSA.token(tenant="acme", rpm=100))
    assert who.tenant == "acme" and who.plan == Plan(100, 50)
    assert who.id.startswith("jwt-") and "user-1" not in who.id
    who_ec = v.verify(EC.token())
    assert who_ec.tenant == "default" and who_ec.plan == Plan(5, 50)
    assert who_ec.id == who.id  # the same subject of the same issuer: one bucket
    assert v.verify(RSA.token(sub="user-2")).id != who.id
    custom = verifier(tenant_claim="org")
    assert custom.verify(RSA.token(org="globex")).tenant == "globex"


def test_a_models_claim_limits_the_served_names():
    v = verifier()
    assert v.verify(RSA.token()).models is None  # every served name
    assert v.verify(RSA.token(models=["legal-v2", "base"])).models == {"legal-v2", "base"}
    assert v.verify(RSA.token(models="legal-v2,base")).models == {"legal-v2", "base"}


@pytest.mark.parametrize("name", list(bad_tokens(RSA)))
def test_only_the_valid_token_is_admitted(name):
    token = bad_tokens(RSA)[name]
    with pytest.raises(ApiError) as e:
        verifier().verify(token)
    assert e.value.status == 401 and e.value.code == "invalid_token"
    assert token not in e.value.message and token[-20:] not in e.value.message


@pytest.mark.parametrize("claims, says", [
    ({"tenant": "a b"}, "plain name"),
    ({"rpm": "10"}, "`rpm` must be"),
    ({"tpm": -1}, "`tpm` must be"),
    ({"models": []}, "`models` must list"),
    ({"models": [1]}, "`models` must list"),
    ({"models": "a b"}, "`models` must list"),
])  # fmt: skip
def test_bad_claims_are_refused(claims, says):
    with pytest.raises(ApiError, match=says):
        verifier().verify(RSA.token(**claims))


def test_jwks_that_verifies_nothing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no RS256 or ES256"):
        JwtVerifier({"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}, ISSUER, AUDIENCE)
    private = {**RSA.jwk, "d": "AQAB"}
    with pytest.raises(ValueError, match="private key"):
        JwtVerifier({"keys": [private]}, ISSUER, AUDIENCE)
    with pytest.raises(ValueError, match='"keys"'):
        JwtVerifier([RSA.jwk], ISSUER, AUDIENCE)
    bad = tmp_path / "jwks.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        JwtVerifier.from_file(bad, ISSUER, AUDIENCE)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(jwks(RSA)))
    assert JwtVerifier.from_file(good, ISSUER, AUDIENCE).verify(RSA.token()).tenant == "default"


def test_keys_and_tokens_side_by_side():
    from sluice_server.core.auth.apikeys import KeyStore

    both = Credentials(KeyStore.parse("sk-key-1 tenant=keys\n"), verifier())
    assert both.authenticate("sk-key-1").tenant == "keys"
    assert both.authenticate(RSA.token(tenant="tok")).tenant == "tok"
    with pytest.raises(ApiError) as e:
        both.authenticate(bad_tokens(RSA)["expired"])
    assert "expired" in e.value.message
    with pytest.raises(ApiError):
        both.authenticate("sk-nope")
    only_jwt = Credentials(None, verifier())
    with pytest.raises(ApiError) as e:
        only_jwt.authenticate("sk-key-1")
    assert e.value.code == "invalid_token"
    with pytest.raises(ApiError) as e:
        only_jwt.authenticate(None)
    assert e.value.status == 401
    assert Credentials().authenticate(None).tenant == "anonymous"
