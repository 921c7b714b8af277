"""Priority classes and tenant weights, wherever a caller gets them: the key file's
`priority=` and `weight=` (one grammar with tenant and limits), a JWT's priority claim,
`--tenant-weights`, the defaults; and every bad value refused at start-up with a clear
message (never the key)."""

from __future__ import annotations

import pytest
from jwt_helpers import AUDIENCE, ISSUER, Issuer, jwks
from pydantic import ValidationError
from sluice_server.app import caller_rules
from sluice_server.core.auth.apikeys import GRAMMAR, KeyStore
from sluice_server.core.auth.credentials import Credentials
from sluice_server.core.auth.identity import CallerRules, Plan, Priorities
from sluice_server.core.auth.jwks import JwtVerifier
from sluice_server.core.errors import ApiError
from sluice_server.settings import Settings, parse_settings

RULES = CallerRules(Plan(60, 0), Priorities(("interactive", "batch")), {"acme": 3})
RSA = Issuer("rsa-1", "rsa")


def test_key_lines_give_priority_and_the_tenants_weight():
    ks = KeyStore.parse(
        "sk-1 tenant=acme priority=interactive\n"
        "sk-2 tenant=acme weight=3\n"  # agrees with --tenant-weights
        "sk-3 tenant=free weight=2 priority=batch rpm=5\n"
        "sk-4 tenant=free\n"
        "sk-5\n"
        "sk-6 tenant=acme models=legal-v2,qwen priority=interactive\n",  # the adapters' scoping
        RULES,
    )
    one, two, three, four, five, six = (ks.match(f"sk-{i}") for i in range(1, 7))
    assert (one.priority, one.weight, two.priority, two.weight) == ("interactive", 3, "batch", 3)
    assert (three.priority, three.weight, three.plan) == ("batch", 2, Plan(5, 0))
    assert four.weight == 2  # the tenant's weight, given on another of its lines
    assert (five.tenant, five.priority, five.weight) == ("default", "batch", 1)
    assert (six.models, six.priority, six.weight) == ({"legal-v2", "qwen"}, "interactive", 3)
    assert one.models is None  # every served name
    assert ks.weights == {"acme": 3, "free": 2}
    assert GRAMMAR == "KEY [tenant=NAME] [rpm=N] [tpm=N] [models=A,B] [priority=CLASS] [weight=N]"


@pytest.mark.parametrize("text, says", [
    ("sk-secret-1 priority=urgent\n", "line 1: priority must be one of the priority classes "
                                      "(interactive, batch)"),
    ("sk-secret-1 weight=-1\n", "line 1: weight must be a whole number from 1 to 1000"),
    ("sk-secret-1 weight=0\n", "line 1: weight must be a whole number from 1 to 1000"),
    ("sk-secret-1 weight=1.5\n", "line 1: weight must be a whole number"),
    ("sk-secret-1 tenant=x weight=2\nsk-secret-2 tenant=x weight=3\n",
     "line 2: tenant x gets weight 3 here and 2 on line 1: one tenant has one weight"),
    ("sk-secret-1 tenant=acme weight=2\n",
     "line 1: tenant acme gets weight 2 here and 3 on --tenant-weights"),
    ("sk-secret-1 priority=batch priority=batch\n", "line 1: expected `KEY [tenant=NAME]"),
])  # fmt: skip
def test_bad_priorities_and_weights_refuse_the_file(text, says):
    with pytest.raises(ValueError) as e:
        KeyStore.parse(text, RULES)
    assert says in str(e.value) and "sk-secret" not in str(e.value)


def test_a_priority_needs_classes():
    with pytest.raises(ValueError) as e:
        KeyStore.parse("sk-secret-1 priority=batch\n")
    assert "priority needs --priority-classes" in str(e.value)


def test_jwt_priority_claim_and_the_tenants_weight():
    v = JwtVerifier(jwks(RSA), ISSUER, AUDIENCE, rules=RULES, priority_claim="tier")
    assert v.verify(RSA.token(tier="interactive")).priority == "interactive"
    assert v.verify(RSA.token()).priority == "batch"  # no claim: the default class
    both = v.verify(RSA.token(tier="interactive", models=["legal-v2", "qwen"]))
    assert (both.priority, both.models) == ("interactive", {"legal-v2", "qwen"})
    with pytest.raises(ApiError) as e:
        v.verify(RSA.token(tier="urgent"))
    assert e.value.status == 401 and "`tier` must be one of the priority classes" in e.value.message
    # A tenant's weight is the tenant's, never a claim: the key file's wins for its tenants.
    keys = KeyStore.parse("sk-k tenant=globex weight=5\n", RULES)
    creds = Credentials(keys, v, RULES)
    assert creds.authenticate(RSA.token(tenant="globex")).weight == 5
    assert creds.authenticate(RSA.token(tenant="acme")).weight == 3  # --tenant-weights
    assert creds.authenticate(RSA.token(tenant="other")).weight == 1
    # Without classes the claim is not read at all.
    plain = JwtVerifier(jwks(RSA), ISSUER, AUDIENCE, priority_claim="tier")
    assert plain.verify(RSA.token(tier="urgent")).priority == "default"


def test_flags_build_the_rules():
    s = parse_settings(["--model", "m", "--priority-classes", "interactive,batch",
                        "--default-priority", "interactive", "--tenant-weights", "acme=3, b=1",
                        "--queue-size", "64"])  # fmt: skip
    rules = caller_rules(s)
    assert rules.priorities.names == ("interactive", "batch")
    assert rules.priorities.default == "interactive" and rules.weights == {"acme": 3, "b": 1}
    assert s.queue_timeout == 30.0
    assert caller_rules(Settings(model="m")).priorities.names == ("default",)


@pytest.mark.parametrize("argv, says", [
    (["--queue-timeout-seconds", "5"], "--queue-timeout-seconds needs --queue-size"),
    (["--queue-size", "-1"], "greater than or equal to 0"),
    (["--priority-classes", "high,High"], "priority class names must match"),
    (["--priority-classes", "a,a"], "must not repeat"),
    (["--priority-classes", "a,b", "--default-priority", "c"], "--default-priority c is not one"),
    (["--default-priority", "a"], "--default-priority needs --priority-classes"),
    (["--tenant-weights", "acme=-1"], "weight is a whole number from 1 to 1000"),
    (["--tenant-weights", "acme"], "TENANT=WEIGHT"),
    (["--tenant-weights", "a/b=2"], "tenant names must match"),
])  # fmt: skip
def test_bad_flags_fail_at_start_up(argv, says):
    with pytest.raises(ValidationError) as e:
        parse_settings(["--model", "m", *argv])
    assert says in str(e.value)


def test_priority_classes_start_vllm_with_its_priority_policy():
    from sluice_server.engine.vllm_argv import vllm_cli_args

    plain = vllm_cli_args(Settings(model="m"), "/m", cpu_defaults=False)
    assert "--scheduling-policy" not in plain  # vLLM's default: first come, first served
    s = Settings(model="m", priority_classes=["interactive", "batch"])
    args = vllm_cli_args(s, "/m", cpu_defaults=False)
    assert args[args.index("--scheduling-policy") + 1] == "priority"


def test_vllm_routes_see_the_callers_priority_never_the_clients():
    from sluice_server.engine.vllm_api import PRIORITY_HEADER, _at_priority
    from starlette.requests import Request

    async def receive():  # pragma: no cover - never called
        return {"type": "http.request"}

    state: dict = {}
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "state": state,
             "headers": [(b"x-vllm-priority", b"-100"), (b"content-type", b"application/json")]}  # fmt: skip
    seen = _at_priority(Request(scope, receive), 1)
    assert seen.headers.getlist(PRIORITY_HEADER.decode()) == ["1"]  # vLLM prefers the header
    assert seen.headers["content-type"] == "application/json" and seen.scope["state"] is state
    assert _at_priority(None, 1) is None
