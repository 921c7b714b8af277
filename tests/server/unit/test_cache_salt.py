"""The prefix cache's salt for a caller's tenant (core/auth/cachesalt.py): pure, so a router
computes what the pod sends the engine. A client's own salt is checked as vLLM checks it,
by the raw-body check and by the request models' field type alike."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter
from sluice_server.core.auth.cachesalt import PREFIX, cache_salt_for, check_client_salt
from sluice_server.engine.base import ClientSalt


def test_each_tenant_gets_its_own_salt():
    a, b = cache_salt_for("acme", None, False), cache_salt_for("globex", None, False)
    assert a != b and a is not None and b is not None
    assert a == cache_salt_for("acme", None, False)  # the same every time, in every process
    assert a.startswith(PREFIX) and len(a) == len(PREFIX) + 32
    assert "acme" not in a  # a hash, never the tenant or the client's salt in clear


def test_a_clients_salt_narrows_its_tenants_and_never_replaces_it():
    mine = cache_salt_for("acme", "alice", False)
    assert mine not in (cache_salt_for("acme", None, False), "alice")
    assert mine != cache_salt_for("globex", "alice", False)  # another tenant, same salt
    # tenant and client salt cannot run into each other
    assert cache_salt_for("a", "b.c", False) != cache_salt_for("a.b", "c", False)


@pytest.mark.parametrize("client", [None, "alice"])
def test_shared_or_without_auth_only_the_clients_salt_counts(client):
    assert cache_salt_for("acme", client, True) == client
    assert cache_salt_for(None, client, False) == client


@pytest.mark.parametrize("salt, ok", [
    (None, True), ("s" * 128, True), ("", False), ("s" * 129, False), (3, False),
    ("a/b", False), ("a@b", False), ("a\\b", False), ("a\x00b", False),
])  # fmt: skip
def test_a_clients_salt_is_what_vllm_accepts(salt, ok):
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    try:
        check_client_salt(salt)
        ours = True
    except ValueError:
        ours = False
    typed = TypeAdapter(ClientSalt | None)  # the request models' field (and its schema)
    try:
        typed.validate_python(salt)
        schema = True
    except ValueError:
        schema = False
    try:
        validate_cache_salt(salt)
        theirs = True
    except Exception:  # vLLM's VLLMValidationError
        theirs = False
    assert ours == schema == theirs == ok


def test_every_salt_we_send_is_one_vllm_accepts():
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    validate_cache_salt(cache_salt_for("a" * 63, "s" * 128, False))


@pytest.mark.parametrize(
    "argv, shared", [([], False), (["--share-prefix-cache-across-tenants", "true"], True)]
)
def test_the_flag_as_the_operator_renders_it(argv, shared):
    from sluice_server.settings import parse_settings

    assert parse_settings(["--model", "m", *argv]).share_prefix_cache_across_tenants is shared
